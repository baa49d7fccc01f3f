"""Sampler and filtered_probs: greedy, seeded reproducibility, and goodness of fit.

The statistical tests draw 20,000 tokens from fixed logits with fixed seeds (so each test is
deterministic) and compare the counts with a distribution computed here, in float64 numpy, from
the definition (softmax of logits/T, zero outside the top-k / nucleus, renormalised), using a
hand-written chi-square statistic against the p=0.001 critical value.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lamina.computenode.sampling import Sampler, filtered_probs
from lamina.types import SamplingParams

# Eight distinct hand-written logits (token 5 is the largest, token 2 the smallest).
LOGITS = [1.2, 0.3, -1.5, 0.9, -0.4, 2.0, 0.0, -0.9]
V = len(LOGITS)

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                 8: 26.124, 9: 27.877, 10: 29.588}

ROWS, STEPS = 250, 80  # 20,000 draws per distribution


# --------------------------------------------------------------------------------------------
# Independent reference and statistics helpers
# --------------------------------------------------------------------------------------------


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Target distribution from the definition, float64. Assumes distinct logits (no ties), and
    checks that the nucleus boundary is not within float rounding of ``top_p``."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < top_k < len(p):
        keep = np.argsort(-p, kind="stable")[:top_k]
        mask = np.zeros(len(p), dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        m = int(np.searchsorted(cum, top_p, side="left")) + 1  # first prefix with mass >= top_p
        assert abs(cum[m - 1] - top_p) > 1e-3 and (m == 1 or abs(cum[m - 2] - top_p) > 1e-3), \
            "fixture too close to the nucleus boundary"
        mask = np.zeros(len(p), dtype=bool)
        mask[order[:m]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over the support of ``probs``; bins expecting
    fewer than 5 draws are pooled (with each other, then with the smallest remaining bin)."""
    n = counts.sum()
    support = np.flatnonzero(probs > 0)
    obs, exp = counts[support].astype(np.float64), probs[support] * n
    small = exp < 5
    if small.any():
        pooled_obs, pooled_exp = obs[small].sum(), exp[small].sum()
        obs, exp = list(obs[~small]), list(exp[~small])
        if pooled_exp < 5 and exp:
            j = int(np.argmin(exp))
            pooled_obs, pooled_exp = pooled_obs + obs.pop(j), pooled_exp + exp.pop(j)
        obs, exp = np.array(obs + [pooled_obs]), np.array(exp + [pooled_exp])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, len(exp) - 1


def draw_counts(params_for_row, logits=LOGITS, *, sampler_seed: int = 1234,
                rows: int = ROWS, steps: int = STEPS) -> np.ndarray:
    """Token counts over ``rows * steps`` draws: ``rows`` concurrent requests, ``steps`` calls.
    ``params_for_row(i)`` gives request ``i``'s params."""
    sampler = Sampler(seed=sampler_seed)
    batch = torch.tensor(logits, dtype=torch.float32).expand(rows, -1).contiguous()
    params = [params_for_row(i) for i in range(rows)]
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(steps):
        tokens = sampler.sample(batch, list(range(rows)), params)
        counts += np.bincount(tokens.numpy(), minlength=len(logits))
    return counts


def assert_fits(counts: np.ndarray, probs: np.ndarray) -> None:
    outside = np.flatnonzero(probs == 0)
    assert counts[outside].sum() == 0, f"drew filtered-out tokens {outside[counts[outside] > 0]}"
    stat, df = chi_square(counts, probs)
    assert stat < CHI2_CRIT_001[df], f"chi2={stat:.2f} df={df} counts={counts} expected={probs}"


def random_logits(steps: int, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, rows, vocab, generator=g) * 2.0


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_equals_argmax(dtype):
    logits = random_logits(1, 9, 40, seed=0)[0].to(dtype)
    logits[3] = 0.5  # an all-tie row: lowest index wins
    logits[4, [7, 21]] = 100.0  # a two-way tie for the max
    sampler = Sampler(seed=0)
    out = sampler.sample(logits, list(range(9)), [SamplingParams(temperature=0)] * 9)
    assert out.dtype == torch.int64 and out.device.type == "cpu" and out.shape == (9,)
    assert torch.equal(out, torch.argmax(logits, dim=1))
    assert out[3] == 0 and out[4] == 7
    assert sampler.num_requests == 0  # greedy rows never create a generator


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(1, 8, 30, seed=1)[0]
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(top_p=0.9, seed=i)
              for i in range(8)]
    out = Sampler().sample(logits, list(range(8)), params)
    assert torch.equal(out[1::2], logits[1::2].argmax(dim=1))
    assert ((out >= 0) & (out < 30)).all()


