"""Cheaper calls for the small ATen ops of an exported slice.

A slice from ``torch.export`` calls every op as an ``OpOverload`` (``torch.ops.aten.mul.Tensor``),
and calling one from Python goes through the JIT's boxed path: the arguments are packed into
an IValue stack checked against the schema, then the boxed kernel runs. The public bindings
(``torch.mul``, ``Tensor.view``) parse their arguments with generated code and call the same
ATen kernel unboxed, which saves microseconds per call on the thousands of small op calls of a
pass over a model (``bench/dense.py`` measures it).

:func:`use_fast_ops` points the nodes of the ops in :data:`FAST` at their binding. Each pair
resolves to the same ATen overload for the argument kinds an exported graph passes (tensors,
Python numbers, int lists), so results are bitwise identical; nodes that pass ``self`` by
keyword (the bindings call it ``input``) are left alone. Everything else (``linear``, which
:mod:`lamina.computenode.cpu_linear` owns; ``slice``, which has no binding; shape ops) keeps
its ``OpOverload``.

:func:`flatten_constants` makes each constant (a weight, a norm's scale, a packed panel) one
plain attribute of the slice: the exported ``get_attr`` of ``m.model.layers.4.self_attn.q_proj
.weight`` compiles to a chain of ``Module.__getattr__`` calls that runs on every call.
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


def constant(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node of ``gm`` reads (None: not a get_attr of a tensor)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    obj: Any = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def flatten_constants(gm: fx.GraphModule) -> int:
    """Point every tensor ``get_attr`` of ``gm`` at an alias in ``gm``'s instance dict
    (``_lamina_c_<i>``: the same tensor, found by Python's plain attribute lookup instead of one
    ``Module.__getattr__`` per dotted part; ~70 calls per SmolLM2 slice). In place,
    recompiled; returns how many nodes changed. Contract: ``gm`` is on its final device (an
    alias would not follow a later ``.to()``), and nothing rebinds its constants afterwards."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target.startswith("_lamina_c_"):
            continue
        if (obj := constant(gm, node)) is not None:
            name = f"_lamina_c_{n}"
            gm.__dict__[name] = obj
            node.target = name
            n += 1
    if n:
        gm.recompile()
    return n
