"""The sparse-op CPU path (``paged_attention_cpu``, the CPU default) against the reference."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from kernel_cases import assert_matches, make_spec, random_case
from lamina.kernels import paged_attention, paged_attention_cpu, paged_attention_ref, plan_cache
from lamina.kernels.torch_sparse import sparse_eligible

HEADS = [(4, 4), (6, 2), (16, 2)]  # GQA ratios 1, 3, 8
MASKS = [(None, None), (24, None), (None, 30.0), (40, 2.5)]  # (window, softcap)


def _check(case, dtype=torch.float32, **kw):
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_cpu(*case.args(), **kw)
    assert_matches(o, lse, ref_o, ref_lse, dtype)
    return o, lse


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"w{m[0]}-cap{m[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_path_matches_reference(heads, mask, dtype, seed):
    """Ragged contexts 1-300, shuffled slots (unused ones NaN), decode and extend, empty shards.
    bfloat16 pools take the padded fallback; float32 ones the sparse path."""
    case = random_case(7000 + 1000 * seed + 17 * HEADS.index(heads) + MASKS.index(mask),
                       num_heads=heads[0], num_kv_heads=heads[1], head_dim=16, dtype=dtype,
                       num_requests=(1, 12), max_ctx=300, window=mask[0], softcap=mask[1])
    assert sparse_eligible(case.q, case.k_pool, case.v_pool) == (dtype == torch.float32)
    _check(case, dtype)


@pytest.mark.parametrize("max_sparse_q", [1, 3, 8, 64])
@pytest.mark.parametrize("cost", [0.0, 2.5, float("inf")], ids=lambda c: f"cost{c}")
@pytest.mark.parametrize("seed", range(3))
def test_sparse_and_padded_groups_split_any_way(max_sparse_q, cost, seed):
    """Extend requests go to either path (``cost`` 0: all sparse, inf: all with more than
    ``max_sparse_q`` queries padded); decode and extend rows interleave in the output."""
    case = random_case(300 + seed, num_heads=6, num_kv_heads=2, head_dim=16,
                       num_requests=(6, 14), max_ctx=200, max_q=24,
                       window=30 if seed == 1 else None, softcap=5.0 if seed == 2 else None)
    _check(case, max_sparse_q=max_sparse_q, sparse_extend_cost=cost)
    _check(case, max_sparse_q=max_sparse_q, sparse_extend_cost=cost, max_score_elems=500,
           min_chunk_bytes=0)


def test_prefill_of_ragged_prompts_goes_sparse_and_dense_blocks_padded():
    """The cost rule: many ragged prompts pad a lot (sparse); one chunk over a long context is a
    dense block (padded bmm)."""
    from lamina.kernels.torch_sparse import _build_plan
    spec = make_spec(9, 3, 16)

    def plan(q_lens, kv_lens):
        qo = torch.tensor([0] + q_lens).cumsum(0)
        kv = torch.tensor([0] + kv_lens).cumsum(0)
        pos = torch.cat([torch.arange(k - q, k) for q, k in zip(q_lens, kv_lens)])
        return _build_plan(int(qo[-1]), int(kv[-1]), qo, kv, torch.arange(int(kv[-1])), pos,
                           torch.zeros(len(q_lens), dtype=torch.long), spec, 8, 2.5, 1 << 24,
                           4 << 20)

    ragged = list(range(16, 161, 9))
    p = plan(ragged, ragged)
    assert p.pattern is not None and not p.extend
    p = plan([256, 1], [1024, 50])
    assert len(p.extend) == 1 and p.pattern is not None and p.rows.tolist() == [256]


@pytest.mark.parametrize("seed", range(2))
def test_smollm_shape_decode(seed):
    """The shape that dominates end-to-end decode: 9 q heads, 3 kv heads, head_dim 64."""
    case = random_case(70 + seed, num_heads=9, num_kv_heads=3, head_dim=64,
                       num_requests=(16, 64), decode_only=True, allow_empty=False)
    _check(case)


def test_float32_pool_with_bfloat16_queries():
    case = random_case(11, num_heads=6, num_kv_heads=3, head_dim=16, num_requests=(4, 8))
    case = replace(case, q=case.q.to(torch.bfloat16))
    assert sparse_eligible(case.q, case.k_pool, case.v_pool)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_cpu(*case.args())
    assert o.dtype == torch.bfloat16
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_non_contiguous_pool_falls_back():
    case = random_case(12, num_heads=4, num_kv_heads=2, head_dim=16)
    k_big = torch.stack([case.k_pool, case.k_pool], dim=1)  # [S, 2, Hkv, D]
    case = replace(case, k_pool=k_big[:, 0])
    assert not case.k_pool.is_contiguous()
    assert not sparse_eligible(case.q, case.k_pool, case.v_pool)
    _check(case)


def test_plan_is_reused_only_for_equal_indices():
    """Every layer of a step shares index tensors; a changed index must never hit a stale plan."""
    plan_cache.clear()
    case = random_case(21, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(5, 9))
    o1, lse1 = _check(case)
    assert len(plan_cache._entries()) == 1
    o2, lse2 = _check(case)  # cached plan
    assert len(plan_cache._entries()) == 1
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    o3, lse3 = _check(case, cache=False)
    assert torch.equal(o1, o3) and torch.equal(lse1, lse3)
    # same shapes, different slots (mutated in place): must be rebuilt
    perm = torch.randperm(case.kv_indices.numel(), generator=torch.Generator().manual_seed(0))
    case.kv_indices.copy_(case.kv_indices[perm].clone())
    _check(case)
    # same shapes, different positions
    case.q_positions.add_(3)
    _check(case)
    assert len(plan_cache._entries()) == 3
    # another layer's pool with the same indices reuses the plan and reads the new pool
    other = replace(case, k_pool=case.k_pool * 0.5, v_pool=-case.v_pool)
    _check(other)
    assert len(plan_cache._entries()) == 3
    for i in range(plan_cache.CAPACITY + 2):  # capacity is bounded
        _check(random_case(400 + i, num_heads=4, num_kv_heads=2, head_dim=16))
    assert len(plan_cache._entries()) == plan_cache.CAPACITY


def test_plan_cache_bytes_are_bounded(monkeypatch):
    plan_cache.clear()
    monkeypatch.setattr(plan_cache, "CAPACITY_BYTES", 1)
    cases = [random_case(450 + i, num_heads=4, num_kv_heads=2, head_dim=16) for i in range(3)]
    for case in cases + cases:
        _check(case)
        assert len(plan_cache._entries()) == 1  # only the newest plan is kept
    plan_cache.clear()


def test_window_and_softcap_layers_share_indices_but_not_plans():
    """Layers with different windows may get the same index tensors: the plan key has the window."""
    case = random_case(31, num_heads=6, num_kv_heads=3, head_dim=16, num_requests=(6, 10))
    for window, softcap in [(None, None), (16, None), (None, 10.0), (5, 3.0), (None, None)]:
        _check(replace(case, spec=make_spec(6, 3, 16, window, softcap)))


def test_threads_keep_their_own_plans():
    cases = [random_case(40 + i, num_heads=6, num_kv_heads=2, head_dim=16,
                         num_requests=(4, 10)) for i in range(4)]
    refs = [paged_attention_ref(*c.args()) for c in cases]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                for c, (ro, rl) in zip(cases[i:] + cases[:i], refs[i:] + refs[:i]):
                    o, lse = paged_attention_cpu(*c.args())
                    assert_matches(o, lse, ro, rl, torch.float32)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_degenerate_inputs():
    spec = make_spec(4, 2, 16)
    pool = torch.randn(8, 2, 16)
    none = torch.zeros(0, dtype=torch.long)
    o, lse = paged_attention_cpu(torch.zeros(0, 4, 16), pool, pool, torch.tensor([0]),
                                 torch.tensor([0]), none, none, none, spec)
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)
    q = torch.randn(2, 4, 16)  # two requests, both with empty shards
    o, lse = paged_attention_cpu(q, pool, pool, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]),
                                 none, torch.tensor([3, 4]), torch.tensor([0, 0]), spec)
    assert torch.all(o == 0) and torch.isneginf(lse).all()
    # both requests see nothing: their shards lie after the queries
    o, lse = paged_attention_cpu(q, pool, pool, torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]),
                                 torch.tensor([5, 1, 6, 2]), torch.tensor([3, 4]),
                                 torch.tensor([10, 20]), spec)
    assert torch.all(o == 0) and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="do not match spec"):
        paged_attention_cpu(q, pool, pool, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]),
                            none, torch.tensor([3, 4]), torch.tensor([0, 0]), make_spec(4, 4, 16))


def test_cpu_dispatch_uses_sparse_path(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    kernels("torch")
    calls = []

    def spy(*args, **kw):
        calls.append(1)
        return paged_attention_cpu(*args, **kw)

    monkeypatch.setattr(dispatch, "paged_attention_cpu", spy)
    case = random_case(5, num_heads=6, num_kv_heads=3, head_dim=16)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention(*case.args())
    assert calls == [1]
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)


def test_int64_csr_indices(monkeypatch):
    """Pools of 2**31 rows or more get int64 CSR/bag indices; force that path on a small pool."""
    import lamina.kernels.torch_sparse as torch_sparse
    monkeypatch.setattr(torch_sparse, "_INT32_LIMIT", 1)
    case = random_case(51, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(3, 8))
    _check(case, cache=False)


def test_slots_outside_the_pool_raise():
    case = random_case(52, num_heads=4, num_kv_heads=2, head_dim=16, num_requests=(3, 6),
                       decode_only=True, allow_empty=False)
    bad = case.kv_indices.clone()
    bad[-1] = case.k_pool.shape[0]
    with pytest.raises(IndexError):
        paged_attention_ref(*replace(case, kv_indices=bad).args())
    with pytest.raises(IndexError, match="outside the pool"):
        paged_attention_cpu(*replace(case, kv_indices=bad).args(), cache=False)


def test_buffers_made_in_inference_mode_work_outside_it():
    """Plans and the padded path's workspace are per thread and reused: one first made under
    ``torch.inference_mode`` (the serving engine) must stay writable outside it, and back."""
    decode = random_case(61, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(4, 8),
                         decode_only=True, allow_empty=False)
    mixed = random_case(62, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(4, 8),
                        max_q=24)  # prefill chunks: the padded path and its workspace
    errors: list[BaseException] = []

    def work() -> None:  # a fresh thread: empty plan cache and workspace
        try:
            for _ in range(2):
                for case in (decode, mixed):
                    with torch.inference_mode():
                        _check(case, max_sparse_q=1)
                    _check(case, max_sparse_q=1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors[0]


def test_batched_backend_selects_the_padded_path(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    kernels("batched")
    assert dispatch.backend_for(torch.device("cpu")) == "batched"
    calls = []
    monkeypatch.setattr(dispatch, "paged_attention_cpu", lambda *a, **k: calls.append(1))
    case = random_case(6, num_heads=6, num_kv_heads=3, head_dim=16)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention(*case.args())
    assert not calls
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)
