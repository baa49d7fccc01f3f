"""The exported graph as a ``networkx.DiGraph`` and the minimum cuts at each attention (Lamina §5.3).

Node classes:

* **replicated**: nodes that do not mix learned parameters with token data (graph inputs,
  position/rotary tables from buffers, shape arithmetic, weight-only preprocessing). They are
  cheap, so every slice that needs one recomputes it; they never cross a cut.
* **token nodes**: everything else (embeddings, projections, norms, MLPs, ...). Each belongs to
  exactly one slice. A value that a later slice needs crosses the boundary as *context*.

For attention ``i`` the token nodes are split into those computed before it (everything it
depends on, plus everything placed in earlier slices) and those computed after it (everything
that depends on its output), and the free nodes in between go to whichever side minimises the
bytes per token of the values that cross: a minimum s-t cut in a graph where every value ``u`` is
an edge ``u_in -> u_out`` weighted by its bytes per token (``u_in`` on the source side: computed
before; ``u_out`` on the sink side: its value is available after), data edges ``u_out -> v_in`` are
uncuttable, and uncuttable precedence edges ``v_in -> u_in`` forbid a node from running before
its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from lamina.splitter.errors import SplitError
from lamina.splitter.export import attention_nodes, is_getitem

_TUPLE_WEIGHT = 1e12  # a tuple-valued node never crosses; its getitem outputs do


@dataclass
class Partition:
    """Slice index for every token node, and the context crossing each boundary.

    ``slice_of[name]`` in ``0..n`` for ``n`` attentions; ``contexts[i]`` lists the node names
    (in graph order) that slice ``i`` hands to slice ``i+1`` besides the attention output.
    """

    slice_of: dict[str, int]
    contexts: list[list[str]]
    attentions: list[str]
    replicated: set[str]
    bytes_per_token: dict[str, float]


def _params(gm: fx.GraphModule) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def replicated_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that do not combine learned parameters with token data (see module docstring)."""
    params = _params(gm)
    has_param: dict[fx.Node, bool] = {}
    has_token: dict[fx.Node, bool] = {}
    replicated: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            has_param[n], has_token[n] = False, True
            replicated.add(n)
        elif n.op == "get_attr":
            has_param[n], has_token[n] = n.target in params, False
            replicated.add(n)
        elif n.op == "call_function":
            ins = n.all_input_nodes
            has_param[n] = any(has_param[i] for i in ins)
            has_token[n] = any(has_token[i] for i in ins)
            mixes = has_param[n] and has_token[n]
            if not mixes and all(i in replicated for i in ins) and n.target is not _attention():
                replicated.add(n)
        elif n.op == "call_module":
            raise SplitError(f"node '{n.name}': unexpected submodule call {n.target} in the "
                             "exported graph")
    return replicated


def _attention():
    from lamina.splitter.ops import ATTENTION_OP
    return ATTENTION_OP


def bytes_per_token(node: fx.Node, token_symbols: set) -> float:
    """Bytes per token of a node's value, from ``node.meta['val']``: the size of a tensor whose
    shape involves the token dimension, divided by the number of tokens."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return _TUPLE_WEIGHT
    if not isinstance(val, torch.Tensor):
        return 0.0
    big = 1 << 16
    numel = 1
    for d in val.shape:
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            free = expr.free_symbols
            if free and not free & token_symbols:
                free_val = {s: 1 for s in free}
            else:
                free_val = {s: (big if s in token_symbols else 1) for s in free}
            numel *= int(expr.subs(free_val))
        else:
            numel *= int(d)
    per = numel / big
    return per * val.element_size()


def to_digraph(gm: fx.GraphModule, weights: dict[str, float]) -> nx.DiGraph:
    """The dataflow graph: one node per fx node, edges weighted by the producer's bytes/token."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n.name, op=n.op, target=str(n.target))
        for i in n.all_input_nodes:
            g.add_edge(i.name, n.name, weight=weights.get(i.name, 0.0))
    return g


