"""The vectorised torch CPU path (and the CPU dispatch) against the per-request reference."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_matches, make_spec, random_case
from lamina.kernels import (backend_for, paged_attention, paged_attention_batched,
                            paged_attention_ref)

HEADS = [(4, 4), (6, 2), (16, 2)]  # GQA ratios 1, 3, 8
MASKS = [(None, None), (24, None), (None, 30.0), (40, 2.5)]  # (window, softcap)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"w{m[0]}-cap{m[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_matches_reference(heads, mask, dtype, seed):
    case = random_case(1000 * seed + 17 * HEADS.index(heads) + MASKS.index(mask),
                       num_heads=heads[0], num_kv_heads=heads[1], head_dim=16, dtype=dtype,
                       max_ctx=300, window=mask[0], softcap=mask[1])
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_batched(*case.args())
    assert_matches(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_batched_small_request_and_query_chunks(seed):
    """Tiny budgets force many request chunks (sorted by length) and query chunks."""
    case = random_case(seed, num_heads=6, num_kv_heads=2, head_dim=16, num_requests=(4, 10),
                       max_ctx=120, max_q=24, window=30 if seed % 2 else None)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_batched(*case.args(), max_score_elems=500,
                                     min_chunk_bytes=0)
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)


def test_batched_head_dim_64_decode_smollm_shape():
    case = random_case(7, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(32, 32),
                       decode_only=True, allow_empty=False)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention_batched(*case.args())
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)


def test_cpu_dispatch_uses_torch_path(monkeypatch, kernels):
    kernels("torch")
    assert backend_for(torch.device("cpu")) == "torch"
    case = random_case(3, num_heads=6, num_kv_heads=3, head_dim=16)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    o, lse = paged_attention(*case.args())
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)
    kernels("ref")
    assert backend_for(torch.device("cpu")) == "ref"
    with pytest.raises(ValueError, match="LAMINA_KERNELS"):
        kernels("bogus")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch, kernels):
    kernels("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET|triton is not installed"):
        backend_for(torch.device("cpu"))


def test_batched_degenerate_inputs():
    spec = make_spec(4, 2, 16)
    pool = torch.randn(8, 2, 16)
    empty_q = torch.zeros(0, 4, 16)
    none = torch.zeros(0, dtype=torch.long)
    o, lse = paged_attention_batched(empty_q, pool, pool, torch.tensor([0]), torch.tensor([0]),
                                     none, none, none, spec)
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)
    q = torch.randn(2, 4, 16)  # two requests, both with empty shards
    o, lse = paged_attention_batched(q, pool, pool, torch.tensor([0, 1, 2]),
                                     torch.tensor([0, 0, 0]), torch.zeros(0, dtype=torch.long),
                                     torch.tensor([3, 4]), torch.tensor([0, 0]), spec)
    assert torch.all(o == 0) and torch.isneginf(lse).all()


def test_without_triton_cpu_falls_back_and_cuda_raises(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    kernels("auto")
    assert backend_for(torch.device("cpu")) in ("cpp", "torch")  # no Triton on CPU anyway
    with pytest.raises(RuntimeError, match="triton is not installed"):
        backend_for(torch.device("cuda"))
