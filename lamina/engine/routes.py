"""Where a micro-batch's rows go: one route per memory node holding part of its requests."""
from __future__ import annotations

import torch

from lamina.engine.scheduler import ScheduledSegment
from lamina.types import NodeRoute, ShardWork

__all__ = ["build_routes"]


def build_routes(segs: list[ScheduledSegment]) -> list[NodeRoute]:
    """Per memory node holding part of a segment's request: its works (in segment order) and
    the step rows of its queries and of the k/v it stores (see :class:`NodeRoute`)."""
    works: dict[int, list[ShardWork]] = {}
    q_rows: dict[int, list[range]] = {}
    kv_rows: dict[int, list[range]] = {}
    offset = 0
    for seg in segs:
        req = seg.req
        appends = {node: (start, count) for node, start, count in seg.appends}
        for shard_node in dict.fromkeys(s.node for s in req.shards):
            a_start, a_count = appends.get(shard_node, (0, 0))
            works.setdefault(shard_node, []).append(
                ShardWork(req.req_id, seg.start, seg.num_tokens, a_start, a_count))
            q_rows.setdefault(shard_node, []).append(range(offset, offset + seg.num_tokens))
            first = offset + (a_start - seg.start)
            kv_rows.setdefault(shard_node, []).append(range(first, first + a_count))
        offset += seg.num_tokens
    routes = []
    for node in sorted(works):
        q = [i for r in q_rows[node] for i in r]
        kv = [i for r in kv_rows[node] for i in r]
        routes.append(NodeRoute(node, works[node], torch.tensor(q, dtype=torch.long),
                                torch.tensor(kv, dtype=torch.long)))
    return routes
