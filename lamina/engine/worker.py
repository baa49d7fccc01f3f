"""The engine's view of its compute replicas (:class:`WorkerClient`), whatever the placement:
:class:`lamina.instance.inproc.InProcessReplicas` runs them in the engine's process,
:class:`lamina.instance.remote_replicas.RemoteReplicas` drives replica servers out of it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from lamina.transport.node_client import NodeClient
from lamina.types import NodeRoute, NodeStats, SamplingParams, StepPlan


@dataclass
class WorkerTimes:
    """Cumulative wall time of one replica worker, in seconds: ``execute_s`` inside
    submit/wait, ``wait_s`` the part spent blocked on memory nodes (summed over layers).
    ``execute_s - wait_s`` is the replicas' own work (slices, sending, sampling)."""

    steps: int = 0
    execute_s: float = 0.0
    wait_s: float = 0.0


class WorkerClient(ABC):
    """Micro-batches in flight on the compute replicas: ``submit`` one into a free slot (the
    engine has as many slots as its pipeline config says), ``wait`` until at least one
    finishes, ``reset`` after an error. ``max_in_flight``: the most in flight at once so far."""

    max_in_flight: int = 0
    nodes: list[NodeClient]  # the memory nodes' clients, in route order (own, then borrowed)

    @abstractmethod
    def submit(self, slot: int, plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
               params: list[SamplingParams]) -> None:
        """Start micro-batch ``slot``: one sampled token per ``plan.sample_rows`` entry."""

    @abstractmethod
    def wait(self) -> list[tuple[int, list[int]]]:
        """Finished micro-batches as ``[(slot, tokens)]`` (at least one while any is in flight)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every micro-batch in flight (after an error)."""

    @abstractmethod
    def free(self, req_ids: list[int], release: list[int]) -> None:
        """Free requests' KV on every memory node; drop ``release``'s sampler state."""

    @abstractmethod
    def stats(self) -> list[NodeStats]:
        """STATS of every memory node."""

    def dead_replicas(self) -> list[int]:
        """Replicas whose process is gone (in the engine's process: none)."""
        return []

    def replace_replica(self, i: int) -> None:
        """Start dead replica ``i`` again in its place (replicas out of the engine's process)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart a replica alone")

    def cancel(self, step_ids: list[int]) -> None:
        """Roll back steps dropped in flight on every memory node (``nodes``), and have the
        nodes refuse their PREPAREs from now on."""
        for node in self.nodes:
            node.cancel(step_ids)

    @abstractmethod
    def attach(self, client: NodeClient) -> int:
        """Add another pool's node (borrowing); returns its index for routes."""

    @abstractmethod
    def times(self) -> WorkerTimes:
        """Cumulative step timings (see :class:`WorkerTimes`)."""

    def close(self) -> None:  # noqa: B027 - optional
        pass
