"""The C++ skinny linear (``kernels/csrc/skinny_linear_cpu.cpp``) against float64 ``F.linear``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.kernels import cpp_ext

pytestmark = pytest.mark.skipif(not cpp_ext.available(),
                                reason=f"C++ kernel not built: {cpp_ext.build_error()}")


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    return x, w, (torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("m", [1, 3, 8, 12, 13, 16, 25, 64])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (100, 37), (31, 1536), (33, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_weights_match_linear(m, n, k, bias):
    x, w, b = _case(m, n, k, bias)
    ext = cpp_ext.load()
    got = ext.skinny_linear(x, ext.pack_linear_weight(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def _amx() -> bool:
    """Whether bfloat16 weights are packed for the AMX kernel here (pairs of k per step)."""
    return cpp_ext.load().pack_linear_weight(torch.empty(1, 0, dtype=torch.bfloat16)).shape[-1] == 2


@pytest.mark.parametrize("m", [1, 8, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(96, 64), (33, 577), (64, 1536), (40, 1)])
def test_bfloat16_panels_match_linear(m, n, k):
    """Widening: exact products of x and the bfloat16 weights. AMX: x is rounded to bfloat16
    first (nearest even), then the same exact products; float32 sums either way."""
    x, w, b = _case(m, n, k, True)
    wb = w.bfloat16()
    ext = cpp_ext.load()
    got = ext.skinny_linear(x, ext.pack_linear_weight(wb), n, b)
    xw = x.bfloat16() if _amx() else x
    torch.testing.assert_close(got.double(), F.linear(xw.double(), wb.double(), b.double()),
                               rtol=1e-5, atol=1e-4)


def test_only_bfloat16_takes_the_amx_layout():
    ext = cpp_ext.load()
    if _amx():  # K = 33: 17 pairs, padded to a whole tile of 16 pairs -> 32
        assert "amx-bf16" in ext.simd_features()
        packed = ext.pack_linear_weight(torch.empty(40, 33, dtype=torch.bfloat16))
        assert packed.shape == (2, 32, 32, 2)
    assert ext.pack_linear_weight(torch.empty(1, 0)).shape[-1] in (1, 8)  # float32: never pairs


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_bfloat16_x_gives_bfloat16_rounded_once(wdtype):
    """A bfloat16 x (and bias) is computed in float32 and its result rounded once at the end."""
    x, w, b = _case(5, 96, 64, True)
    ext = cpp_ext.load()
    p = ext.pack_linear_weight(w.to(wdtype))
    xb, bb = x.bfloat16(), b.bfloat16()
    got = ext.skinny_linear(xb, p, 96, bb)
    want = ext.skinny_linear(xb.float(), p, 96, bb.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_panels_alike(dtype):
    x, w, _ = _case(8, 1000, 64, False)
    ext = cpp_ext.load()
    p = ext.pack_linear_weight(w.to(dtype))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.skinny_linear(x, p, 1000, None)
        torch.set_num_threads(2)
        two = ext.skinny_linear(x, p, 1000, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's k-ordered sum


def test_empty_and_noncontiguous_rows():
    x, w, _ = _case(6, 40, 16, False)
    ext = cpp_ext.load()
    p = ext.pack_linear_weight(w)
    assert ext.skinny_linear(x[:0], p, 40, None).shape == (0, 40)
    xt = torch.randn(16, 6).t()  # [6, 16], not contiguous
    torch.testing.assert_close(ext.skinny_linear(xt, p, 40, None), F.linear(xt, w),
                               rtol=1e-5, atol=1e-5)


def test_bad_input_is_a_clear_error():
    x, w, _ = _case(2, 40, 16, False)
    ext = cpp_ext.load()
    p = ext.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="columns"):  # the AVX2 layout knows K to 8 columns
        ext.skinny_linear(torch.randn(2, 7), p, 40, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        ext.skinny_linear(x, p, 80, None)
    with pytest.raises(RuntimeError, match="float32"):
        ext.skinny_linear(x.double(), p, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.skinny_linear(x, p, 40, torch.randn(3))
