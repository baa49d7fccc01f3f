"""Cheaper calls for the small ATen ops of an exported slice.

A slice from ``torch.export`` calls every op as an ``OpOverload`` (``torch.ops.aten.mul.Tensor``),
and calling one from Python goes through the JIT's boxed path: the arguments are packed into
an IValue stack checked against the schema, then the boxed kernel runs. The public bindings
(``torch.mul``, ``Tensor.view``) parse their arguments with generated code and call the same
ATen kernel unboxed. On SmolLM2 (1,870 op calls per pass over the model, 1,476 of them
rewritten) that is ~1-5 us saved per call: 5-19 ms of a 70-105 ms pass at one token on one
core of the Zen 3 measured (``bench/dense.py``).

:func:`use_fast_ops` points the nodes of the ops in :data:`FAST` at their binding. Each pair
resolves to the same ATen overload for the argument kinds an exported graph passes (tensors,
Python numbers, int lists), so results are bitwise identical; nodes that pass ``self`` by
keyword (the bindings call it ``input``) are left alone. Everything else (``linear``, which
:mod:`lamina.computenode.cpu_linear` owns; ``slice``, which has no binding; shape ops) keeps
its ``OpOverload``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

FAST: dict[Any, Callable[..., Any]] = {
    aten.add.Tensor: torch.add,
    aten.mul.Tensor: torch.mul,
    aten.neg.default: torch.neg,
    aten.pow.Tensor_Scalar: torch.pow,
    aten.rsqrt.default: torch.rsqrt,
    aten.mean.dim: torch.mean,
    aten.cos.default: torch.cos,
    aten.sin.default: torch.sin,
    aten.silu.default: torch._C._nn.silu,
    aten.cat.default: torch.cat,
    aten.select.int: torch.select,
    aten.transpose.int: torch.transpose,
    aten.unsqueeze.default: torch.unsqueeze,
    aten.view.default: torch.Tensor.view,
}


def use_fast_ops(gm: fx.GraphModule) -> int:
    """Point ``gm``'s calls of :data:`FAST` ops at their public bindings (in place,
    recompiled). Returns how many nodes changed."""
    n = 0
    for node in gm.graph.nodes:
        fast = FAST.get(node.target) if node.op == "call_function" else None
        if fast is not None and "self" not in node.kwargs:
            node.target = fast
            n += 1
    if n:
        gm.recompile()
    return n
