"""KV formats (``lamina.kernels.kv_format``): the quantiser, the C++ append (``kv_store``) and
the C++ kernel over 8-bit pools against their torch reference (dequantise, then attend)."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_matches, random_case
from lamina.kernels import cpp_ext, paged_attention_ref
from lamina.kernels.kv_format import kv_format
from lamina.types import KV_DTYPES

FORMATS = [n for n in KV_DTYPES if n != "auto"]
EIGHT_BIT = ["int8", "fp8_e4m3", "k16v8"]
needs_cpp = pytest.mark.skipif(not cpp_ext.available(),
                               reason=f"C++ kernel not built: {cpp_ext.build_error()}")


def quantised_case(case, name):
    """``case`` with its float pools stored in format ``name``: (args, k_scale, v_scale)."""
    fmt = kv_format(name)
    kq, ks = fmt.k.quantize(case.k_pool)
    vq, vs = fmt.v.quantize(case.v_pool)
    args = case.args()
    return (args[0], fmt.k.view(kq), fmt.v.view(vq), *args[3:]), ks, vs


def test_formats_and_their_bytes():
    assert kv_format("auto", torch.bfloat16).name == "bfloat16"
    assert kv_format(torch.float32).name == "float32"
    with pytest.raises(ValueError, match="expected one of"):
        kv_format("int4")
    with pytest.raises(ValueError, match="name a kv_dtype"):
        kv_format("auto", torch.float16)
    per = {n: kv_format(n).bytes_per_token_head(64) for n in FORMATS}
    assert per == {"float32": 512, "bfloat16": 256, "int8": 136, "fp8_e4m3": 136, "k16v8": 196}
    assert per["float32"] / per["int8"] >= 3.5  # the capacity target, by construction


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_quantise_round_trip_error_is_bounded(name):
    part = kv_format(name).k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 64, generator=g) * torch.rand(300, 3, 1, generator=g) * 10
    x[5, 1] = 0  # an all-zero head: scale 0, data 0, exact
    data, scale = part.quantize(x)
    assert data.dtype == part.storage and scale.shape == (300, 3)
    y = part.dequantize(data, scale)
    assert torch.equal(y[5, 1], torch.zeros(64)) and scale[5, 1] == 0
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp = 1/16 relative
    # (and the subnormal step near zero)
    bound = amax / 254 if name == "int8" else x.abs() / 16 + amax * 2.0 ** -9 / 448 * 2
    assert torch.all((y - x).abs() <= bound + 1e-6)


@needs_cpp
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_cpp_append_writes_the_references_bytes(name):
    part = kv_format(name).v
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 64, generator=g) * 5
    x[0] = 0
    x[1, 0, :3] = torch.tensor([1e-30, -3e4, 7.0])  # tiny, huge (clamped at qmax) values
    data = torch.zeros(64, 3, 64, dtype=part.storage)
    scale = torch.full((64, 3), -1.0)
    slots = torch.randperm(64, generator=g)[:40]
    cpp_ext.load().kv_store(part.view(data), scale, slots, x.to(torch.bfloat16))
    want, want_scale = part.quantize(x.to(torch.bfloat16))
    assert torch.equal(data[slots], want) and torch.equal(scale[slots], want_scale)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(scale[untouched] == -1) and not data[untouched].any()
    with pytest.raises(IndexError, match="outside the pool"):
        cpp_ext.load().kv_store(part.view(data), scale, torch.tensor([64]), x[:1])


@needs_cpp
@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("heads,head_dim,mask", [
    ((9, 3), 64, (None, None)), ((4, 4), 128, (24, None)), ((16, 2), 16, (None, 30.0)),
    ((4, 1), 64, (40, 2.5))], ids=["smollm", "mha128-window", "gqa8-d16-softcap", "mqa-both"])
def test_cpp_kernel_reads_8bit_pools_as_the_reference(name, heads, head_dim, mask):
    """Ragged decode and extend, shuffled slots, int32/int64 indices; float32 and bfloat16
    queries."""
    for seed, q_dtype in ((3, torch.float32), (4, torch.bfloat16)):
        case = random_case(seed + head_dim, num_heads=heads[0], num_kv_heads=heads[1],
                           head_dim=head_dim, num_requests=(1, 10), max_ctx=500, max_q=16,
                           window=mask[0], softcap=mask[1])
        args, ks, vs = quantised_case(case, name)
        args = (args[0].to(q_dtype), *args[1:])
        ref_o, ref_lse = paged_attention_ref(*args, k_scale=ks, v_scale=vs)
        o, lse = cpp_ext.paged_attention_cpp(*args, k_scale=ks, v_scale=vs)
        assert_matches(o, lse, ref_o, ref_lse, q_dtype)
        if q_dtype == torch.float32:
            assert (o - ref_o).abs().max().item() <= 2e-5


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_8bit_long_context_splits(threads):
    case = random_case(7, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(1, 2),
                       max_ctx=3000, decode_only=True)
    args, ks, vs = quantised_case(case, "int8")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, lse = cpp_ext.paged_attention_cpp(*args, k_scale=ks, v_scale=vs)
    finally:
        torch.set_num_threads(before)
    assert_matches(o, lse, *paged_attention_ref(*args, k_scale=ks, v_scale=vs), torch.float32)


@needs_cpp
def test_cpp_kernel_refuses_missing_or_stray_scales():
    case = random_case(8, num_heads=4, num_kv_heads=2, head_dim=16)
    args, ks, vs = quantised_case(case, "int8")
    with pytest.raises(RuntimeError, match="needs k_scale"):
        cpp_ext.paged_attention_cpp(*args, v_scale=vs)
    with pytest.raises(RuntimeError, match="float32 \\[S, Hkv\\]"):
        cpp_ext.paged_attention_cpp(*args, k_scale=ks[:-1], v_scale=vs)
    with pytest.raises(RuntimeError, match="v_scale given"):
        cpp_ext.paged_attention_cpp(*case.args(), v_scale=vs)
