"""Turn a :class:`~lamina.splitter.graph.Partition` into n+1 ``torch.fx.GraphModule`` slices.

Slice ``k`` has explicit named inputs, in this order: the graph inputs it uses (``input_ids[1,T]``,
``position_ids[1,T]``, ``logits_to_keep[R]``), the context names of boundary ``k-1``, and
``attn_out[T,H,Dv]`` (the output of attention ``k-1``, contiguous; absent in slice 0). It returns a tuple: the
context names of boundary ``k`` followed by ``q[T,H,D]``, ``k[T,Hkv,D]``, ``v[T,Hkv,Dv]`` of
attention ``k``; the last slice returns the model's outputs instead. Replicated nodes (position
tables, shape arithmetic) are recomputed in every slice that needs them. Parameters are shared
with the full graph module, not copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from lamina.splitter.graph import Partition

GRAPH_INPUTS = ("input_ids", "position_ids", "logits_to_keep")
ATTN_OUT = "attn_out"
QKV = ("q", "k", "v")


@dataclass
class SliceInfo:
    """What one slice takes and gives; bytes are per token."""

    index: int
    inputs: list[str]
    outputs: list[str]
    num_ops: int
    context_bytes: float  # context handed to the next slice (0 for the last)
    qkv_bytes: float  # q, k and v sent to attention (0 for the last)


def build_slices(gm: fx.GraphModule, part: Partition) -> tuple[list[fx.GraphModule], list[SliceInfo]]:
    nodes = {n.name: n for n in gm.graph.nodes}
    n_attn = len(part.attentions)
    slices, infos = [], []
    for k in range(n_attn + 1):
        ctx_in = part.contexts[k - 1] if k > 0 else []
        ctx_out = part.contexts[k] if k < n_attn else []
        attn_in = nodes[part.attentions[k - 1]] if k > 0 else None
        attn_next = nodes[part.attentions[k]] if k < n_attn else None
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for name in GRAPH_INPUTS:
            if name in nodes:
                env[nodes[name]] = g.placeholder(name)
        for name in ctx_in:
            ph = g.placeholder(name)
            ph.meta = dict(nodes[name].meta)
            env[nodes[name]] = ph
        if attn_in is not None:
            ph = g.placeholder(ATTN_OUT)
            ph.meta = dict(attn_in.meta)
            env[attn_in] = ph

        def materialize(n: fx.Node) -> fx.Node:
            if n in env:
                return env[n]
            if n.op == "call_function" and n.name not in part.replicated:
                owner = part.slice_of[n.name]
                if owner != k:
                    raise AssertionError(f"slice {k} needs node '{n.name}' of slice {owner}, "
                                         "which is not in its context (partition bug)")
            for i in n.all_input_nodes:
                materialize(i)
            env[n] = g.node_copy(n, lambda x: env[x])
            return env[n]

        for n in gm.graph.nodes:
            if n.op == "call_function" and n.name not in part.replicated and \
                    part.slice_of.get(n.name) == k and n is not attn_next:
                materialize(n)
        if attn_next is not None:
            outs = [materialize(nodes[c]) for c in ctx_out]
            outs += [materialize(a) for a in attn_next.args[:3]]
            out_names = list(ctx_out) + list(QKV)
        else:
            out_node = next(n for n in gm.graph.nodes if n.op == "output")
            results = out_node.args[0]
            results = list(results) if isinstance(results, (tuple, list)) else [results]
            outs = [materialize(r) for r in results]
            out_names = [f"output{i}" for i in range(len(outs))]
        g.output(tuple(outs))
        for ph in [p for p in g.nodes if p.op == "placeholder"]:
            if not ph.users and ph.target in GRAPH_INPUTS:
                g.erase_node(ph)
        g.lint()
        sm = fx.GraphModule(gm, g, class_name=f"Slice{k}")
        inputs = [p.target for p in g.nodes if p.op == "placeholder"]
        num_ops = sum(1 for n in g.nodes if n.op == "call_function")
        cb = sum(part.bytes_per_token.get(c, 0.0) for c in ctx_out)
        qb = sum(part.bytes_per_token.get(a.name, 0.0) for a in attn_next.args[:3]) if attn_next else 0.0
        slices.append(sm)
        infos.append(SliceInfo(k, inputs, out_names, num_ops, cb, qb))
    return slices, infos
