"""The ``inproc`` placement's worker: every compute replica in the engine's process (sharing one
Sampler and the weights), run by the replica core (:class:`~lamina.computenode.runner.SliceRunner`)
against in-process memory nodes (local calls, no copy).

One thread drives it: :meth:`InProcessReplicas.wait` runs the oldest ready slice, and when none
is ready it collects the results of the micro-batch whose ATTENDs went out first. Nodes answer
in the order ATTENDs were sent, so that micro-batch is at the head of every node's queue and no
reply is ever read out of order.
"""
from __future__ import annotations

import time

from lamina.computenode.replica import ComputeReplica
from lamina.computenode.microbatch import MicroBatch
from lamina.computenode.runner import SliceRunner
from lamina.config import PipelineConfig
from lamina.engine.worker import WorkerClient, WorkerTimes
from lamina.timeline import Timeline
from lamina.transport.node_client import NodeClient
from lamina.types import (AttendMsg, NativeExchange, NodeRoute, NodeStats, PrepareMsg,
                          SamplingParams, StepPlan)


class InProcessReplicas(WorkerClient):
    """``replicas`` (``pipeline.replicas`` of them) against ``nodes``: the own pool's nodes,
    then attached (borrowed) ones. ``polling``: pre-launch each next slice behind a device flag
    (:func:`lamina.computenode.polling.make_polling`; None: off). ``step_graphs`` and
    ``serve``: whole decode steps as one graph launch each, this thread serving the nodes'
    mailboxes meanwhile (:func:`lamina.computenode.step_graphs.device_steps`)."""

    def __init__(self, replicas: list[ComputeReplica], nodes: list[NodeClient],
                 pipeline: PipelineConfig, timeline: Timeline | None = None, polling=None,
                 step_graphs: dict | None = None, serve=None):
        if len(replicas) != pipeline.replicas:
            raise ValueError(f"pipeline wants {pipeline.replicas} replicas, got {len(replicas)}")
        self.replicas = replicas
        self.nodes = list(nodes)
        self.pipeline = pipeline
        self.timeline = timeline
        self.polling = polling
        self.runner = SliceRunner(dict(enumerate(replicas)), pipeline, self, polling=polling,
                                  span=self._span if timeline is not None else None,
                                  step_graphs=step_graphs, serve=serve)
        self._done: list[tuple[int, list[int]]] = []
        self._times = WorkerTimes()

    # -- the runner's port --------------------------------------------------------------------
    def to_node(self, node: int, msg: PrepareMsg | AttendMsg) -> None:
        if isinstance(msg, PrepareMsg):
            self.nodes[node].send_prepare(msg)
        else:
            self.nodes[node].send_attend(msg)

    def native_exchange(self, node: int, reply_to: int) -> NativeExchange | None:
        return self.nodes[node].native_exchange()

    def collect(self, node: int, step_id: int, layer: int) -> None:
        raise AssertionError("an in-process node's exchange answers or declines")

    def exchange(self, node: int, msg: AttendMsg) -> tuple[int, None]:
        self.nodes[node].send_attend(msg)
        return time.perf_counter_ns(), None  # the driver's wait takes RESULTs off the nodes

    def to_next(self, mb: MicroBatch, values, parts) -> None:
        raise AssertionError("every replica of an in-process instance runs in this process")

    def to_engine(self, mb: MicroBatch, tokens: list[int]) -> None:
        self._done.append((mb.slot, tokens))
        self._times.steps += 1

    def failed(self, mb: MicroBatch, error: Exception) -> None:
        raise error  # the engine drops every micro-batch in flight (reset)

    # -- WorkerClient -------------------------------------------------------------------------------
    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        if not 0 <= slot < self.pipeline.micro_batches or \
                any(mb.slot == slot for mb in self.runner.mbs.values()):
            raise ValueError(f"micro-batch slot {slot} is busy or out of range "
                             f"(0..{self.pipeline.micro_batches - 1})")
        start = time.perf_counter()
        try:
            uniforms = None  # keyed by position: a step dropped in flight changes no draw
            if any(p.temperature != 0 for p in params):
                uniforms = self.replicas[0].sampler.draw(req_ids, params, plan.sampled_positions())
            self.runner.start(MicroBatch(plan, routes, list(req_ids), list(params), uniforms))
        finally:
            self._times.execute_s += time.perf_counter() - start
        self.max_in_flight = max(self.max_in_flight, len(self.runner.mbs))

    def wait(self) -> list[tuple[int, list[int]]]:
        start = time.perf_counter()
        try:
            while self.runner.mbs and not self._done:
                mb = self.runner.next_ready()
                if mb is not None:
                    self.runner.run(mb)
                else:
                    self._collect()
            done, self._done = self._done, []
            return done
        finally:
            self._times.execute_s += time.perf_counter() - start

    def reset(self) -> None:
        for step_id in list(self.runner.mbs):
            self.runner.drop(step_id)
        self._done.clear()

    def free(self, req_ids: list[int], release: list[int]) -> None:
        for r in release:
            self.replicas[0].release(r)  # the replicas share one sampler
        if req_ids:
            for node in self.nodes:
                node.free(req_ids)

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]

    def attach(self, client: NodeClient) -> int:
        self.nodes.append(client)
        return len(self.nodes) - 1

    def times(self) -> WorkerTimes:
        return self._times

    def close(self) -> None:
        if self.polling is not None:
            self.polling.close()

    # -- internals ------------------------------------------------------------------------------
    def _collect(self) -> None:
        """Receive every RESULT of the oldest outstanding micro-batch (blocking)."""
        mb = self.runner.outstanding()
        if mb is None:
            raise RuntimeError("micro-batches in flight, none ready and no attention outstanding")
        t0 = time.perf_counter_ns()
        results = [[self.nodes[r.node].recv_attend() for _ in range(n)]
                   for r, n in zip(mb.routes, mb.parts)]
        t1 = time.perf_counter_ns()
        for i, route_results in enumerate(results):
            for res in route_results:
                self.runner.on_result(mb, i, res)
        self._times.wait_s += (t1 - t0) / 1e9
        self._span("compute", self.runner.replica_of(mb, mb.k), "wait", t0, t1, mb)

    def _span(self, role: str, track: int, name: str, start: int, end: int,
              mb: MicroBatch) -> None:
        if self.timeline is None:
            return
        args = {"micro_batch": mb.slot, "step": mb.step_id}
        if role == "memory":  # when the layer's ATTENDs went out and its results came in
            args.update(sent_ns=mb.sent_ns, received_ns=mb.received_ns)
        self.timeline.add(role, track, name, start, end, **args)
