"""Cascade attention over shared prefixes: a step's requests that start on the same slots (a
prefix from the prefix cache, :mod:`lamina.engine.prefix_cache`) read those keys once.

A *group* is two or more works whose shards begin with the same ``p >= MIN_SHARED`` slots
(saving at least ``MIN_SAVED`` key reads) and whose queries all come at or after position
``p`` (so every query sees the whole prefix). The
step then runs its kernel twice (Hydragen / FlashInfer's cascade): once over each work's own
keys (a grouped work's from ``p`` on), and once with every grouped query of a group as the
rows of one kernel request over the shared keys, so each tile of queries reads each prefix
key once instead of once per request. The two partial results of a grouped query merge
exactly by their log-sum-exp (as shards of one request do across nodes).

Only layers without a sliding window, and ATTENDs of a whole step (not a mini-batch), use it
(the others read the plain indices). The native plane (:mod:`lamina.memnode.native`) runs the
same two kernel calls and merge for float32 queries (its replies are this path's, byte for
byte); other query dtypes it leaves to this one. Contract of the merged result: the kernel's
(o in q's dtype, lse float32) up to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MIN_SAVED", "MIN_SHARED", "Cascade", "attend_cascade", "shared_prefixes"]

# A group pays for a second kernel call and a merge per layer: worth it only when it saves
# reading many keys (measured: 8 requests on a 200-token prefix ran slower with it, 64 on
# 2,000 faster; bench/prefix.py --traces attention)
MIN_SHARED = 64  # shared positions at least
MIN_SAVED = 4096  # key positions not read again: (members - 1) * shared


@dataclass
class Cascade:
    """The second pass of a step: ``suffix`` (every work's keys, a grouped one's from its
    prefix's end: a :class:`~lamina.memnode.plan.KernelIndex`), and the groups as kernel
    requests: their query ``rows`` (int64 [Tg], step rows, group by group), ``qo_indptr``
    (host [G+1]), ``q_positions`` [Tg] and ``prefix`` (each group's shared keys)."""

    suffix: object  # KernelIndex
    rows: torch.Tensor
    qo_indptr: np.ndarray
    q_positions: torch.Tensor
    prefix: object  # KernelIndex


def shared_prefixes(olds: list[np.ndarray], ks: np.ndarray, q_start: np.ndarray,
                    num_q: np.ndarray) -> list[tuple[list[int], int]]:
    """Groups ``(works, p)`` of works whose held slots ``olds[r]`` (positions from ``ks[r]``)
    start with the same ``p >= MIN_SHARED`` slots, ``p <= q_start`` of each, worth a second
    pass (see ``MIN_SAVED``; vectorised compares, one pass over the prefix per member)."""
    by_first: dict[int, list[int]] = {}
    for r, old in enumerate(olds):
        if num_q[r] and ks[r] == 0 and old.size >= MIN_SHARED:
            by_first.setdefault(int(old[0]), []).append(r)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        p = int(min(min(olds[r].size for r in members), min(q_start[r] for r in members)))
        base = olds[members[0]][:p]
        for r in members[1:]:
            diff = np.flatnonzero(olds[r][:p] != base)
            if diff.size:
                p = int(diff[0])
                base = base[:p]
        if p >= MIN_SHARED and (len(members) - 1) * p >= MIN_SAVED:
            groups.append((members, p))
    return groups


def attend_cascade(attention, merge, q: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, qo_indptr: torch.Tensor, q_positions: torch.Tensor,
                   c: Cascade, spec, **scales) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` (a paged attention kernel) over the step's own keys and, once per group,
    its shared prefix; the grouped rows merged by LSE with ``merge`` (in place:
    :func:`lamina.kernels.dispatch.resolve_merge`). Returns ``(o[Tq,H,D], lse[Tq,H])``."""
    s = c.suffix
    o, lse = attention(q, k_pool, v_pool, qo_indptr, torch.from_numpy(s.kv_indptr), s.kv_indices,
                       q_positions, s.kv_start_pos, spec, **scales)
    p = c.prefix
    og, lg = attention(q[c.rows], k_pool, v_pool, torch.from_numpy(c.qo_indptr),
                       torch.from_numpy(p.kv_indptr), p.kv_indices, c.q_positions,
                       p.kv_start_pos, spec, **scales)
    merge(o, lse, c.rows, og, lg)  # lg is finite: every grouped query sees its prefix
    return o, lse
