"""Linear layers that read the same rows, run as one call (CPU, packed weights).

A LLaMA layer multiplies one normed hidden state by three weights (q, k, v) and another by two
(gate, up). On a decode step each is a call of its own: a parallel region to fork and join, the
rows prepared again (``gguf-q8`` quantises them per call), a short weight stream that starts
cold. :func:`groups` finds such siblings in a slice's graph; :func:`use_group` replaces them
with one node whose kernel reads their weights packed back to back (``packed_linear_group``,
``quant_linear_q8_group``: ``kernels/csrc/linear_outputs.h``) and returns one output per weight,
each a contiguous tensor of its own, computed exactly as its own call computed it (same panels,
same rows, same arithmetic), then one ``getitem`` per former node.

A group's members: ``aten.linear`` nodes with the same input node, no bias, and float32 weights
that are constants of the graph, of the same input size, with output sizes that are whole
panels of the packed layout (so no panel straddles two weights). ``bench/linear_groups.py``
times both forms (README, "One call per group of linear layers").
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx


def groups(nodes: list[fx.Node], weights: list[torch.Tensor | None], rows: Callable[[int], int]
           ) -> list[list[int]]:
    """Indices (into ``nodes``, in graph order) of each group of two or more linear nodes that
    can run as one call. ``weights[i]``: node i's constant weight (None: not a constant the
    kernel reads); ``rows(K)``: output rows per packed panel for input size K."""
    by_input: dict[tuple, list[int]] = {}
    for i, (node, w) in enumerate(zip(nodes, weights)):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if w is None or bias is not None or w.dtype != torch.float32 or w.shape[0] % rows(
                w.shape[1]):
            continue
        by_input.setdefault((node.args[0], w.shape[1]), []).append(i)
    return [members for members in by_input.values() if len(members) > 1]


def use_group(gm: fx.GraphModule, members: list[fx.Node], target: Any, extra: tuple) -> fx.Node:
    """Replace ``members`` (linear nodes of ``gm`` with one input ``x`` and weight get_attr
    nodes, in graph order) by ``target(x, [weights], *extra)``, which returns one output per
    member, and one ``getitem`` per member in its place. The weights' get_attr nodes move before
    the first member (a get_attr reads no value). Returns the new node; ``gm`` is not
    recompiled."""
    first, graph = members[0], gm.graph
    weights = [m.args[1] for m in members]
    for w in weights:
        if isinstance(w, fx.Node):
            first.prepend(w)
    with graph.inserting_before(first):
        call = graph.call_function(target, (first.args[0], weights, *extra))
        for i, m in enumerate(members):
            item = graph.call_function(operator.getitem, (call, i))
            m.replace_all_uses_with(item)
    for m in members:
        graph.erase_node(m)
    return call


def retarget(node: fx.Node, target: Any, extra: tuple) -> None:
    """Point a group node at ``target(x, weights, *extra)`` (its kernel changes, its outputs
    do not)."""
    node.target = target
    node.args = (*node.args[:2], *extra)
