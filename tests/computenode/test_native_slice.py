"""slice_program: a CPU slice's graph run in C++ computes what the graph computes, bit for bit;
a graph it cannot carry is refused by name, and the replica keeps that slice's Python code."""
import os
import sys

import pytest
import torch
import torch.fx as fx

from lamina.computenode.gguf_linear import QUANT_ROWS, use_gguf_linear
from lamina.computenode.native_slice import NotTranslatable, slice_program
from lamina.computenode.replica import ComputeReplica
from lamina.config import KernelConfig, use_kernels
from lamina.kernels import cpp_ext
from lamina.splitter import split_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import ARCHS, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not cpp_ext.available(), reason="C++ extension unavailable")
G = torch.Generator().manual_seed(0)


def attend(k, q, key, v):  # any fixed function of q, k, v: the same in both runs
    return (q * key.repeat_interleave(q.shape[1] // key.shape[1], 1)).tanh()


def _with(slices: str):
    """A context-free switch of this process's slice runner (returns the previous choices)."""
    return use_kernels(KernelConfig(slices=slices))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_slice_of_every_arch_runs_as_a_program_bit_for_bit(arch):
    replica = ComputeReplica(split_model(tiny_model(arch)), "cpu")
    assert replica.programs is not None and all(p is not None for p in replica.programs)
    sm = replica.split
    for tokens in (1, 5):
        ids, pos = torch.arange(5, 5 + tokens) % 90, torch.arange(3, 3 + tokens)
        rows = torch.tensor([tokens - 1])
        with torch.inference_mode():
            want = sm.forward(ids, pos, rows, attend)
            got = sm.forward(ids, pos, rows, attend,
                             lambda k, args: replica.programs[k].run(list(args)))
        assert torch.equal(got, want)


@pytest.mark.parametrize("choice", ["gguf", "gguf-q8"])
@pytest.mark.parametrize("rows", [1, QUANT_ROWS + 3])
def test_gguf_linear_layers_choose_as_their_python_wrappers(choice, rows):
    """Both branches of each wrapper (the blocks, the float32 panels) as the program takes them."""
    pytest.importorskip("gguf")
    from test_gguf_linear import _two_q8_layers
    gm, blocks, _ = _two_q8_layers(G)
    previous = use_kernels(KernelConfig.named(choice))
    try:
        assert use_gguf_linear(gm, blocks) == 2
    finally:
        use_kernels(previous)
    x = torch.randn(rows, 64, generator=G)
    assert torch.equal(slice_program(gm).run([x])[0], gm(x))


def test_python_numbers_where_a_tensor_goes_are_wrapped_as_python_wraps_them():
    def f(x, y):
        a = torch.ops.aten.mul.Tensor(x, 1.5)  # int64 x: a float32 result, not float64
        b = torch.ops.aten.add.Tensor(y, 2)
        return a, b, x  # an input returned as it is
    gm = fx.symbolic_trace(f)
    x, y = torch.arange(4), torch.randn(3, generator=G).bfloat16()
    got = slice_program(gm).run([x, y])
    for g, w in zip(got, gm(x, y)):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _python_call(x):
    return x * 2


fx.wrap("_python_call")  # a leaf of symbolic traces: one call node


def test_a_graph_calling_python_is_refused_by_name_and_keeps_its_code():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.relu.default(_python_call(x))
    gm = fx.symbolic_trace(M())
    with pytest.raises(NotTranslatable, match="_python_call"):
        slice_program(gm)


def test_the_choice_of_runner():
    sm = split_model(tiny_model("llama"))
    previous = _with("fx")
    try:
        assert ComputeReplica(sm, "cpu").programs is None
    finally:
        use_kernels(previous)
    sm = split_model(tiny_model("llama"))
    gm = sm.slices[1]
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(node):  # a Python call the program cannot carry
        extra = gm.graph.call_function(_python_call, (node,))
    node.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    gm.recompile()
    replica = ComputeReplica(sm, "cpu")  # auto: that slice keeps its Python code
    assert replica.programs[1] is None and replica.programs[0] is not None
    ids, pos, rows = torch.tensor([5, 9]), torch.arange(2), torch.tensor([1])
    with torch.inference_mode():
        want = sm.forward(ids, pos, rows, attend)
        assert torch.equal(sm.forward(ids, pos, rows, attend, replica.runner()), want)
    previous = _with("native")
    try:
        with pytest.raises(NotTranslatable, match="slice 1"):
            ComputeReplica(sm, "cpu")
    finally:
        use_kernels(previous)


def test_an_op_error_is_raised_not_swallowed():
    gm = fx.symbolic_trace(lambda x, y: torch.ops.aten.mm.default(x, y))
    with pytest.raises(RuntimeError):
        slice_program(gm).run([torch.randn(2, 3), torch.randn(4, 5)])
