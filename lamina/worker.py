"""ReplicaWorker: a compute replica together with its connections to the memory nodes.

It executes one step given by the engine (DESIGN.md §3 steps 2-5): PREPARE to the nodes named
in the routes, the slices with each layer's attention fanned out to the nodes and merged, and
sampling. The engine talks to a worker in this process (:class:`LocalWorker`) or in a Ray actor
(:mod:`lamina.cluster`) through the same three calls.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lamina.computenode.replica import ComputeReplica
from lamina.pool import NodeClient
from lamina.routing import NodeRoute, attend_messages, merge_results
from lamina.types import NodeStats, PrepareMsg, SamplingParams, StepPlan


@dataclass
class WorkerTimes:
    """Cumulative wall time of one replica's steps, in seconds: ``execute_s`` whole steps,
    ``wait_s`` the part spent waiting on memory nodes (first ATTEND sent .. last RESULT in,
    summed over layers). ``execute_s - wait_s`` is the replica's own work (slices, sampling)."""

    steps: int = 0
    execute_s: float = 0.0
    wait_s: float = 0.0


class WorkerClient(ABC):
    """The engine's view of one compute replica."""

    @abstractmethod
    def execute(self, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                params: list[SamplingParams]) -> list[int]:
        """Run the step; one sampled token per ``plan.sample_rows`` entry."""

    @abstractmethod
    def free(self, req_ids: list[int], release: list[int]) -> None:
        """Free requests' KV on every memory node; drop ``release``'s sampler state."""

    @abstractmethod
    def stats(self) -> list[NodeStats]:
        """STATS of every memory node."""

    def times(self) -> WorkerTimes | None:
        """Step timings, where the replica runs in this process; None otherwise."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        pass


class ReplicaWorker:
    def __init__(self, replica: ComputeReplica, nodes: list[NodeClient]):
        self.replica = replica
        self.nodes = nodes
        self.times = WorkerTimes()

    def execute(self, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                params: list[SamplingParams]) -> list[int]:
        times, start = self.times, time.perf_counter()
        for route in routes:
            self.nodes[route.node].prepare(PrepareMsg(plan.step_id, route.works))
        step_id, T = plan.step_id, plan.num_tokens

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            msgs = attend_messages(step_id, layer, routes, q, k, v)
            t = time.perf_counter()
            for route, msg in zip(routes, msgs):
                self.nodes[route.node].send_attend(msg)
            results = [self.nodes[route.node].recv_attend() for route in routes]
            times.wait_s += time.perf_counter() - t
            return merge_results(routes, results, T).to(q.device)

        tokens = self.replica.execute(plan, attend, req_ids, params).tolist()
        times.steps += 1
        times.execute_s += time.perf_counter() - start
        return tokens

    def free(self, req_ids: list[int], release: list[int]) -> None:
        for r in release:
            self.replica.release(r)
        if req_ids:
            for node in self.nodes:
                node.free(req_ids)

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]


class LocalWorker(WorkerClient):
    """A ReplicaWorker in this process: plain calls."""

    def __init__(self, worker: ReplicaWorker):
        self.worker = worker

    def execute(self, plan, routes, req_ids, params) -> list[int]:
        return self.worker.execute(plan, routes, req_ids, params)

    def free(self, req_ids: list[int], release: list[int]) -> None:
        self.worker.free(req_ids, release)

    def stats(self) -> list[NodeStats]:
        return self.worker.stats()

    def times(self) -> WorkerTimes:
        return self.worker.times
