"""Compiled Triton kernels on CUDA against the torch reference (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_matches, random_case

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
