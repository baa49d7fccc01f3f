"""The C++ linear layer over GGUF blocks against gguf-py's dequantisation (what transformers
loads from the same file): the dequantised weights bit for bit, products to float rounding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lamina.kernels import cpp_ext

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")

KINDS = {2: gguf.GGMLQuantizationType.Q4_0, 3: gguf.GGMLQuantizationType.Q4_1,
         8: gguf.GGMLQuantizationType.Q8_0}
BYTES = {2: 18, 3: 20, 8: 34}


def random_blocks(kind: int, N: int, K: int, seed: int) -> np.ndarray:
    """uint8 [N, K/32 * bytes]: random quants, scales (and Q4_1 minimums) of weight-like size."""
    rng = np.random.default_rng(seed)
    nb = N * K // 32
    blocks = rng.integers(0, 256, size=(nb, BYTES[kind]), dtype=np.uint8)
    blocks[:, 0:2] = (rng.standard_normal(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if kind == 3:
        blocks[:, 2:4] = (rng.standard_normal(nb) * 0.05).astype(np.float16).view(
            np.uint8).reshape(nb, 2)
    return blocks.reshape(N, -1)


def dequantized(blocks: np.ndarray, kind: int, N: int, K: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(blocks, KINDS[kind]).reshape(N, K)))


@pytest.mark.parametrize("kind", [2, 3, 8])
def test_dequantised_weights_are_gguf_pys_bit_for_bit(kind):
    N, K = 40, 96
    blocks = random_blocks(kind, N, K, kind)
    w = dequantized(blocks, kind, N, K)
    y = cpp_ext.load().quant_linear(torch.eye(K), torch.from_numpy(blocks), kind, None)
    assert torch.equal(y, w.T)  # one-hot rows: each output is one weight, exactly


@pytest.mark.parametrize("kind", [2, 3, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 16, 64])
def test_products_match_float_linear(kind, M):
    N, K = 200, 576
    blocks = random_blocks(kind, N, K, 10 + kind)
    w = dequantized(blocks, kind, N, K)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # a strided x
    bias = torch.randn(N, generator=g)
    y = cpp_ext.load().quant_linear(x, torch.from_numpy(blocks), kind, bias)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)  # outputs ~10-30
    assert y.shape == (M, N) and y.dtype == torch.float32


def test_bad_shapes_and_kinds_are_clear_errors():
    ext = cpp_ext.load()
    blocks = torch.from_numpy(random_blocks(8, 4, 64, 0))
    with pytest.raises(RuntimeError, match="not supported"):
        ext.quant_linear(torch.randn(1, 64), blocks, 12, None)
    with pytest.raises(RuntimeError, match="inputs"):
        ext.quant_linear(torch.randn(1, 96), blocks, 8, None)
