"""use_fast_ops: exported ATen calls pointed at their public bindings, bitwise the same."""
import os
import sys

import pytest
import torch
import torch.fx as fx

from lamina.computenode.fast_ops import FAST, use_fast_ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_model  # noqa: E402

aten = torch.ops.aten
X = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
P = X.abs() + 0.5  # for the ops that need positive inputs
ARGS = {  # the argument kinds an exported graph passes each op
    aten.add.Tensor: [(X, X), (X, 1e-5)],
    aten.mul.Tensor: [(X, X), (X[0], X), (X, 0.125)],
    aten.neg.default: [(X,)],
    aten.pow.Tensor_Scalar: [(X, 2), (P, 0.5)],
    aten.rsqrt.default: [(P,)],
    aten.mean.dim: [(X, [-1], True), (X, [1])],
    aten.cos.default: [(X,)],
    aten.sin.default: [(X,)],
    aten.silu.default: [(X,)],
    aten.cat.default: [([X, X], -1), ([X, X],)],
    aten.select.int: [(X, 1, 2), (X, 0, -1)],
    aten.transpose.int: [(X, 1, 2)],
    aten.unsqueeze.default: [(X, 0), (X, -1)],
    aten.view.default: [(X, [6, -1]), (X, [2, 24])],
}


def test_every_fast_op_has_cases():
    assert set(ARGS) == set(FAST)


@pytest.mark.parametrize("op", list(FAST), ids=str)
def test_binding_equals_the_overload_bitwise(op):
    for args in ARGS[op]:
        want, got = op(*args), FAST[op](*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (op, args[1:])


def test_split_model_outputs_unchanged():
    from lamina.splitter import split_model
    sm = split_model(tiny_model("llama"))
    ids, pos = torch.tensor([5, 9, 33, 2, 7]), torch.arange(5)
    rows = torch.tensor([4])

    def attend(k, q, key, v):  # any fixed function of q, k, v: the same in both runs
        return (q * key.repeat_interleave(q.shape[1] // key.shape[1], 1)).tanh()

    before = sm.forward(ids, pos, rows, attend)
    n = sum(use_fast_ops(gm) for gm in sm.slices)
    assert n > 0
    assert not any(node.target in FAST for gm in sm.slices for node in gm.graph.nodes
                   if node.op == "call_function")
    assert torch.equal(sm.forward(ids, pos, rows, attend), before)


def test_self_by_keyword_is_left_alone():
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(aten.neg.default, (), {"self": x})
    g.output(node)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert use_fast_ops(gm) == 0 and node.target is aten.neg.default
    assert torch.equal(gm(X), -X)


def test_flattened_constants_are_the_same_tensors_and_outputs_unchanged():
    from lamina.computenode.fast_ops import flatten_constants
    from lamina.splitter import split_model
    sm = split_model(tiny_model("llama"))
    ids, pos, rows = torch.tensor([5, 9, 33, 2, 7]), torch.arange(5), torch.tensor([4])

    def attend(k, q, key, v):
        return (q * key.repeat_interleave(q.shape[1] // key.shape[1], 1)).tanh()

    before = sm.forward(ids, pos, rows, attend)
    gm = sm.slices[1]
    dotted = {n.target: getattr(gm.get_submodule(n.target.rpartition(".")[0]), n.target.rpartition(".")[2])
              for n in gm.graph.nodes if n.op == "get_attr" and "." in n.target}
    assert dotted and sum(flatten_constants(g) for g in sm.slices) > 0
    attrs = [n.target for g in sm.slices for n in g.graph.nodes if n.op == "get_attr"]
    assert attrs and all(t.startswith("_lamina_c_") for t in attrs)
    assert {id(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"} == \
        {id(t) for t in dotted.values()}  # aliases, not copies
    assert "_lamina_c_0" in vars(gm)  # plain attribute lookup, no Module.__getattr__
    assert torch.equal(sm.forward(ids, pos, rows, attend), before)
    assert all(flatten_constants(g) == 0 for g in sm.slices)  # a second pass changes nothing
