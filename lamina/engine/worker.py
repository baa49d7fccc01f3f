"""ReplicaWorker: a compute replica together with its connections to the memory nodes.

It executes steps given by the engine (DESIGN.md §3 steps 2-5): PREPARE to the nodes named
in the routes, the slices with each layer's attention fanned out to the nodes and merged, and
sampling; with pipelining, several micro-batches at once (:mod:`lamina.computenode.executor`). The engine
talks to replicas in this process (:class:`LocalWorker`) or out of it (:class:`lamina.instance.procs.RemoteReplicas`)
through the same calls.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from lamina.computenode.replica import ComputeReplica
from lamina.computenode.executor import PipelineConfig, PipelineExecutor
from lamina.transport.node_client import NodeClient
from lamina.computenode.attend import NodeRoute
from lamina.timeline import Timeline
from lamina.types import NodeStats, SamplingParams, StepPlan


@dataclass
class WorkerTimes:
    """Cumulative wall time of one replica worker, in seconds: ``execute_s`` inside
    submit/wait, ``wait_s`` the part spent blocked on memory nodes (summed over layers).
    ``execute_s - wait_s`` is the replicas' own work (slices, sending, sampling)."""

    steps: int = 0
    execute_s: float = 0.0
    wait_s: float = 0.0


class WorkerClient(ABC):
    """The engine's view of the compute replicas. ``micro_batches`` may be in flight at once:
    ``submit`` one into a free slot, ``wait`` until at least one finishes. A worker without
    pipelining (one slot) gets both from ``execute``."""

    micro_batches: int = 1

    @abstractmethod
    def execute(self, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                params: list[SamplingParams]) -> list[int]:
        """Run the step; one sampled token per ``plan.sample_rows`` entry."""

    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        if slot != 0 or getattr(self, "_pending", None) is not None:
            raise ValueError(f"this worker runs one micro-batch at a time (slot {slot})")
        self._pending = (plan, routes, req_ids, params)

    def wait(self) -> list[tuple[int, list[int]]]:
        """Finished micro-batches as ``[(slot, tokens)]`` (at least one while any is in flight)."""
        pending, self._pending = getattr(self, "_pending", None), None
        return [] if pending is None else [(0, self.execute(*pending))]

    def reset(self) -> None:
        """Drop every micro-batch in flight (after an error)."""
        self._pending = None

    @abstractmethod
    def free(self, req_ids: list[int], release: list[int]) -> None:
        """Free requests' KV on every memory node; drop ``release``'s sampler state."""

    @abstractmethod
    def stats(self) -> list[NodeStats]:
        """STATS of every memory node."""

    @abstractmethod
    def attach(self, client: NodeClient) -> int:
        """Add another pool's node (borrowing); returns its index for routes."""

    @abstractmethod
    def times(self) -> WorkerTimes:
        """Cumulative step timings (see :class:`WorkerTimes`)."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class ReplicaWorker:
    """Compute replicas (one or more, sharing one Sampler) with their memory-node connections,
    driven by a :class:`~lamina.computenode.executor.PipelineExecutor`."""

    def __init__(self, replica: ComputeReplica | list[ComputeReplica], nodes: list[NodeClient],
                 pipeline: PipelineConfig | None = None, timeline: Timeline | None = None):
        self.replicas = replica if isinstance(replica, list) else [replica]
        self.replica = self.replicas[0]
        self.nodes = list(nodes)  # own pool's nodes, then attached (borrowed) ones
        self.executor = PipelineExecutor(self.replicas, self.nodes, pipeline, timeline)
        self._times = WorkerTimes()

    @property
    def times(self) -> WorkerTimes:
        t, e = self._times, self.executor.times
        t.steps, t.wait_s = e.steps, e.wait_s
        return t

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._times.execute_s += time.perf_counter() - start

    def execute(self, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                params: list[SamplingParams]) -> list[int]:
        return self._timed(self.executor.execute, plan, routes, req_ids, params)

    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        self._timed(self.executor.submit, slot, plan, routes, req_ids, params)

    def wait(self) -> list[tuple[int, list[int]]]:
        return self._timed(self.executor.wait)

    def free(self, req_ids: list[int], release: list[int]) -> None:
        for r in release:
            self.replica.release(r)
        if req_ids:
            for node in self.nodes:
                node.free(req_ids)

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]

    def attach(self, client: NodeClient) -> int:
        self.nodes.append(client)  # the executor shares this list
        return len(self.nodes) - 1


class LocalWorker(WorkerClient):
    """A ReplicaWorker in this process: plain calls."""

    def __init__(self, worker: ReplicaWorker):
        self.worker = worker
        self.micro_batches = worker.executor.config.micro_batches

    def execute(self, plan, routes, req_ids, params) -> list[int]:
        return self.worker.execute(plan, routes, req_ids, params)

    def submit(self, slot, plan, routes, req_ids, params) -> None:
        self.worker.submit(slot, plan, routes, req_ids, params)

    def wait(self) -> list[tuple[int, list[int]]]:
        return self.worker.wait()

    def reset(self) -> None:
        self.worker.executor.reset()

    def free(self, req_ids: list[int], release: list[int]) -> None:
        self.worker.free(req_ids, release)

    def stats(self) -> list[NodeStats]:
        return self.worker.stats()

    def attach(self, client: NodeClient) -> int:
        return self.worker.attach(client)

    def times(self) -> WorkerTimes:
        return self.worker.times