def test_empty_batch():
    out = Sampler().sample(torch.empty(0, 10), [], [])
    assert out.shape == (0,) and out.dtype == torch.int64


# --------------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------------

A = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)


def run_alone(params: SamplingParams, logits: torch.Tensor, sampler: Sampler,
              req_id: int = 0) -> list[int]:
    return [int(sampler.sample(step[:1], [req_id], [params])[0]) for step in logits]


def test_same_seed_same_tokens_across_fresh_samplers():
    logits = random_logits(30, 1, 50, seed=2)
    runs = [run_alone(A, logits, Sampler(seed=s), req_id=r) for s, r in [(1, 0), (2, 5), (None, 9)]]
    assert runs[0] == runs[1] == runs[2]
    other = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=8)
    assert run_alone(other, logits, Sampler(seed=1)) != runs[0]


@pytest.mark.parametrize("target", [A, SamplingParams(seed=123),  # filtered / unfiltered row
                                    SamplingParams(temperature=1.3, top_k=5, seed=-3)])
def test_seeded_request_is_independent_of_batch_composition_and_row(target):
    steps, rows, vocab = 25, 6, 50
    logits = random_logits(steps, rows, vocab, seed=3)
    alone = run_alone(target, logits, Sampler(seed=0))

    neighbours = [SamplingParams(temperature=0), SamplingParams(top_k=3),
                  SamplingParams(top_p=0.5, temperature=2.0), SamplingParams(seed=99),
                  SamplingParams(top_k=40, top_p=0.95, temperature=0.3)]
    sampler = Sampler(seed=1)
    batched = []
    for t in range(steps):
        pos = (3 * t) % rows  # the request moves around the batch
        n = 1 + t % rows  # and the batch changes size
        row_params = [neighbours[(t + j) % len(neighbours)] for j in range(n)]
        row_ids = [100 + j for j in range(n)]
        pos = min(pos, n - 1)
        row_params[pos], row_ids[pos] = target, 0
        batch = logits[t].clone()
        batch[pos], batch[0] = logits[t, 0], logits[t, pos]  # the target's logits follow it
        batch = batch[:n]
        tokens = sampler.sample(batch, row_ids, row_params)
        batched.append(int(tokens[pos]))
    assert batched == alone


def test_unseeded_requests_follow_the_sampler_seed():
    logits = random_logits(20, 4, 50, seed=4)
    params = [SamplingParams()] * 4

    def run(seed):
        s = Sampler(seed=seed)
        return torch.stack([s.sample(step, [0, 1, 2, 3], params) for step in logits]).T.tolist()

    first = run(11)
    assert first == run(11)
    assert first != run(12)
    assert len({tuple(r) for r in first}) == 4  # each request has its own stream


def test_release_drops_the_generator():
    logits = random_logits(10, 1, 50, seed=5)
    sampler = Sampler()
    first = run_alone(A, logits, sampler)
    assert 0 in sampler and sampler.num_requests == 1
    sampler.release(0)
    sampler.release(12345)  # unknown id: no-op
    assert sampler.num_requests == 0
    assert run_alone(A, logits, sampler) == first  # a fresh generator from the same seed


def test_generator_is_consumed_once_per_draw():
    logits = random_logits(12, 1, 50, seed=6)
    s1, s2 = Sampler(), Sampler()
    seq = run_alone(A, logits, s1)
    # Greedy samples of another request in between do not disturb it.
    mixed = []
    for step in logits:
        out = s2.sample(step.expand(2, -1), [0, 1], [A, SamplingParams(temperature=0)])
        mixed.append(int(out[0]))
    assert mixed == seq


