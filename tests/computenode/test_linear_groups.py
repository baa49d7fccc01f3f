"""Linear layers that read the same rows run as one call: the group kernels equal one call per
weight bit for bit, and a slice's sibling linear nodes become one group node (packed panels, the
GGUF blocks under ``gguf-q8``, the C++ program) with the same outputs."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from lamina.computenode import cpu_linear
from lamina.computenode.gguf_linear import gguf_q8_linear_group, use_gguf_linear
from lamina.computenode.native_slice import slice_program
from lamina.config import KernelConfig, use_kernels
from lamina.kernels import cpp_ext

pytestmark = pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")
aten = torch.ops.aten
# multiples of every packed layout's panel rows (AVX2 6, AVX-512 and plain 32) and of 8 (q8)
NS = (192, 96, 96)


@pytest.fixture(scope="module")
def ext():
    return cpp_ext.load()


@pytest.mark.parametrize("rows", [1, 2, 5, 13])
def test_a_group_call_equals_a_call_per_weight(ext, rows):
    g = torch.Generator().manual_seed(rows)
    ws = [torch.randn(n, 64, generator=g) for n in NS]
    x = torch.randn(rows, 64, generator=g)
    panels = torch.cat([ext.pack_linear_weight(w) for w in ws])
    got = ext.skinny_linear_group(x, panels, list(NS))
    for y, w in zip(got, ws):
        assert y.is_contiguous() and y.shape == (rows, w.shape[0])
        assert torch.equal(y, ext.skinny_linear(x, ext.pack_linear_weight(w), w.shape[0], None))
    # the wrapper a group node calls: same, with x's leading dims; F.linear past max_rows
    x3 = x.view(1, rows, 64)
    for y, w in zip(ext.packed_linear_group(x3, ws, panels, 64), ws):
        assert torch.equal(y, ext.skinny_linear(x, ext.pack_linear_weight(w), w.shape[0],
                                                None).view(1, rows, -1))
    for y, w in zip(ext.packed_linear_group(x3, ws, panels, rows - 1), ws):
        assert torch.equal(y, torch.nn.functional.linear(x3, w))


@pytest.mark.parametrize("kind", [3, 8])
@pytest.mark.parametrize("rows", [1, 6])
def test_a_q8_group_call_equals_a_call_per_weight(ext, kind, rows):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from test_quant_linear import random_blocks

    blocks = [torch.from_numpy(random_blocks(kind, n, 64, seed=n)) for n in NS]
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(kind))
    packed = ext.pack_q8_weight(torch.cat(blocks), kind)
    got = ext.quant_linear_q8_group(x, packed, list(NS), kind)
    for y, b, n in zip(got, blocks, NS):
        assert torch.equal(y, ext.quant_linear_q8(x, ext.pack_q8_weight(b, kind), n, kind, None))


def test_sizes_that_do_not_fit_the_panels_are_refused(ext):
    ws = [torch.randn(n, 64) for n in NS]
    panels = torch.cat([ext.pack_linear_weight(w) for w in ws])
    with pytest.raises(RuntimeError, match="multiple of"):
        ext.skinny_linear_group(torch.randn(1, 64), panels, [193, 95, 96])
    with pytest.raises(RuntimeError, match="do not match"):
        ext.skinny_linear_group(torch.randn(1, 64), panels, [192, 96])


class _Layer(torch.nn.Module):
    """q/k/v of one input, gate/up of another, and a linear with a bias (never grouped)."""

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Parameter(torch.randn(n, 64, generator=g)) for n in NS)
        self.gate, self.up = (torch.nn.Parameter(torch.randn(96, 192, generator=g))
                              for _ in range(2))
        self.o = torch.nn.Linear(192, 64)

    def forward(self, x):
        q = aten.linear.default(x, self.q)
        k = aten.linear.default(x, self.k)
        v = aten.linear.default(x, self.v)
        h = aten.add.Tensor(q, q)  # a use of q before k and v are used
        gate = aten.linear.default(h, self.gate)
        up = aten.linear.default(h, self.up)
        return (aten.linear.default(h, self.o.weight, self.o.bias),
                aten.mul.Tensor(gate, up), k, v)


def _rewritten(group: bool):
    torch.manual_seed(0)  # the biased layer's initial weights
    gm = fx.symbolic_trace(_Layer(torch.Generator().manual_seed(0)))
    assert cpu_linear.use_skinny_linear(gm, pack=True, group=group) == 6
    return gm


def test_siblings_become_one_group_node_with_the_same_outputs(ext):
    grouped, single = _rewritten(True), _rewritten(False)
    calls = [n for n in grouped.graph.nodes if n.op == "call_function"]
    groups = [n for n in calls if n.target is ext.packed_linear_group]
    assert [len(n.args[1]) for n in groups] == [3, 2]  # q/k/v, then gate/up
    assert sum(n.target is ext.packed_linear for n in calls) == 1  # the one with a bias
    assert sum(n.target is operator.getitem for n in calls) == 5
    for rows in (1, 3, cpu_linear.SKINNY_ROWS + 1):  # panels, then F.linear per weight
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        for a, b in zip(grouped(x), single(x)):
            assert torch.equal(a, b)
    # and as a C++ program
    program = slice_program(grouped, ext)
    x = torch.randn(2, 64)
    for a, b in zip(program.run([x]), grouped(x)):
        assert torch.equal(a, b)


def test_the_q8_choice_runs_a_group_on_its_blocks(ext):
    gguf = pytest.importorskip("gguf")
    gm = _rewritten(True)
    names = {"q": gm.q, "k": gm.k, "v": gm.v, "gate": gm.gate, "up": gm.up}
    blocks = {n: (8, torch.from_numpy(gguf.quants.quantize(w.detach().numpy(),
                                                           gguf.GGMLQuantizationType.Q8_0)))
              for n, w in names.items()}
    previous = use_kernels(KernelConfig.named("gguf-q8"))
    try:
        assert use_gguf_linear(gm, blocks) == 2
    finally:
        use_kernels(previous)
    groups = [n for n in gm.graph.nodes if n.target is gguf_q8_linear_group]
    assert len(groups) == 2
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    q, k, v = (ext.quant_linear_q8(x, ext.pack_q8_weight(blocks[n][1], 8), names[n].shape[0], 8,
                                   None) for n in "qkv")
    _, _, k_got, v_got = gm(x)
    assert torch.equal(k_got, k) and torch.equal(v_got, v)
    program = slice_program(gm, ext)
    for a, b in zip(program.run([x]), gm(x)):
        assert torch.equal(a, b)


def test_the_exact_gguf_choice_makes_no_groups(ext):
    previous = use_kernels(KernelConfig.named("gguf"))
    try:
        gm = fx.symbolic_trace(_Layer(torch.Generator().manual_seed(0)))
        cpu_linear.use_skinny_linear(gm, pack=True)
    finally:
        use_kernels(previous)
    assert not any(n.target is ext.packed_linear_group for n in gm.graph.nodes)
