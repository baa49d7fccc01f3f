"""A micro-batch as the replicas of one process see it, and the port a replica core
(:class:`~lamina.computenode.runner.SliceRunner`) emits through: the seam between the core and
its driver (:class:`~lamina.computenode.server.ReplicaServer` in a replica process,
:class:`~lamina.instance.inproc.InProcessReplicas` in the engine's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from lamina.computenode.polling import Prelaunched
from lamina.types import (AttendMsg, AttendResult, NativeExchange, NodeRoute, PrepareMsg,
                          SamplingParams, StepPlan)

__all__ = ["MicroBatch", "Port", "Span"]


@dataclass
class MicroBatch:
    """A micro-batch as the replicas of one process see it. ``k`` is the next slice to run here
    once ``values`` (its context) and layer ``k-1``'s results (``parts`` ATTENDs per route)
    are in; ``uniforms`` are the engine's sampling draws (None: the replica's sampler draws)."""

    plan: StepPlan
    routes: list[NodeRoute]
    req_ids: list[int]
    params: list[SamplingParams]
    uniforms: torch.Tensor | None = None
    k: int = -1
    values: dict[str, torch.Tensor] | None = None
    parts: list[int] = field(default_factory=list)
    results: dict[int, list[list[AttendResult]]] = field(default_factory=dict)  # layer -> route
    ahead: Prelaunched | None = None  # slice k, enqueued before layer k-1's results (polling)
    sent: int = -1  # order in which layer k-1's ATTENDs went out (-1: none outstanding here)
    sent_ns: int = 0  # when they were out (time.perf_counter_ns)
    received_ns: int = 0  # when the latest RESULT came in

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    @property
    def slot(self) -> int:
        return self.plan.micro_batch


class Port(Protocol):
    """Where a runner's output goes (the driver's channels or in-process clients). A call
    that cannot deliver raises; the runner lets it propagate."""

    def to_node(self, node: int, msg: PrepareMsg | AttendMsg) -> None: ...

    def to_next(self, mb: MicroBatch, values: dict[str, torch.Tensor], parts: list[int]) -> None: ...

    def to_engine(self, mb: MicroBatch, tokens: list[int]) -> None: ...

    def native_exchange(self, node: int, reply_to: int) -> NativeExchange | None:
        """Node ``node``'s ATTEND (RESULTs to peer ``reply_to``) as C++ in this process calls
        it (a whole step of a lone micro-batch then runs in one call:
        :meth:`ComputeReplica.run_step`), or None."""

    def collect(self, node: int, step_id: int, layer: int) -> AttendResult | None:
        """The RESULT of an ATTEND a native exchange sent but did not take, waited for here as
        :meth:`exchange` waits; None where it comes the usual way
        (:meth:`SliceRunner.on_result`)."""

    def exchange(self, node: int, msg: AttendMsg) -> tuple[int, AttendResult | None]:
        """Send ``msg`` to node ``node`` (as :meth:`to_node`) and wait right here for its
        RESULT, for a runner with nothing else to do: ``(sent_ns, the RESULT)``, or ``(sent_ns,
        None)`` where the port cannot wait (the RESULT then comes the usual way,
        :meth:`SliceRunner.on_result`). ``sent_ns``: ``time.perf_counter_ns()`` once sent."""

    def failed(self, mb: MicroBatch, error: Exception) -> None:
        """``mb`` failed here (a slice or the sampler raised); the runner has dropped it."""


# role, track, name, start, end, micro-batch (a memory span's: the layer's sent_ns, received_ns)
Span = Callable[[str, int, str, int, int, MicroBatch], None]
