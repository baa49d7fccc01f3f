"""One C++ call for each small-op chain of a slice that has a fused kernel (CPU).

On a decode step a slice's small ops work on a few rows, so they cost their call (Python, the
dispatcher, caches cold after the weight stream), not their arithmetic: a LLaMA layer exports
~60 op calls besides its linear layers. :func:`fuse_small_ops` finds three chains in a slice's
exported graph (ATen overloads, before :mod:`lamina.computenode.fast_ops` rebinds them) and
points each at one kernel of ``kernels/csrc/fused_cpu.cpp``:

* ``rms_norm``: ``mul(w, mul(x, rsqrt(add(mean(pow(x, 2), [-1], True), eps))))`` (6 calls);
* ``silu_mul``: ``mul(silu(a), b)`` (2 calls);
* ``rope``: the rotate-half rotary embedding from the positions,
  ``add(mul(x, C), mul(cat([neg(slice(x, 3, h)), slice(x, 3, 0, h)], -1), S))`` with
  ``C/S = unsqueeze(mul(cos/sin(cat([f, f], -1)), scale), 1)`` and
  ``f = mul(_to_copy(unsqueeze(pos, 2), float32), inv_freq)`` (the 7 calls per tensor; the
  10 that make the tables go once both q and k use them).

Then two folds of what surrounds those kernels (:data:`FOLDS`), found once the chains are fused:

* ``add_rms_norm``: ``rms_norm(add(a, b), w, eps)``, a residual add and the norm that reads it,
  as one call returning both (the sum goes on to the next residual add);
* ``heads``: ``transpose(select(r(transpose(view(x, sizes), 1, 2)), 0, 0), 0, 1)``, with ``r``
  the fused ``rope`` or nothing: a projection's output as the q, k or v the attention side
  takes (5 or 4 calls per tensor, three tensors a layer).

A chain matches by structure alone (the graph carries no dtypes): the kernels compute float32
rows themselves and run the chain's own ATen ops for anything else, so a match never changes
what a slice computes beyond float rounding (the kernel file says where). Nodes a fused chain no
longer needs are dropped; a chain whose intermediate values have other users keeps them.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
_END = (2 ** 63 - 1, None)  # an open slice end, as export writes it


def _call(node: Any, target: Any, nargs: int | None = None) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and not node.kwargs and (nargs is None or len(node.args) == nargs))


def _rms_norm(n: fx.Node) -> tuple | None:
    """``(x, w, eps)`` where ``n`` ends an RMSNorm chain."""
    if not _call(n, aten.mul.Tensor, 2):
        return None
    for w, y in (n.args, n.args[::-1]):
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and _call(y, aten.mul.Tensor, 2)):
            continue
        x, r = y.args
        if not (_call(r, aten.rsqrt.default, 1) and _call(r.args[0], aten.add.Tensor, 2)):
            continue
        m, eps = r.args[0].args
        if not (isinstance(eps, float) and _call(m, aten.mean.dim, 3)
                and list(m.args[1]) == [-1] and m.args[2] is True):
            continue
        p = m.args[0]
        if _call(p, aten.pow.Tensor_Scalar, 2) and p.args[0] is x and p.args[1] == 2:
            return x, w, eps
    return None


def _silu_mul(n: fx.Node) -> tuple | None:
    """``(a, b)`` where ``n`` is ``mul(silu(a), b)`` (or ``mul(b, silu(a))``)."""
    if not _call(n, aten.mul.Tensor, 2):
        return None
    for s, b in (n.args, n.args[::-1]):
        if _call(s, aten.silu.default, 1) and isinstance(b, fx.Node):
            return s.args[0], b
    return None


def _table(c: Any, fn: Any) -> tuple | None:
    """``(pos, inv_freq, scale, cat node)`` where ``c`` is ``unsqueeze(mul(fn(cat([f, f], -1)),
    scale), 1)`` with ``f = mul(_to_copy(unsqueeze(pos, 2), float32), inv_freq)``."""
    if not (_call(c, aten.unsqueeze.default, 2) and c.args[1] == 1
            and _call(c.args[0], aten.mul.Tensor, 2)):
        return None
    t, scale = c.args[0].args
    if not (isinstance(scale, (int, float)) and _call(t, fn, 1)):
        return None
    e = t.args[0]
    if not (_call(e, aten.cat.default, 2) and e.args[1] == -1 and len(e.args[0]) == 2
            and e.args[0][0] is e.args[0][1] and _call(e.args[0][0], aten.mul.Tensor, 2)):
        return None
    cast, inv_freq = e.args[0][0].args
    if not (isinstance(cast, fx.Node) and cast.op == "call_function"
            and cast.target is aten._to_copy.default and len(cast.args) == 1
            and cast.kwargs == {"dtype": torch.float32}
            and _call(cast.args[0], aten.unsqueeze.default, 2) and cast.args[0].args[1] == 2
            and isinstance(inv_freq, fx.Node) and inv_freq.op == "get_attr"):
        return None
    return cast.args[0].args[0], inv_freq, float(scale), e


def _rope(n: fx.Node) -> tuple | None:
    """``(x, pos, inv_freq, scale, half)`` where ``n`` applies the rotary embedding to ``x``."""
    if not _call(n, aten.add.Tensor, 2):
        return None
    for a, b in (n.args, n.args[::-1]):
        if not (_call(a, aten.mul.Tensor, 2) and _call(b, aten.mul.Tensor, 2)):
            continue
        x, c = a.args
        rot, s = b.args
        if not (_call(rot, aten.cat.default, 2) and rot.args[1] == -1 and len(rot.args[0]) == 2):
            continue
        neg, lo = rot.args[0]
        if not (_call(neg, aten.neg.default, 1) and _call(neg.args[0], aten.slice.Tensor, 4)
                and _call(lo, aten.slice.Tensor, 4)):
            continue
        hi = neg.args[0]
        half = lo.args[3]
        if not (hi.args[0] is x and lo.args[0] is x and hi.args[1] == 3 and lo.args[1] == 3
                and lo.args[2] == 0 and hi.args[2] == half and hi.args[3] in _END):
            continue
        cos, sin = _table(c, aten.cos.default), _table(s, aten.sin.default)
        if cos is not None and sin is not None and cos[3] is sin[3] and cos[2] == sin[2]:
            return x, cos[0], cos[1], cos[2], half
    return None


CHAINS = {"rms_norm": _rms_norm, "silu_mul": _silu_mul, "rope": _rope}


def _add_rms_norm(n: fx.Node, ext: Any) -> fx.Node | None:
    """The ``add`` node whose sum the fused ``rms_norm`` node ``n`` normalises."""
    if not _call(n, ext.rms_norm, 3):
        return None
    s = n.args[0]
    if _call(s, aten.add.Tensor, 2) and all(isinstance(a, fx.Node) for a in s.args):
        return s
    return None


def _heads(n: fx.Node, ext: Any) -> tuple | None:
    """``(x, sizes, pos, inv_freq, scale, half)`` where ``n`` ends a heads chain (``pos`` and
    ``inv_freq`` None where no rotary embedding sits in it)."""
    if not (_call(n, aten.transpose.int, 3) and n.args[1:] == (0, 1)):
        return None
    sel = n.args[0]
    if not (_call(sel, aten.select.int, 3) and sel.args[1:] == (0, 0)):
        return None
    t, rot = sel.args[0], (None, None, 1.0, 0)
    if _call(t, ext.rope, 5):
        t, rot = t.args[0], t.args[1:]
    if not (_call(t, aten.transpose.int, 3) and t.args[1:] == (1, 2)
            and _call(t.args[0], aten.view.default, 2)):
        return None
    return (*t.args[0].args, *rot)


def _fold_heads(graph: fx.Graph, node: fx.Node, ext: Any) -> bool:
    """Replace the heads chain that ``node`` ends by one ``ext.heads`` call."""
    if (args := _heads(node, ext)) is None:
        return False
    with graph.inserting_before(node):
        node.replace_all_uses_with(graph.call_function(ext.heads, args))
    graph.erase_node(node)
    return True


def _fold_add_rms_norm(graph: fx.Graph, node: fx.Node, ext: Any) -> bool:
    """Replace the fused norm ``node`` and the add it reads by one ``ext.add_rms_norm`` call."""
    if (s := _add_rms_norm(node, ext)) is None:
        return False
    between = s.next
    while between is not node:  # the sum read before its norm: no place for the fold
        if between in s.users:
            return False
        between = between.next
    with graph.inserting_before(node):
        both = graph.call_function(ext.add_rms_norm, (*s.args, *node.args[1:]))
        total = graph.call_function(operator.getitem, (both, 0))
        normed = graph.call_function(operator.getitem, (both, 1))
    node.replace_all_uses_with(normed)
    graph.erase_node(node)
    s.replace_all_uses_with(total)
    graph.erase_node(s)
    return True


FOLDS = {"add_rms_norm": _fold_add_rms_norm, "heads": _fold_heads}


def fuse_small_ops(gm: fx.GraphModule, ext: Any) -> dict[str, int]:
    """Point every chain of ``gm`` in :data:`CHAINS` at the kernel of the same name in ``ext``
    (the built extension, :func:`lamina.kernels.cpp_ext.load`), then fold :data:`FOLDS`; in
    place, recompiled. Returns how many of each were fused or folded."""
    counts = dict.fromkeys((*CHAINS, *FOLDS), 0)
    for node in list(gm.graph.nodes):
        for name, match in CHAINS.items():
            args = match(node)
            if args is None:
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(getattr(ext, name), args)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            counts[name] += 1
            break
    gm.graph.eliminate_dead_code()  # the chains' leftovers, which still read their inputs
    for node in list(gm.graph.nodes):
        for name, fold in FOLDS.items():
            if fold(gm.graph, node, ext):
                counts[name] += 1
                break
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return counts