def partition(gm: fx.GraphModule) -> Partition:
    """Assign every token node to a slice by successive minimum cuts; see module docstring."""
    attns = attention_nodes(gm)
    if not attns:
        raise SplitError(f"{type(gm).__name__}: the model has no attention operator "
                         "(neither transformers attention nor scaled_dot_product_attention)")
    replicated = replicated_nodes(gm)
    token_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n not in replicated]
    token_set = set(token_nodes)
    token_symbols = _token_symbols(gm)
    weights = {n.name: bytes_per_token(n, token_symbols) for n in token_nodes}
    _check_chain(attns, token_set)

    slice_of: dict[fx.Node, int] = {}
    contexts: list[list[str]] = []
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    for i, a in enumerate(attns):
        after = _descendants(a, token_set)
        # Placed nodes matter only while some user is still unplaced: they are pinned before.
        frontier = {n for n in slice_of if any(u not in slice_of for u in n.users)}
        unplaced = [n for n in token_nodes if n not in slice_of]
        before = _ancestors(a, token_set, stop=slice_of) | frontier
        s_side, cut = _min_cut(sorted(frontier, key=order.__getitem__) + unplaced, before,
                               after, a, weights)
        for n in s_side:
            slice_of.setdefault(n, i)
        contexts.append([n.name for n in sorted(cut, key=order.__getitem__)])
        for n in cut:
            if isinstance(n.meta.get("val"), (tuple, list)):
                raise SplitError(f"node '{n.name}': a multi-output value would cross the cut "
                                 f"at attention '{a.name}'")
    for n in token_nodes:
        slice_of.setdefault(n, len(attns))
    for i, a in enumerate(attns):
        slice_of[a] = i  # attention i sits on the boundary after slice i
    return Partition(slice_of={n.name: k for n, k in slice_of.items()}, contexts=contexts,
                     attentions=[a.name for a in attns],
                     replicated={n.name for n in replicated}, bytes_per_token=weights)


def _token_symbols(gm: fx.GraphModule) -> set:
    syms = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in ("input_ids", "position_ids"):
            for d in n.meta["val"].shape:
                if isinstance(d, torch.SymInt):
                    syms |= d.node.expr.free_symbols
    return syms


def _descendants(a: fx.Node, token_set: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [a]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in token_set and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _ancestors(a: fx.Node, token_set: set[fx.Node], stop=()) -> set[fx.Node]:
    """Token-node ancestors of ``a``; the walk does not continue past nodes in ``stop``."""
    seen, stack = set(), [a]
    while stack:
        n = stack.pop()
        for u in n.all_input_nodes:
            if u in token_set and u not in seen and u not in stop:
                seen.add(u)
                stack.append(u)
    return seen


def _check_chain(attns: list[fx.Node], token_set: set[fx.Node]) -> None:
    """Attentions must be totally ordered by dependence (each depends on the previous one)."""
    for prev, nxt in zip(attns, attns[1:]):
        if prev not in _ancestors(nxt, token_set):
            raise SplitError(f"attention nodes '{prev.name}' and '{nxt.name}' do not depend on "
                             "each other (parallel attentions): the splitter cannot express this "
                             "pattern as a chain of slices")


def _min_cut(token_nodes: list[fx.Node], before: set[fx.Node], after: set[fx.Node],
             attn: fx.Node, weights: dict[str, float]) -> tuple[set[fx.Node], list[fx.Node]]:
    """Min cut for one attention; returns (nodes computed before it, values crossing the cut)."""
    inf = float("inf")
    token_set = set(token_nodes)
    h = nx.DiGraph()
    S, T = ("S",), ("T",)
    h.add_nodes_from([S, T])
    for u in token_nodes:
        if u in after or u is attn:
            continue
        u_in, u_out = (u, 0), (u, 1)
        h.add_edge(u_in, u_out, capacity=weights[u.name])
        h.add_edge(u_out, u_in, capacity=inf)
        if u in before:
            h.add_edge(S, u_in, capacity=inf)
        for v in u.users:
            if v is attn:
                continue  # q/k/v go to the attention itself, not into the context
            if v in after or v.op == "output":
                h.add_edge(u_out, T, capacity=inf)
            elif v in token_set:
                h.add_edge(u_out, (v, 0), capacity=inf)  # v after => u's value after
                h.add_edge((v, 0), u_in, capacity=inf)  # v before => u before
    value, (s_side, _) = nx.minimum_cut(h, S, T)
    if value == inf:
        raise SplitError(f"attention '{attn.name}': no finite cut separates its inputs from its "
                         "output (the output feeds back into its own inputs)")
    computed = {x[0] for x in s_side if x not in (S, T) and x[1] == 0}
    crossing = [u for u in computed if (u, 1) not in s_side]
    return computed, crossing