def test_uniforms_drawn_by_one_sampler_sample_the_same_in_another():
    """The engine draws, a replica process samples: the same tokens as one Sampler alone, and
    the replica's own generators stay untouched."""
    logits = random_logits(15, 3, 50, seed=7)
    params = [A, SamplingParams(temperature=0), SamplingParams(temperature=1.1, seed=3)]
    alone, engine, replica = Sampler(seed=0), Sampler(seed=0), Sampler(seed=5)
    for step in logits:
        u = engine.draw([0, 1, 2], params)
        assert u.dtype == torch.float32 and u[1] == 0  # greedy rows consume nothing
        assert torch.equal(replica.sample(step, [0, 1, 2], params, uniforms=u),
                           alone.sample(step, [0, 1, 2], params))
    assert replica.num_requests == 0
    with pytest.raises(ValueError, match="one value per row"):
        replica.sample(logits[0], [0, 1, 2], params, uniforms=torch.zeros(2))


# --------------------------------------------------------------------------------------------
# Goodness of fit on fixed logits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature):
    counts = draw_counts(lambda i: SamplingParams(temperature=temperature))
    assert counts.sum() == ROWS * STEPS
    assert_fits(counts, reference_probs(LOGITS, temperature))
    # The check has power: the same draws are rejected against a nearby wrong temperature.
    stat, df = chi_square(counts, reference_probs(LOGITS, temperature * 1.15))
    assert stat > CHI2_CRIT_001[df]


def test_top_k_distribution():
    probs = reference_probs(LOGITS, 1.0, top_k=3)
    assert (probs > 0).sum() == 3
    assert_fits(draw_counts(lambda i: SamplingParams(top_k=3, seed=10_000 + i)), probs)


def test_top_p_distribution():
    probs = reference_probs(LOGITS, 1.0, top_p=0.8)
    assert 1 < (probs > 0).sum() < V
    assert_fits(draw_counts(lambda i: SamplingParams(top_p=0.8)), probs)


def test_top_k_then_top_p_with_temperature():
    probs = reference_probs(LOGITS, 0.7, top_k=5, top_p=0.85)
    assert 1 < (probs > 0).sum() < 5
    assert_fits(draw_counts(lambda i: SamplingParams(temperature=0.7, top_k=5, top_p=0.85)), probs)


def test_mixed_parameters_in_one_batch():
    """Batched filtering applies each row's own parameters."""
    configs = [SamplingParams(temperature=0.5), SamplingParams(top_k=3),
               SamplingParams(top_p=0.8), SamplingParams(temperature=0)]
    refs = [reference_probs(LOGITS, 0.5), reference_probs(LOGITS, 1.0, top_k=3),
            reference_probs(LOGITS, 1.0, top_p=0.8), np.eye(V)[int(np.argmax(LOGITS))]]
    rows = 4 * 100
    sampler = Sampler(seed=77)
    batch = torch.tensor(LOGITS).expand(rows, -1)
    params = [configs[i % 4] for i in range(rows)]
    counts = np.zeros((4, V), dtype=np.int64)
    for _ in range(50):  # 5,000 draws per configuration
        tokens = sampler.sample(batch, list(range(rows)), params).numpy()
        for c in range(4):
            counts[c] += np.bincount(tokens[c::4], minlength=V)
    for c in range(3):
        assert_fits(counts[c], refs[c])
    assert counts[3, np.argmax(LOGITS)] == 5000


def test_chi2_table_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df, crit in CHI2_CRIT_001.items():
        assert stats.chi2.ppf(0.999, df) == pytest.approx(crit, abs=1e-3)


# --------------------------------------------------------------------------------------------
# Filters: edge cases
# --------------------------------------------------------------------------------------------


def test_filtered_probs_matches_reference():
    x = torch.tensor(LOGITS)
    for t, k, p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8),
                    (0.7, 5, 0.7), (1.0, V, 1.0), (1.0, -1, 1.0)]:
        got = filtered_probs(x, t, k, p).double().numpy()
        np.testing.assert_allclose(got, reference_probs(LOGITS, t, k, p), atol=1e-6)


def test_filtered_probs_batched_per_row_params_and_purity():
    x = torch.tensor([LOGITS, LOGITS[::-1], LOGITS], dtype=torch.bfloat16)
    before = x.clone()
    got = filtered_probs(x, [1.0, 0.5, 0.0], [3, 0, 0], torch.tensor([1.0, 0.8, 1.0]))
    assert torch.equal(x, before) and got.dtype == torch.float32 and got.shape == (3, V)
    xf = x.float().tolist()
    np.testing.assert_allclose(got[0].numpy(), reference_probs(xf[0], 1.0, top_k=3), atol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), reference_probs(xf[1], 0.5, top_p=0.8), atol=1e-6)
    assert got[2].tolist() == np.eye(V)[int(np.argmax(xf[2]))].tolist()  # temperature 0: one-hot


