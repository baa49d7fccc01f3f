"""merge_states: shard-split attention merges back to unsplit attention; -inf rows stay empty.

``shard_and_merge`` is shared with the Triton interpreter cases (``triton_interp_cases.py``).
"""
from __future__ import annotations

import math
import random

import torch
from hypothesis import given, settings, strategies as st

from kernel_cases import TOLERANCES, make_spec
from lamina.kernels import merge_states, merge_states_ref, paged_attention, paged_attention_ref


def shard_and_merge(seed: int, num_heads: int, num_kv_heads: int, window: int | None,
                    softcap: float | None, dtype: torch.dtype, max_ctx: int = 200,
                    max_shards: int = 4) -> None:
    """R requests, each split at random boundaries into 1..max_shards contiguous shards (empty
    shards allowed); shard i of every request is attended in one ``paged_attention`` call with its
    own ``kv_start_pos``; ``merge_states`` over the calls must equal unsplit reference attention."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    D = 16
    spec = make_spec(num_heads, num_kv_heads, D, window, softcap)
    R = rng.randint(1, 4)
    lens = [rng.randint(1, max_ctx) for _ in range(R)]
    starts = [rng.choice([0, rng.randint(0, 40)]) for _ in range(R)]
    q_lens = [rng.choice([1, 1, rng.randint(2, 6)]) for _ in range(R)]
    q_pos = []
    for n, s, t in zip(lens, starts, q_lens):
        first = s + n - t if t <= n and rng.random() < 0.8 else s + n + rng.randint(0, 3)
        q_pos += range(first, first + t)
    N, T = sum(lens), sum(q_lens)
    S = N + 5
    perm = torch.randperm(S, generator=gen)
    k_pool = torch.randn(S, num_kv_heads, D, generator=gen).to(dtype)
    v_pool = torch.randn(S, num_kv_heads, D, generator=gen).to(dtype)
    q = torch.randn(T, num_heads, D, generator=gen).to(dtype)
    slots = perm[:N]
    kv_off = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0)
    positions = torch.tensor(q_pos)

    cuts = []  # per request: sorted shard boundaries 0 = b0 <= ... <= bk = len
    for n in lens:
        k = rng.randint(1, max_shards)
        cuts.append([0] + sorted(rng.randint(0, n) for _ in range(k - 1)) + [n])
    num_shards = max(len(c) - 1 for c in cuts)
    os, lses = [], []
    for i in range(num_shards):
        idx, indptr, shard_start = [], [0], []
        for r in range(R):
            lo, hi = (cuts[r][i], cuts[r][i + 1]) if i + 1 < len(cuts[r]) else (0, 0)
            idx.append(slots[kv_off[r] + lo:kv_off[r] + hi])
            indptr.append(indptr[-1] + hi - lo)
            shard_start.append(starts[r] + lo)
        o, lse = paged_attention(q, k_pool, v_pool, qo_indptr, torch.tensor(indptr),
                                 torch.cat(idx), positions, torch.tensor(shard_start), spec)
        os.append(o)
        lses.append(lse)
    o, lse = merge_states(os, lses)
    ref_o, ref_lse = paged_attention_ref(q, k_pool, v_pool, qo_indptr, torch.tensor(kv_off),
                                         slots, positions, torch.tensor(starts), spec)
    atol, rtol, lse_atol = TOLERANCES[dtype]
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, atol=lse_atol, rtol=0)
    torch.testing.assert_close(o.float(), ref_o.float(), atol=2 * atol, rtol=2 * rtol)


@settings(max_examples=30, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1), heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
       window=st.sampled_from([None, 1, 17, 64]), softcap=st.sampled_from([None, 4.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_shard_split_merge_equals_unsplit(seed, heads, window, softcap, dtype):
    shard_and_merge(seed, heads[0], heads[1], window, softcap, dtype)


def _merge_oracle(os: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 math, row by row: lse = log sum exp(lse_i), o = sum exp(lse_i - lse) o_i."""
    S, T, H, D = os.shape
    out_o = torch.zeros(T, H, D, dtype=torch.float64)
    out_lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            ls = [float(lses[s, t, h]) for s in range(S)]
            finite = [x for x in ls if x != float("-inf")]
            if not finite:
                continue
            m = max(finite)
            total = sum(math.exp(x - m) for x in finite)
            out_lse[t, h] = m + math.log(total)
            for s in range(S):
                if ls[s] != float("-inf"):
                    out_o[t, h] += math.exp(ls[s] - m) / total * os[s, t, h].double()
    return out_o, out_lse


@settings(max_examples=25, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1), S=st.integers(1, 5), dtype=st.sampled_from(
    [torch.float32, torch.bfloat16]), as_list=st.booleans())
def test_merge_states_matches_plain_math(seed, S, dtype, as_list):
    gen = torch.Generator().manual_seed(seed)
    T, H, D = 3, 4, 24
    os = torch.randn(S, T, H, D, generator=gen).to(dtype)
    lses = torch.randn(S, T, H, generator=gen) * 20
    lses[torch.rand(S, T, H, generator=gen) < 0.3] = float("-inf")  # empty shards
    lses[:, 0, 0] = float("-inf")  # one row no shard saw
    os[:, 0, 0] = 0
    exp_o, exp_lse = _merge_oracle(os, lses)
    args = (list(os), list(lses)) if as_list else (os, lses)
    for fn in (merge_states, merge_states_ref):
        o, lse = fn(*args)
        assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (T, H)
        assert torch.isneginf(lse[0, 0]) and torch.all(o[0, 0] == 0)
        torch.testing.assert_close(lse.double(), exp_lse, atol=1e-5, rtol=1e-6)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(o.double(), exp_o, atol=tol, rtol=tol)


def test_merge_states_all_empty_rows_stay_empty():
    os = torch.zeros(3, 2, 2, 8)
    lses = torch.full((3, 2, 2), float("-inf"))
    o, lse = merge_states(os, lses)
    assert torch.all(o == 0) and torch.isneginf(lse).all()
    assert not torch.isnan(o).any()


def test_merge_rows_cpp_equals_the_reference_in_place():
    """The C++ merge of a cascade's prefix pass into chosen rows (any order, some rows left
    alone, a row whose own pass saw no key) equals the reference's, and moves nothing else."""
    import pytest

    from lamina.kernels import cpp_ext
    from lamina.kernels.reference import merge_rows_ref
    ext = cpp_ext.load()
    if ext is None:
        pytest.skip("C++ extension unavailable")
    g = torch.Generator().manual_seed(3)
    T, H, D = 11, 5, 24
    o, lse = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g) * 4
    o[7], lse[7] = 0.0, float("-inf")  # saw nothing in its own pass
    rows = torch.tensor([7, 2, 9, 0, 4])
    og, lg = torch.randn(len(rows), H, D, generator=g), torch.randn(len(rows), H, generator=g) * 4
    want_o, want_lse = o.clone(), lse.clone()
    merge_rows_ref(want_o, want_lse, rows, og, lg)
    ext.merge_rows(o, lse, rows, og, lg)
    torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(o[[1, 3, 5, 6, 8, 10]], want_o[[1, 3, 5, 6, 8, 10]])
    assert torch.equal(o[7], og[0]) and torch.equal(lse[7], lg[0])
    with pytest.raises(RuntimeError, match="out of range"):
        ext.merge_rows(o, lse, torch.tensor([T]), og[:1], lg[:1])
