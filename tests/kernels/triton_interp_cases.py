"""Triton kernels under ``TRITON_INTERPRET=1`` on CPU tensors, against the torch reference.

Not collected by default (no ``test_`` prefix): ``test_triton_interpreter.py`` runs this file in
a subprocess with ``TRITON_INTERPRET=1 LAMINA_KERNELS=triton``, because the variable must be set
before triton is imported and must not leak into other test modules. To run it by hand::

    TRITON_INTERPRET=1 LAMINA_KERNELS=triton \
        python -m pytest -q tests/kernels/triton_interp_cases.py

Sizes are small: the interpreter runs each program in numpy.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run via test_triton_interpreter.py)",
                allow_module_level=True)

from kernel_cases import assert_matches, make_spec, random_case  # noqa: E402
from lamina.kernels import backend_for, merge_states_ref, paged_attention_ref  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lamina.kernels.triton_attention import _widen16, paged_attention_triton  # noqa: E402
from lamina.kernels.triton_merge import merge_states_triton  # noqa: E402
from test_merge_states import _merge_oracle, shard_and_merge  # noqa: E402

# (num_heads, num_kv_heads, window, softcap, dtype, kv_chunk, max_ctx)
CASES = [
    (4, 4, None, None, torch.float32, 32, 300),
    (6, 2, None, None, torch.float32, 32, 300),
    (16, 2, None, None, torch.float32, None, 300),
    (6, 2, 24, None, torch.float32, 16, 120),
    (4, 4, None, 30.0, torch.float32, 32, 120),
    (16, 2, 40, 2.5, torch.float32, 32, 200),
    (6, 2, None, None, torch.bfloat16, 32, 300),
    (16, 2, 24, None, torch.bfloat16, 16, 120),
    (4, 4, None, 5.0, torch.bfloat16, None, 200),
    (6, 3, 17, None, torch.float16, 32, 120),
]


@pytest.mark.parametrize("case_id", range(len(CASES)))
def test_triton_paged_attention_matches_reference(case_id):
    H, Hkv, window, softcap, dtype, kv_chunk, max_ctx = CASES[case_id]
    case = random_case(500 + case_id, num_heads=H, num_kv_heads=Hkv, head_dim=16, dtype=dtype,
                       num_requests=(1, 4), max_ctx=max_ctx, max_q=6, window=window,
                       softcap=softcap)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_triton(*case.args(), kv_chunk=kv_chunk, block_n=16)
    assert_matches(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("name,q_dtype,kv_chunk", [
    ("int8", torch.float32, 32), ("fp8_e4m3", torch.float32, None), ("k16v8", torch.float32, 16),
    ("int8", torch.bfloat16, 32), ("k16v8", torch.bfloat16, None)])
def test_triton_reads_8bit_pools_as_the_reference(name, q_dtype, kv_chunk):
    """KV formats (lamina.kernels.kv_format): the pools as stored, scales per token and head;
    split and unsplit plans; through the graphed entry point too (its padded launch, which the
    interpreter runs eagerly)."""
    from lamina.kernels import triton_graphs
    from lamina.kernels.kv_format import kv_format
    fmt = kv_format(name)
    case = random_case(700 + len(name), num_heads=6, num_kv_heads=2, head_dim=16,
                       num_requests=(1, 4), max_ctx=200, max_q=6, window=30 if kv_chunk else None)
    (kq, ks), (vq, vs) = fmt.k.quantize(case.k_pool), fmt.v.quantize(case.v_pool)
    args = (case.q.to(q_dtype), fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:])
    ref_o, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs)
    o, lse = paged_attention_triton(*args, ks, vs, kv_chunk=kv_chunk, block_n=16)
    assert_matches(o, lse, ref_o, ref_lse, q_dtype)
    triton_graphs.clear()
    o, lse = triton_graphs.paged_attention_graphed(*args, k_scale=ks, v_scale=vs)
    assert_matches(o, lse, ref_o, ref_lse, q_dtype)
    assert len(triton_graphs._LOCAL.families) == 1  # a family's launch, not the eager path
    with pytest.raises(ValueError, match="8-bit pools need scales"):
        paged_attention_triton(*args)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_triton_16bit_dots_over_8bit_pools(name, monkeypatch):
    """The GPU's path for 8-bit pools and 16-bit queries (codes widened to float16, queries
    and weights meeting them in float16; every dot float16, which the interpreter computes
    right), forced on the interpreter: against the reference at bfloat16 tolerance."""
    from lamina.kernels import triton_attention
    from lamina.kernels.kv_format import kv_format
    monkeypatch.setattr(triton_attention, "_f32_dot", lambda q: False)
    fmt = kv_format(name)
    case = random_case(900 + len(name), num_heads=6, num_kv_heads=2, head_dim=16,
                       num_requests=(1, 4), max_ctx=200, max_q=6)
    (kq, ks), (vq, vs) = fmt.k.quantize(case.k_pool), fmt.v.quantize(case.v_pool)
    args = (case.q.to(torch.bfloat16), fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:])
    ref_o, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs)
    for kv_chunk in (32, None):
        o, lse = paged_attention_triton(*args, ks, vs, kv_chunk=kv_chunk, block_n=16)
        assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_triton_head_dims(head_dim):
    """A non-power-of-two head dim (padded to 32) and a typical one, with splitting."""
    case = random_case(head_dim, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                       num_requests=(2, 3), max_ctx=80, max_q=4)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_triton(*case.args(), kv_chunk=32, block_n=16)
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)


def test_triton_strided_q_and_long_extend():
    """q as a column slice of a fused qkv tensor; one request with 40 queries (several q blocks)."""
    case = random_case(9, num_heads=4, num_kv_heads=2, head_dim=16, num_requests=(1, 1),
                       max_ctx=60, max_q=40, allow_empty=False)
    T = case.q.shape[0]
    fused = torch.randn(T, 8, 16)
    fused[:, 2:6] = case.q
    case.q = fused[:, 2:6]
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_triton(*case.args(), kv_chunk=16, block_n=16)
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)


def test_dispatch_selects_triton():
    assert backend_for(torch.device("cpu")) == "triton"


@pytest.mark.parametrize("seed", range(4))
def test_triton_shard_split_merge(seed):
    """paged_attention / merge_states dispatch to Triton here (LAMINA_KERNELS=triton)."""
    heads = [(4, 4), (6, 2), (8, 1), (6, 2)][seed]
    shard_and_merge(seed, heads[0], heads[1], window=[None, 20, None, 7][seed],
                    softcap=[None, None, 3.0, None][seed],
                    dtype=torch.float32 if seed < 3 else torch.bfloat16, max_ctx=80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_merge_states(dtype):
    gen = torch.Generator().manual_seed(3)
    S, T, H, D = 3, 5, 3, 20
    os_ = torch.randn(S, T, H, D, generator=gen).to(dtype)
    lses = torch.randn(S, T, H, generator=gen) * 10
    lses[torch.rand(S, T, H, generator=gen) < 0.3] = float("-inf")
    lses[:, 1, 2] = float("-inf")
    os_[:, 1, 2] = 0
    exp_o, exp_lse = _merge_oracle(os_, lses)
    o, lse = merge_states_triton(list(os_), list(lses))
    assert o.dtype == dtype and torch.isneginf(lse[1, 2]) and torch.all(o[1, 2] == 0)
    torch.testing.assert_close(lse.double(), exp_lse, atol=1e-5, rtol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o.double(), exp_o, atol=tol, rtol=tol)
    ref = merge_states_ref(os_, lses)
    torch.testing.assert_close(o.float(), ref[0].float(), atol=tol, rtol=tol)


def test_triton_plan_is_reused_across_layers_and_never_stale():
    """Host indptrs: the launch plan is stored once and reused by the next call with equal
    indptrs (another layer: new q and pools), and a changed kv_indptr plans afresh."""
    from lamina.kernels import plan_cache
    plan_cache.clear()
    case = random_case(71, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(3, 4),
                       max_ctx=90, max_q=3)
    args = list(case.args())
    o1, lse1 = paged_attention_triton(*args, kv_chunk=16, block_n=16)
    assert_matches(o1, lse1, *paged_attention_ref(*args), torch.float32)
    assert len(plan_cache._entries()) == 1
    torch.manual_seed(5)  # the next layer: same indptrs and slots, other values
    args[0:3] = [torch.randn_like(t) for t in args[0:3]]
    o2, lse2 = paged_attention_triton(*args, kv_chunk=16, block_n=16)
    assert_matches(o2, lse2, *paged_attention_ref(*args), torch.float32)
    assert len(plan_cache._entries()) == 1  # reused, not stored again
    other = random_case(73, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(3, 4),
                        max_ctx=90, max_q=3)
    assert not torch.equal(other.kv_indptr, case.kv_indptr)
    o3, lse3 = paged_attention_triton(*other.args(), kv_chunk=16, block_n=16)
    assert_matches(o3, lse3, *paged_attention_ref(*other.args()), torch.float32)
    assert len(plan_cache._entries()) == 2


@pytest.mark.parametrize("S,T,H", [(20, 3, 2), (3, 512, 4)])
def test_triton_merge_part_blocks_and_row_blocks(S, T, H):
    """20 parts: one full block of 16 and a masked tail; 2048 rows: two rows per program."""
    gen = torch.Generator().manual_seed(S)
    os_ = torch.randn(S, T, H, 16, generator=gen)
    lses = torch.randn(S, T, H, generator=gen) * 5
    lses[torch.rand(S, T, H, generator=gen) < 0.3] = float("-inf")
    exp_o, exp_lse = _merge_oracle(os_, lses)
    o, lse = merge_states_triton(os_, lses)
    torch.testing.assert_close(lse.double(), exp_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(o.double(), exp_o, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case_id", range(len(CASES)))
def test_graphed_padded_launch_matches_reference(case_id, monkeypatch):
    """The graph path's padded plan (powers of two, no-op work items, static buffers), run
    eagerly by the interpreter: each call a new layer (pools), each case a new step."""
    from lamina.kernels import triton_graphs, triton_plan
    monkeypatch.setattr(triton_plan, "DEFAULT_KV_CHUNK", 16)
    H, Hkv, window, softcap, dtype, _, max_ctx = CASES[case_id]
    case = random_case(900 + case_id, num_heads=H, num_kv_heads=Hkv, head_dim=16, dtype=dtype,
                       num_requests=(1, 5), max_ctx=max_ctx, max_q=6, window=window,
                       softcap=softcap)
    for layer in range(2):
        args = list(case.args())
        if layer:
            args[0:3] = [torch.randn_like(t.float()).to(dtype) for t in args[0:3]]
        ref_o, ref_lse = paged_attention_ref(*args)
        o, lse = triton_graphs.paged_attention_graphed(*args)
        assert_matches(o, lse, ref_o, ref_lse, dtype)


def test_graphed_family_is_reused_across_steps_and_reloaded(monkeypatch):
    """Decode steps whose contexts grow by one share a padded family (its buffers and graphs);
    each step's indices are uploaded before its first call, so no step sees the last one's."""
    from lamina.kernels import plan_cache, triton_graphs, triton_plan
    monkeypatch.setattr(triton_plan, "DEFAULT_KV_CHUNK", 16)
    plan_cache.clear()
    triton_graphs.clear()
    gen = torch.Generator().manual_seed(3)
    R, S, H, Hkv, D = 3, 400, 6, 2, 16
    spec = make_spec(H, Hkv, D)
    k_pool, v_pool = (torch.randn(S, Hkv, D, generator=gen) for _ in range(2))
    perm = torch.randperm(S, generator=gen)
    lens = [70, 90, 100]
    for step in range(4):
        kv_len = torch.tensor([n + step for n in lens])
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), kv_len.cumsum(0)])
        qo_indptr = torch.arange(R + 1)
        kv_indices = perm[:int(kv_indptr[-1])]
        q_positions = kv_len - 1
        args = (torch.randn(R, H, D, generator=gen), k_pool, v_pool, qo_indptr, kv_indptr,
                kv_indices, q_positions, torch.zeros(R, dtype=torch.int64), spec)
        o, lse = triton_graphs.paged_attention_graphed(*args)
        assert_matches(o, lse, *paged_attention_ref(*args), torch.float32)
    assert len(triton_graphs._LOCAL.families) == 1


@triton.jit
def _widen(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, _widen16(tl.load(x_ptr + i)))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_widen16_is_exact(name):
    """Every 8-bit code (int8 -127..127, every finite e4m3 byte) widens to its float16 value."""
    if name == "int8":
        x = torch.arange(-127, 128, dtype=torch.int8)
    else:
        x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        x = x[torch.isfinite(x.float())]
    x = torch.cat([x, x[:256 - len(x)]])
    y = torch.empty(256, dtype=torch.float16)
    _widen[(1,)](x, y, N=256)
    assert torch.equal(y, x.float().half())
