"""The ``inproc`` placement's worker: compute replicas in the engine's process, sharing one
Sampler and the weights, driven by a :class:`~lamina.computenode.executor.PipelineExecutor`
against in-process memory nodes (local calls, no copy)."""
from __future__ import annotations

import time

from lamina.computenode.executor import PipelineExecutor
from lamina.computenode.replica import ComputeReplica
from lamina.config import PipelineConfig
from lamina.engine.worker import WorkerClient, WorkerTimes
from lamina.timeline import Timeline
from lamina.transport.node_client import NodeClient
from lamina.types import NodeRoute, NodeStats, SamplingParams, StepPlan


class InProcessReplicas(WorkerClient):
    """``replicas`` (one per ``pipeline.replicas``) against ``nodes``: the own pool's nodes,
    then attached (borrowed) ones, in one list the executor shares."""

    def __init__(self, replicas: list[ComputeReplica], nodes: list[NodeClient],
                 pipeline: PipelineConfig, timeline: Timeline | None = None):
        self.replicas = replicas
        self.nodes = list(nodes)
        self.executor = PipelineExecutor(self.replicas, self.nodes, pipeline, timeline)
        self._execute_s = 0.0

    @property
    def max_in_flight(self) -> int:
        return self.executor.max_in_flight

    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        start = time.perf_counter()
        try:
            self.executor.submit(slot, plan, routes, req_ids, params)
        finally:
            self._execute_s += time.perf_counter() - start

    def wait(self) -> list[tuple[int, list[int]]]:
        start = time.perf_counter()
        try:
            return self.executor.wait()
        finally:
            self._execute_s += time.perf_counter() - start

    def reset(self) -> None:
        self.executor.reset()

    def free(self, req_ids: list[int], release: list[int]) -> None:
        for r in release:
            self.replicas[0].release(r)  # the replicas share one sampler
        if req_ids:
            for node in self.nodes:
                node.free(req_ids)

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]

    def attach(self, client: NodeClient) -> int:
        self.nodes.append(client)  # the executor shares this list
        return len(self.nodes) - 1

    def times(self) -> WorkerTimes:
        e = self.executor.times
        return WorkerTimes(e.steps, self._execute_s, e.wait_s)