def test_top_k_keeps_ties_at_the_boundary():
    probs = filtered_probs(torch.tensor([1.0, 3.0, 1.0, 1.0, 0.0]), 1.0, top_k=2)
    assert (probs > 0).tolist() == [True, True, True, True, False]


def test_tiny_top_p_keeps_only_the_top_token_and_top_k_1_is_argmax():
    logits = random_logits(1, 16, 50, seed=7)[0]
    sampler = Sampler(seed=3)
    for params in [SamplingParams(top_p=1e-9), SamplingParams(top_k=1, temperature=5.0)]:
        out = sampler.sample(logits, list(range(16)), [params] * 16)
        assert torch.equal(out, logits.argmax(dim=1))


def test_banned_tokens_are_never_drawn():
    logits = torch.zeros(64, 10)
    logits[:, ::2] = -math.inf
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler.sample(logits, list(range(64)), [SamplingParams(temperature=3.0)] * 64)
        assert (out % 2 == 1).all()


def test_large_vocab_half_precision_smoke():
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(4, 32000, generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(top_k=50, seed=1), SamplingParams(top_p=0.9, seed=2),
              SamplingParams(temperature=0.01, seed=3), SamplingParams(seed=4)]
    out = Sampler().sample(logits, [0, 1, 2, 3], params)
    top50 = logits[0].float().topk(50).indices
    assert out[0] in top50
    assert out[2] == logits[2].float().argmax()  # T=0.01 is all but greedy on these logits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=12),
       st.floats(0.05, 4.0), st.integers(-1, 14), st.floats(0.01, 1.0))
@example([0.0, 1.0, 1.0, 1.0, 1.0, 5.3e-27], 1.0, 5, 1.0)  # distinct logits, tie after x - max
def test_filtered_probs_invariants(logits, temperature, top_k, top_p):
    x = torch.tensor(logits)
    probs = filtered_probs(x, temperature, top_k, top_p).double()
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    kept = probs > 0
    assert kept[int(x.argmax())]  # the top token always survives
    if 0 < top_k < len(logits):  # survivors are within the top-k (ties included)
        assert (x[kept] >= x.topk(top_k).values[-1]).all()
    base = filtered_probs(x, temperature, top_k, 1.0).double()
    assert (kept <= (base > 0)).all()
    # Nucleus: enough mass, and no whole probability level of it can be dropped.
    assert base[kept].sum().item() >= top_p - 1e-5
    smallest = base[kept].min()
    assert base[kept & (base > smallest)].sum().item() < top_p + 1e-5


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-2), dict(max_tokens=0)])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sample_rejects_bad_arguments():
    sampler = Sampler()
    ok = SamplingParams()
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 5), [0], [ok, ok])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 5), [0, 1], [ok])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(5), [0], [ok])
    bad = SamplingParams(seed=1)
    bad.temperature = -1.0  # mutated after validation
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 5), [0, 1], [ok, bad])
    assert sampler.num_requests == 0  # validated before any generator was created
    with pytest.raises(ValueError):
        filtered_probs(torch.zeros(5), math.inf)
    with pytest.raises(ValueError):
        filtered_probs(torch.zeros(2, 5), [1.0, 1.0, 1.0])


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_match_cpu_for_seeded_requests():
    logits = random_logits(20, 5, 1000, seed=9)
    params = [SamplingParams(seed=i, top_k=[0, 50, 0, 10, 0][i], top_p=[1.0, 1.0, 0.9, 0.8, 1.0][i],
                             temperature=[1.0, 0.7, 1.0, 1.5, 0.0][i]) for i in range(5)]
    cpu, gpu = Sampler(), Sampler()
    ids = list(range(5))
    for step in logits:
        for dtype in (torch.float32, torch.bfloat16):
            a = cpu.sample(step.to(dtype), ids, params)
            b = gpu.sample(step.to(dtype).cuda(), ids, params)
            assert b.device.type == "cpu" and torch.equal(a, b)
