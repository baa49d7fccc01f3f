"""Linear layers on a GGUF's own blocks: the builtin GGUF's blocks are exactly transformers'
weights, and a slice's packed linear nodes run on them (few rows) or on the panels (many)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import fx

from lamina.computenode import cpu_linear
from lamina.computenode.gguf_linear import (QUANT_ROWS, GGUFLinearError, blocks_for,
                                            gguf_q8_linear, read_blocks, use_gguf_linear)
from lamina.config import KernelConfig, use_kernels
from lamina.models import ModelLoadError
from lamina.kernels import cpp_ext

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")


def _builtin_gguf():
    from lamina.models import _alias_gguf
    try:
        return _alias_gguf("smollm2")
    except ModelLoadError as e:
        pytest.skip(str(e))


def test_builtin_blocks_are_transformers_weights_bit_for_bit():
    from lamina.models import load_model
    blocks = read_blocks(_builtin_gguf())
    params = dict(load_model("smollm2").model.named_parameters(remove_duplicate=False))
    assert len(blocks) == 7 * 30 + 2  # every linear weight, the embedding and the tied head
    assert {kind for kind, _ in blocks.values()} == {3, 8}  # Q4_1 layers, a Q8_0 embedding
    for name, (kind, b) in blocks.items():
        w = params[name].detach()
        deq = gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(kind))
        assert torch.equal(torch.from_numpy(deq.reshape(w.shape)), w), name


class _Two(torch.nn.Module):
    """Two linear layers under transformers-like names."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.q = torch.nn.Linear(w1.shape[1], w1.shape[0], bias=False)
        self.d = torch.nn.Linear(w2.shape[1], w2.shape[0], bias=True)
        self.q.weight.data, self.d.weight.data = w1, w2

    def forward(self, x):
        return torch.ops.aten.linear.default(
            torch.ops.aten.linear.default(x, self.q.weight), self.d.weight, self.d.bias)


def _q8(w: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0))


def _two_q8_layers(g: torch.Generator):
    """A packed :class:`_Two` slice whose weights are Q8_0 blocks' dequantisation: ``(gm,
    blocks by name, the float64 reference of gm(x))``."""
    raw = [torch.randn(96, 64, generator=g), torch.randn(40, 96, generator=g)]
    b1, b2 = _q8(raw[0]), _q8(raw[1])
    deq = [torch.from_numpy(gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType.Q8_0))
           .reshape(r.shape) for b, r in zip((b1, b2), raw)]
    gm = fx.symbolic_trace(_Two(*deq))
    assert cpu_linear.use_skinny_linear(gm, pack=True) == 2

    def reference(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.nn.functional.linear(
            x.double(), deq[0].double()), deq[1].double(), gm.d.bias.double())
    return gm, {"q.weight": (8, b1), "d.weight": (8, b2)}, reference


@pytest.mark.parametrize("rows", [1, QUANT_ROWS, QUANT_ROWS + 3])
def test_a_slice_runs_on_the_blocks_or_the_panels(rows):
    g = torch.Generator().manual_seed(rows)
    gm, blocks, reference = _two_q8_layers(g)
    assert use_gguf_linear(gm, blocks) == 2
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(gm(x).double(), reference(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_q8_choice_runs_integer_dot_products_on_float32_rows(rows):
    """``gguf-q8``: float32 calls of any size on the repacked blocks with 8-bit activations
    (close to the float product, not equal)."""
    g = torch.Generator().manual_seed(rows)
    gm, blocks, reference = _two_q8_layers(g)
    previous = use_kernels(KernelConfig.named("gguf-q8"))
    try:
        assert use_gguf_linear(gm, blocks) == 2
    finally:
        use_kernels(previous)
    assert sum(n.target is gguf_q8_linear for n in gm.graph.nodes) == 2
    x = torch.randn(rows, 64, generator=g)
    want = reference(x)
    err = (gm(x).double() - want).abs().max() / want.abs().max()
    assert 0 < err < 0.03  # the activations' rounding


@pytest.mark.parametrize("choice", ["gguf", "gguf-q8"])
def test_q4_k_runs_on_its_blocks_with_q8_only(choice):
    """Q4_K (super-blocks of 256): ``gguf-q8`` multiplies its blocks; the exact ``gguf`` choice
    has no Q4_K kernel and leaves the layer on the float32 panels (still exact)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from test_quant_dot import blocks_of

    b1, w1 = blocks_of(12, 96, 256, 5)
    raw2 = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    b2 = _q8(raw2)
    w2 = torch.from_numpy(gguf.quants.dequantize(b2.numpy(), gguf.GGMLQuantizationType.Q8_0)
                          ).reshape(raw2.shape)
    gm = fx.symbolic_trace(_Two(w1.float(), w2))
    cpu_linear.use_skinny_linear(gm, pack=True)
    previous = use_kernels(KernelConfig.named(choice))
    try:
        n = use_gguf_linear(gm, {"q.weight": (12, torch.from_numpy(b1)), "d.weight": (8, b2)})
    finally:
        use_kernels(previous)
    assert n == (2 if choice == "gguf-q8" else 1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    want = torch.nn.functional.linear(torch.nn.functional.linear(x.double(), w1),
                                      w2.double(), gm.d.bias.double())
    err = (gm(x).double() - want).abs().max() / want.abs().max()
    assert err < (0.03 if choice == "gguf-q8" else 1e-5)


def test_blocks_that_do_not_fit_are_refused():
    gm = fx.symbolic_trace(_Two(torch.randn(96, 64), torch.randn(40, 96)))
    cpu_linear.use_skinny_linear(gm, pack=True)
    with pytest.raises(GGUFLinearError, match="do not fit"):
        use_gguf_linear(gm, {"q.weight": (8, _q8(torch.randn(32, 64)))})


def test_only_the_gguf_choice_reads_blocks_and_only_for_a_gguf_on_cpu():
    previous = use_kernels(KernelConfig())
    try:
        assert blocks_for("smollm2", "cpu") is None
        use_kernels(KernelConfig.named("gguf-q8"))
        with pytest.raises(GGUFLinearError, match="CPU"):
            blocks_for("smollm2", "cuda:0")
        use_kernels(KernelConfig.named("gguf"))
        with pytest.raises(GGUFLinearError, match="CPU"):
            blocks_for("smollm2", "cuda:0")
        with pytest.raises(ModelLoadError, match="not a GGUF"):
            blocks_for("lamina.models:smollm2_shaped", "cpu")
    finally:
        use_kernels(previous)
