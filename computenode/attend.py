"""Fan-out of a step's attention to memory nodes and the exact merge of their answers.

For every scheduled segment, each node holding part of the request gets all of the segment's
query rows (it attends them over its shard, causal by absolute position) and the k/v rows of
the positions it stores. A node's rows follow its ``works`` order, matching ``PrepareMsg``.
Rows seen by one node are copied; rows seen by several are merged by log-sum-exp.

With ``parts > 1`` a node's share of a layer goes out as up to ``parts`` mini-batches (runs of
whole works, balanced by query rows), each its own ATTEND with its own RESULT: the node attends
the first while later ones are still arriving (communication-attention overlap, Lamina §5.2.1).
"""
from __future__ import annotations

import torch

from lamina.kernels import merge_states
from lamina.types import AttendMsg, AttendResult, NodeRoute


def work_runs(route: NodeRoute, parts: int) -> list[tuple[int, int]]:
    """At most ``parts`` non-empty runs ``[a, b)`` of ``route``'s works covering them all, with
    about the same number of query rows each."""
    R = len(route.works)
    if parts <= 1 or R <= 1:
        return [(0, R)]
    q = torch.tensor([w.num_q for w in route.works]).cumsum(0)
    total = int(q[-1])
    cuts = [0]
    for p in range(1, parts):  # the work boundary nearest p/parts of the rows
        target = p * total / parts
        i = int(torch.searchsorted(q, torch.tensor(target, dtype=q.dtype).ceil()))
        below = int(q[i - 1]) if i > 0 else 0
        c = i if target - below <= int(q[i]) - target else i + 1
        if cuts[-1] < c < R:
            cuts.append(c)
    return list(zip(cuts, cuts[1:] + [R]))


def attend_messages(step_id: int, layer: int, routes: list[NodeRoute], q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, reply_to: int = 0,
                    parts: int = 1) -> list[list[AttendMsg]]:
    """Per route, its ATTEND for the layer: one message, or its mini-batches in works order."""
    out = []
    for r in routes:
        qr, kr, vr = r.rows(q), r.rows(k, kv=True), r.rows(v, kv=True)
        runs = work_runs(r, parts)
        if len(runs) == 1:
            out.append([AttendMsg(step_id, layer, qr, kr, vr, reply_to)])
            continue
        q_ptr = [0] + torch.tensor([w.num_q for w in r.works]).cumsum(0).tolist()
        a_ptr = [0] + torch.tensor([w.num_append for w in r.works]).cumsum(0).tolist()
        out.append([AttendMsg(step_id, layer, qr[q_ptr[a]:q_ptr[b]], kr[a_ptr[a]:a_ptr[b]],
                              vr[a_ptr[a]:a_ptr[b]], reply_to, works=(a, b)) for a, b in runs])
    return out


def join_results(results: list[AttendResult]) -> AttendResult:
    """One node's mini-batch RESULTs for a layer (in order) as one result for all its works."""
    if len(results) == 1:
        return results[0]
    first, last = results[0], results[-1]
    span = (first.span_ns[0], last.span_ns[1]) if first.span_ns and last.span_ns else None
    return AttendResult(first.step_id, first.layer, torch.cat([r.o for r in results]),
                        torch.cat([r.lse for r in results]), span)


def merge_results(routes: list[NodeRoute], results, num_tokens: int) -> torch.Tensor:
    """Assemble ``o[T,H,D]`` from per-node ``AttendResult``s (same order as ``routes``)."""
    spans = [r.span for r in routes]
    if all(spans) and spans[0][0] == 0 and spans[-1][1] == num_tokens \
            and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):  # the nodes tile the rows
        return results[0].o if len(results) == 1 else torch.cat([res.o for res in results])
    first = results[0].o
    o = first.new_zeros((num_tokens,) + tuple(first.shape[1:]))
    lse = torch.full((num_tokens, first.shape[1]), float("-inf"), device=first.device)
    seen = torch.zeros(num_tokens, dtype=torch.bool, device=first.device)
    for r, res in zip(routes, results):
        rows = r.q_rows
        fresh = ~seen[rows]
        if bool(fresh.all()):
            o[rows], lse[rows] = res.o, res.lse
        else:
            mo, ml = merge_states([o[rows], res.o], [lse[rows], res.lse])
            o[rows], lse[rows] = mo, ml
        seen[rows] = True
    return o
