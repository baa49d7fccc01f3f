"""Staggered pipelining (Lamina §5.1): several micro-batches in flight on compute replicas.

:class:`PipelineExecutor` drives up to ``n`` micro-batches (StepPlans) through the slices of a
split model from one thread. A micro-batch's slice k runs on replica
``replica_for(schedule, j, k, N)`` (:mod:`lamina.costmodel.simulator`): ``rotational`` moves its context to
the next replica after every slice, ``fixed`` keeps micro-batch j on replica ``j mod N``,
``none`` is one micro-batch on replica 0. After a slice the executor sends the layer's ATTEND to
the memory nodes without waiting and runs whatever other micro-batch is ready, so the nodes
attend one micro-batch while the replicas compute another. When nothing is ready it collects the
oldest outstanding attention: nodes answer in the order ATTENDs were sent, so the oldest
outstanding micro-batch is at the head of every node's queue and no reply is ever out of order.

Replicas here live in this process (one per device; on one device they take turns, as with one
replica and two micro-batches). ``reply_to`` in each ATTEND names the replica that runs the next
slice; in this process the executor receives for it.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field


from lamina.computenode.attend import attend_messages, join_results, merge_results
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.schedule import replica_for
from lamina.config import PipelineConfig
from lamina.splitter.slices import ATTN_OUT
from lamina.timeline import Timeline
from lamina.transport.node_client import NodeClient
from lamina.types import NodeRoute, PrepareMsg, SamplingParams, StepPlan


@dataclass
class InFlight:
    """One micro-batch between submit and completion. ``values`` is its context (the inputs of
    slice ``k``), owned by the executor; ``attn_sent_ns`` marks an outstanding attention."""

    slot: int
    plan: StepPlan
    routes: list[NodeRoute]
    req_ids: list[int]
    params: list[SamplingParams]
    k: int = 0
    values: dict = field(default_factory=dict)
    replica: int = 0
    attn_seq: int = -1
    attn_sent_ns: int = 0
    attn_parts: list[int] = field(default_factory=list)  # ATTENDs outstanding per route


@dataclass
class ExecutorTimes:
    """Cumulative seconds: ``compute_s`` in slices and sampling, ``wait_s`` blocked on memory
    nodes, ``send_s`` building and sending ATTENDs; ``steps`` micro-batch iterations."""

    steps: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    send_s: float = 0.0


class PipelineExecutor:
    """Runs micro-batches on ``replicas`` against ``nodes``; see the module docstring.

    ``submit`` starts micro-batch ``slot`` (PREPAREs go out at once, without waiting);
    ``wait`` advances every micro-batch in flight until at least one finishes and returns
    ``[(slot, tokens)]``. Errors (a node failure, a bad plan) propagate from ``wait``; the
    caller then drops every micro-batch in flight (:meth:`reset`).
    """

    def __init__(self, replicas: list[ComputeReplica], nodes: list[NodeClient],
                 config: PipelineConfig | None = None, timeline: Timeline | None = None):
        self.config = config or PipelineConfig(replicas=len(replicas))
        if len(replicas) != self.config.replicas:
            raise ValueError(f"pipeline wants {self.config.replicas} replicas, got {len(replicas)}")
        self.replicas = replicas
        self.nodes = nodes
        self.timeline = timeline
        self.times = ExecutorTimes()
        self._ready: deque[InFlight] = deque()
        self._waiting: dict[int, InFlight] = {}  # attn_seq -> micro-batch
        self._slots: dict[int, InFlight] = {}
        self._seq = itertools.count()
        self.max_in_flight = 0  # most micro-batches in flight at once so far

    @property
    def in_flight(self) -> list[int]:
        return sorted(self._slots)

    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        if not 0 <= slot < self.config.micro_batches or slot in self._slots:
            raise ValueError(f"micro-batch slot {slot} is busy or out of range "
                             f"(0..{self.config.micro_batches - 1})")
        for route in routes:
            self.nodes[route.node].send_prepare(PrepareMsg(plan.step_id, route.works))
        mb = InFlight(slot, plan, routes, list(req_ids), list(params))
        mb.replica = self._replica(mb)
        mb.values = self.replicas[mb.replica].begin(plan)
        self._slots[slot] = mb
        self._ready.append(mb)
        self.max_in_flight = max(self.max_in_flight, len(self._slots))

    def wait(self) -> list[tuple[int, list[int]]]:
        done: list[tuple[int, list[int]]] = []
        while self._slots and not done:
            if self._ready:
                finished = self._run_slice(self._ready.popleft())
                if finished is not None:
                    done.append(finished)
            else:
                self._collect(self._waiting.pop(min(self._waiting)))
        return done

    def execute(self, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                params: list[SamplingParams]) -> list[int]:
        """One micro-batch, start to finish (nothing else may be in flight)."""
        if self._slots:
            raise RuntimeError("execute() with micro-batches in flight; use submit/wait")
        self.submit(0, plan, routes, req_ids, params)
        return self.wait()[0][1]

    def reset(self) -> None:
        """Forget every micro-batch in flight (after an error)."""
        self._ready.clear()
        self._waiting.clear()
        self._slots.clear()

    # -- internals -------------------------------------------------------------------------------
    def _replica(self, mb: InFlight) -> int:
        return replica_for(self.config.schedule, mb.slot, mb.k, self.config.replicas)

    def _run_slice(self, mb: InFlight) -> tuple[int, list[int]] | None:
        replica = self.replicas[self._replica(mb)]
        t0 = time.perf_counter_ns()
        context, qkv, logits = replica.run_slice(mb.k, mb.values)
        if context is None:
            tokens = replica.sample(logits, mb.req_ids, mb.params).tolist()
            t1 = time.perf_counter_ns()
            self._span("compute", mb, f"slice {mb.k} + sample", t0, t1)
            self.times.compute_s += (t1 - t0) / 1e9
            self.times.steps += 1
            del self._slots[mb.slot]
            return mb.slot, tokens
        q, k, v = qkv
        t1 = time.perf_counter_ns()
        msgs = attend_messages(mb.plan.step_id, mb.k, mb.routes, q, k, v,
                               reply_to=replica_for(self.config.schedule, mb.slot, mb.k + 1,
                                                    self.config.replicas),
                               parts=self.config.attn_parts)
        for route, parts in zip(mb.routes, msgs):
            for msg in parts:
                self.nodes[route.node].send_attend(msg)
        mb.attn_parts = [len(parts) for parts in msgs]
        t2 = time.perf_counter_ns()
        self._span("compute", mb, f"slice {mb.k}", t0, t1)
        self._span("compute", mb, "send", t1, t2)
        self.times.compute_s += (t1 - t0) / 1e9
        self.times.send_s += (t2 - t1) / 1e9
        mb.values, mb.attn_sent_ns = context, t2
        mb.attn_seq = next(self._seq)
        self._waiting[mb.attn_seq] = mb
        return None

    def _collect(self, mb: InFlight) -> None:
        t0 = time.perf_counter_ns()
        parts = [[self.nodes[route.node].recv_attend() for _ in range(n)]
                 for route, n in zip(mb.routes, mb.attn_parts)]
        t1 = time.perf_counter_ns()
        self.times.wait_s += (t1 - t0) / 1e9
        o = merge_results(mb.routes, [join_results(p) for p in parts], mb.plan.num_tokens)
        t2 = time.perf_counter_ns()
        if self.timeline is not None:
            for route, results in zip(mb.routes, parts):
                for i, res in enumerate(results):
                    start, end = res.span_ns or (mb.attn_sent_ns, t1)
                    name = f"attend {mb.k}" + (f".{i}" if len(results) > 1 else "")
                    self.timeline.add("memory", route.node, name, start, end,
                                      micro_batch=mb.slot, step=mb.plan.step_id,
                                      sent_ns=mb.attn_sent_ns, received_ns=t1)
        mb.values[ATTN_OUT] = o.contiguous()
        mb.k += 1
        # on the replica that runs the next slice: "wait" blocked on nodes, "recv" merging
        self._span("compute", mb, "wait", t0, t1)
        self._span("compute", mb, "recv", t1, t2)
        self._ready.append(mb)

    def _span(self, role: str, mb: InFlight, name: str, start: int, end: int) -> None:
        if self.timeline is not None:
            self.timeline.add(role, self._replica(mb), name, start, end, micro_batch=mb.slot,
                              step=mb.plan.step_id)
