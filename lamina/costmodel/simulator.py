"""Discrete-event simulator of staggered pipelining (Lamina §5.1): none, fixed and rotational.

One iteration of a micro-batch runs ``layers + 1`` slices on compute replicas; between slice k
and k+1 the layer's attention runs on every memory node (the pool's share split evenly over
``memory_nodes``): q/k/v travel to the nodes (``send_s``), each node attends in FIFO order, the
outputs travel back (``recv_s``). Replicas and memory nodes are non-preemptive FIFO servers;
links are pure delays. Under ``rotational`` slice k of micro-batch j runs on replica
``(j + k) mod N`` and the context (residual) moves to the next replica while attention runs
(``context_s``, overlapped); under ``fixed`` micro-batch j stays on replica ``j mod N``; ``none``
is one micro-batch on replica 0. A finished micro-batch starts its next iteration at once
(continuous batching). With ``attn_parts = P > 1`` each node's share goes out as P mini-batches
(communication-attention overlap): part p arrives ``send_s * (p+1) / P`` after the slice ends,
the node attends it as soon as it is there, and the last part's output takes ``recv_s / P`` back. Times are seconds; inputs may be measured on a machine or taken from
:func:`lamina.costmodel.model.layer_times` for hardware we do not have.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from lamina.computenode.schedule import replica_for
from lamina.config import SCHEDULES

@dataclass(frozen=True)
class StageTimes:
    """Per-micro-batch durations in seconds. ``slice_s``: one slice on one replica (the last
    one adds ``head_s``: LM head and sampling); ``attn_s``: one layer's attention for the whole
    micro-batch on one memory node (the pool splits it: ``attn_s / memory_nodes`` each);
    ``send_s``/``recv_s``: q/k/v out and o back per layer; ``context_s``: moving the context to
    another replica (rotational only; overlapped with attention)."""

    slice_s: float
    attn_s: float
    send_s: float = 0.0
    recv_s: float = 0.0
    context_s: float = 0.0
    head_s: float = 0.0
    tokens: int = 1  # tokens a micro-batch iteration produces (its batch size)

    def __post_init__(self) -> None:
        if min(self.slice_s, self.attn_s, self.send_s, self.recv_s, self.context_s,
               self.head_s) < 0 or self.tokens < 1:
            raise ValueError(f"stage times must be >= 0 and tokens >= 1: {self}")


@dataclass(frozen=True)
class SimConfig:
    schedule: str
    micro_batches: int
    replicas: int
    memory_nodes: int
    layers: int
    times: StageTimes
    iterations: int = 20  # per micro-batch
    attn_parts: int = 1  # mini-batches per node and layer

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}")
        if min(self.micro_batches, self.replicas, self.memory_nodes, self.layers,
               self.iterations, self.attn_parts) < 1:
            raise ValueError("micro_batches, replicas, memory_nodes, layers, iterations and "
                             "attn_parts must be >= 1")
        if self.schedule == "none" and self.micro_batches != 1:
            raise ValueError("schedule 'none' runs exactly one micro-batch")


@dataclass
class SimResult:
    """``throughput``: tokens/s over the run; ``token_latency_s``: mean time between two tokens
    of one request (an iteration of its micro-batch); ``replica_util``/``node_util``: busy
    fraction of each replica and memory node; ``spans``: ``(resource, label, start, end)``."""

    config: SimConfig
    makespan_s: float
    tokens: int
    throughput: float
    token_latency_s: float
    replica_util: list[float]
    node_util: list[float]
    spans: list[tuple[str, str, float, float]] = field(default_factory=list, repr=False)

    @property
    def compute_util(self) -> float:
        return sum(self.replica_util) / len(self.replica_util)

    @property
    def memory_util(self) -> float:
        return sum(self.node_util) / len(self.node_util)


def simulate(cfg: SimConfig, keep_spans: bool = False) -> SimResult:
    """Run ``cfg.iterations`` iterations of every micro-batch; see the module docstring."""
    t, L, M, N, P = cfg.times, cfg.layers, cfg.memory_nodes, cfg.replicas, cfg.attn_parts
    rep_free, node_free = [0.0] * N, [0.0] * M
    rep_busy, node_busy = [0.0] * N, [0.0] * M
    spans: list[tuple[str, str, float, float]] = []
    order = itertools.count()
    # events: (time, seq, kind, micro_batch, slice_index, iteration, previous replica)
    events = [(0.0, next(order), "slice", j, 0, 0, -1) for j in range(cfg.micro_batches)]
    heapq.heapify(events)
    iter_times: list[float] = []
    iter_start = [0.0] * cfg.micro_batches
    end = 0.0
    while events:
        now, _, kind, j, k, it, prev = heapq.heappop(events)
        if kind == "slice":
            r = replica_for(cfg.schedule, j, k, N)
            dur = t.slice_s + (t.head_s if k == L else 0.0)
            start = max(now, rep_free[r])
            rep_free[r] = start + dur
            rep_busy[r] += dur
            if keep_spans:
                spans.append((f"replica {r}", f"mb{j} slice {k}", start, start + dur))
            if k < L:
                heapq.heappush(events, (start + dur, next(order), "attn", j, k, it, r))
                continue
            end = max(end, start + dur)
            iter_times.append(start + dur - iter_start[j])
            iter_start[j] = start + dur
            if it + 1 < cfg.iterations:
                heapq.heappush(events, (start + dur, next(order), "slice", j, 0, it + 1, r))
        else:  # attention of layer k on every node; the next slice waits for all of them
            share = t.attn_s / M / P
            done = now
            for m in range(M):
                for p in range(P):
                    start = max(now + t.send_s * (p + 1) / P, node_free[m])
                    node_free[m] = start + share
                    node_busy[m] += share
                    if keep_spans:
                        label = f"mb{j} attn {k}" + (f".{p}" if P > 1 else "")
                        spans.append((f"memory {m}", label, start, start + share))
                done = max(done, node_free[m])
            ready = done + t.recv_s / P
            nxt = replica_for(cfg.schedule, j, k + 1, N)
            if nxt != prev:
                ready = max(ready, now + t.context_s)
            heapq.heappush(events, (ready, next(order), "slice", j, k + 1, it, prev))
    tokens = cfg.micro_batches * cfg.iterations * t.tokens
    return SimResult(cfg, end, tokens, tokens / end if end > 0 else 0.0,
                     sum(iter_times) / len(iter_times),
                     [b / end for b in rep_busy], [b / end for b in node_busy], spans)
