"""The integer-dot linear layer over GGUF blocks (``gguf-q8``) against float64 over what it
multiplies: gguf-py's dequantised weights times x rounded to ggml's Q8_1 blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lamina.kernels import cpp_ext
from test_quant_linear import dequantized, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")


def q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's Q8_1 of each row of x per block of 32, in torch: q int8, d, s = d * sum(q)."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    d = amax / 127.0
    return q.reshape(M, K), d, d * q.sum(-1).float()


def blocks_of(kind: int, N: int, K: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks of ggml type ``kind`` (Q4_K too: super-blocks of 256) and gguf-py's
    dequantisation of them, float64 [N, K]."""
    if kind != 12:
        blocks = random_blocks(kind, N, K, seed)
        return blocks, dequantized(blocks, kind, N, K).double()
    rng = np.random.default_rng(seed)
    nb = N * K // 256
    blocks = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)  # scales, minimums, quants
    half = np.float16
    blocks[:, 0:2] = (rng.standard_normal(nb) * 0.002).astype(half).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = (np.abs(rng.standard_normal(nb)) * 0.002).astype(half).view(
        np.uint8).reshape(nb, 2)
    blocks = blocks.reshape(N, -1)
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(N, K)
    return blocks, torch.from_numpy(np.ascontiguousarray(w)).double()


def linear_q8(ext, x, blocks: np.ndarray, kind: int, bias=None) -> torch.Tensor:
    b = torch.from_numpy(blocks)
    return ext.quant_linear_q8(x, ext.pack_q8_weight(b, kind), b.shape[0], kind, bias)


def test_activations_are_rounded_as_ggml_q8_1():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 2, 5)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    q, d, s = cpp_ext.load().quantize_q8(x)
    rq, rd, rs = q8_reference(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    torch.testing.assert_close(s, rs)
    assert q.abs().max() <= 127 and d[1, 1] == 0 and torch.all(q[1, 32:64] == 0)


@pytest.mark.parametrize("kind", [2, 3, 8, 12])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 16])
def test_products_match_float64_over_the_rounded_activations(kind, M):
    """Exact integer sums, float32 scaling: equal to float64 over (dequantised weights) x
    (dequantised Q8_1 activations) to float rounding, for Q4_0, Q4_1, Q8_0 and Q4_K. N = 203
    leaves a partial row group."""
    ext = cpp_ext.load()
    N, K = 203, 768
    blocks, w = blocks_of(kind, N, K, 30 + kind)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # a strided x
    bias = torch.randn(N, generator=g)
    y = linear_q8(ext, x, blocks, kind, bias)
    q, d, _ = q8_reference(x.contiguous())
    xq = (q.double().reshape(M, -1, 32) * d.double()[..., None]).reshape(M, K)
    want = torch.nn.functional.linear(xq, w, bias.double())
    assert y.shape == (M, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    # and near the float product: the activations' rounding is the only approximation
    exact = torch.nn.functional.linear(x.double(), w, bias.double())
    assert (y.double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_extreme_quants_do_not_saturate():
    """Q8_0 weights of -128 and 127 against activations of +-127 (AVX2's int16 pair sums stay
    under 32,767): the result is exactly the integer product times the scales."""
    ext = cpp_ext.load()
    N, K = 8, 64
    blocks = np.zeros((N, K // 32, 34), np.uint8)
    blocks[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:, :, 2:] = np.where(np.arange(32) % 2 == 0, -128, 127).astype(np.int8).view(np.uint8)
    blocks = blocks.reshape(N, -1)
    x = torch.where(torch.arange(K) % 2 == 0, -1.0, 1.0)[None].repeat(2, 1)
    x[1] = -x[1]
    y = linear_q8(ext, x, blocks, 8)
    per_block = 16 * (128 * 127 + 127 * 127)  # q = -+127 against w = -128 / 127, d = 1/127
    want = torch.tensor([1.0, -1.0])[:, None] * (K // 32 * per_block / 127.0)
    torch.testing.assert_close(y, want.expand(2, N), rtol=1e-6, atol=0)


def test_zero_rows_give_the_bias():
    ext = cpp_ext.load()
    blocks = random_blocks(3, 16, 64, 1)
    bias = torch.arange(16.0)
    y = linear_q8(ext, torch.zeros(3, 64), blocks, 3, bias)
    assert torch.equal(y, bias.expand(3, 16))


def test_bad_shapes_and_kinds_are_clear_errors():
    ext = cpp_ext.load()
    b = torch.from_numpy(random_blocks(8, 16, 64, 0))
    with pytest.raises(RuntimeError, match="not supported"):
        ext.pack_q8_weight(b, 14)
    with pytest.raises(RuntimeError, match="whole blocks of 144"):
        ext.pack_q8_weight(b, 12)  # Q4_K rows are whole super-blocks
    packed = ext.pack_q8_weight(b, 8)
    with pytest.raises(RuntimeError, match="inputs"):
        ext.quant_linear_q8(torch.randn(1, 96), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="inputs"):
        ext.quant_linear_q8(torch.randn(1, 64), packed, 24, 8, None)  # N of another weight
    with pytest.raises(RuntimeError, match="float32"):
        ext.quant_linear_q8(torch.randn(1, 64).double(), packed, 16, 8, None)
