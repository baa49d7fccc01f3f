"""Compiled Triton kernels on CUDA against the torch reference (skipped without a GPU)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernel_cases import assert_matches, random_case
from lamina.types import AttentionSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS = [(4, 4), (6, 2), (32, 8), (16, 2), (9, 3)]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", [(None, None), (64, None), (None, 30.0), (100, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_cuda_matches_reference(heads, mask, dtype, head_dim):
    from lamina.kernels import paged_attention, paged_attention_ref
    case = random_case(HEADS.index(heads) * 31 + head_dim, num_heads=heads[0],
                       num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype,
                       num_requests=(1, 12), max_ctx=1500, max_q=70, window=mask[0],
                       softcap=mask[1]).to("cuda")
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention(*case.args())  # CUDA -> Triton
    assert_matches(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "k16v8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_cuda_reads_8bit_pools(name, dtype):
    """KV formats on the GPU: the pool as stored with its scales, against the reference
    (dequantise, then attend); device indptrs, so the eager kernel (the graphed one below)."""
    from lamina.kernels import paged_attention, paged_attention_ref
    from lamina.kernels.kv_format import kv_format
    fmt = kv_format(name)
    case = random_case(17, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
                       num_requests=(1, 12), max_ctx=1500, max_q=40).to("cuda")
    (kq, ks), (vq, vs) = fmt.k.quantize(case.k_pool), fmt.v.quantize(case.v_pool)
    args = (case.q, fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:])
    ref_o, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs)
    o, lse = paged_attention(*args, k_scale=ks, v_scale=vs)
    assert_matches(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("kv_chunk", [64, 256, 100000])
def test_triton_cuda_split_sizes_decode(kv_chunk):
    from lamina.kernels import paged_attention_ref
    from lamina.kernels.triton_attention import paged_attention_triton
    case = random_case(5, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       num_requests=(64, 64), max_ctx=4096, decode_only=True).to("cuda")
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_triton(*case.args(), kv_chunk=kv_chunk)
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_triton_cuda_merge_states():
    from lamina.kernels import merge_states, merge_states_ref
    os_ = torch.randn(4, 33, 8, 128, device="cuda", dtype=torch.bfloat16)
    lses = torch.randn(4, 33, 8, device="cuda") * 10
    lses[1] = float("-inf")
    lses[:, 0] = float("-inf")
    o, lse = merge_states(os_, lses)
    ref_o, ref_lse = merge_states_ref(os_, lses)
    assert torch.isneginf(lse[0]).all() and torch.all(o[0] == 0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.float(), ref_o.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("batch,ctx", [(1, 20000), (3, 9000), (300, 700)])
def test_triton_cuda_default_split(batch, ctx):
    """The plan's own split (sized to the device): one long context in many parts (the merge
    loops over several part blocks), a few, and a batch too large to split."""
    from lamina.kernels import paged_attention_ref
    from lamina.kernels.triton_attention import paged_attention_triton
    case = random_case(batch, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       num_requests=(batch, batch), max_ctx=ctx, decode_only=True).to("cuda")
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_triton(*case.args())
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_triton_cuda_merge_many_rows():
    """Thousands of rows: several rows per merge program."""
    from lamina.kernels import merge_states, merge_states_ref
    os_ = torch.randn(3, 300, 32, 128, device="cuda", dtype=torch.bfloat16)
    lses = torch.randn(3, 300, 32, device="cuda") * 10
    lses[0, :7] = float("-inf")
    o, lse = merge_states(os_, lses)
    ref_o, ref_lse = merge_states_ref(os_, lses)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.float(), ref_o.float(), atol=1e-2, rtol=1e-2)


def _host_indptrs(case):
    """The memory node's calling convention: indptrs on the host, the rest on the GPU."""
    return replace(case.to("cuda"), qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr)


@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (6, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", [(None, None), (64, 20.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graphed_cuda_matches_reference(heads, mask, dtype):
    """Captured and replayed: each case is a step, each of its 3 pools a layer (one graph
    each), with prefill-like rows too."""
    from lamina.kernels import paged_attention_ref, triton_graphs
    for seed in range(3):
        case = _host_indptrs(random_case(seed * 7 + heads[0], num_heads=heads[0],
                                         num_kv_heads=heads[1], head_dim=128, dtype=dtype,
                                         num_requests=(1, 40), max_ctx=3000, max_q=9,
                                         window=mask[0], softcap=mask[1]))
        for layer in range(3):
            args = list(case.args())
            if layer:
                args[1:3] = [torch.randn_like(t.float()).to(dtype) for t in args[1:3]]
            o, lse = triton_graphs.paged_attention_graphed(*args)
            assert_matches(o, lse, *paged_attention_ref(*args), dtype)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "k16v8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graphed_cuda_reads_8bit_pools(name, dtype):
    """8-bit pools with their scales, captured and replayed (one graph per layer, the scales'
    addresses baked in with the pools'), against the reference."""
    from lamina.kernels import paged_attention_ref, triton_graphs
    from lamina.kernels.kv_format import kv_format
    fmt = kv_format(name)
    triton_graphs.clear()
    case = _host_indptrs(random_case(23, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
                                     num_requests=(1, 24), max_ctx=2000, max_q=3))
    for layer in range(2):
        (kq, ks), (vq, vs) = (fmt.k.quantize(case.k_pool.float() + layer),
                              fmt.v.quantize(case.v_pool.float() - layer))
        args = (case.q, fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:])
        for _ in range(2):  # capture, then replay
            o, lse = triton_graphs.paged_attention_graphed(*args, k_scale=ks, v_scale=vs)
            assert_matches(o, lse, *paged_attention_ref(*args, k_scale=ks, v_scale=vs), dtype)
    fams = triton_graphs._LOCAL.families
    assert len(fams) == 1 and len(next(iter(fams.values())).graphs) == 2


def test_graphed_cuda_decode_steps_share_graphs():
    """Decode steps with contexts growing by one replay one graph per layer; every step's
    result is its own (inputs uploaded per step, outputs copied out)."""
    from lamina.kernels import paged_attention_ref, plan_cache, triton_graphs
    plan_cache.clear()
    triton_graphs.clear()
    gen = torch.Generator().manual_seed(0)
    R, H, Hkv, D, layers = 8, 32, 8, 128, 2
    spec = AttentionSpec(0, H, Hkv, D, D ** -0.5)
    lens = 3000 + 100 * torch.arange(R)  # one padded shape for all 6 steps
    S = int(lens.sum()) + 64 * R
    pools = [(torch.randn(S, Hkv, D, generator=gen).cuda().bfloat16(),
              torch.randn(S, Hkv, D, generator=gen).cuda().bfloat16()) for _ in range(layers)]
    perm = torch.randperm(S, generator=gen).cuda()
    results = []
    for step in range(6):
        kv_len = lens + step
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), kv_len.cumsum(0)])
        kv_indices = perm[:int(kv_indptr[-1])]
        q_positions = (kv_len - 1).cuda()
        for k_pool, v_pool in pools:
            args = (torch.randn(R, H, D, generator=gen).cuda().bfloat16(), k_pool, v_pool,
                    torch.arange(R + 1), kv_indptr, kv_indices, q_positions,
                    torch.zeros(R, dtype=torch.int64, device="cuda"), spec)
            results.append((triton_graphs.paged_attention_graphed(*args), args))
    for (o, lse), args in results:  # checked after all replays: no output was overwritten
        assert_matches(o, lse, *paged_attention_ref(*args), torch.bfloat16)
    fams = triton_graphs._LOCAL.families
    assert len(fams) == 1 and len(next(iter(fams.values())).graphs) == layers
