"""Compute replicas as separate processes, running staggered pipelining between them (DESIGN.md
§6): the engine's :class:`ProcessReplicas` worker. The replica side is
:mod:`lamina.computenode.server`.

Wiring, done once at start: the engine starts ``N`` replica processes (each loads and splits the
model itself) with a control channel each; every memory node opens one channel per replica
(OPEN on the node's engine channel, the replica attaches it); every replica opens a channel for
its predecessor's contexts and the predecessor attaches it (a ring; none when ``N == 1``).

Per micro-batch: the engine draws its sampling uniforms (so seeded requests sample the same
whichever replica samples them), sends the STEP to every replica that runs one of its slices,
and receives TOKENS from the replica that runs the last one. Between slices, contexts go from
replica to replica and attention results from the nodes straight to the next replica: nothing
of the hot path passes through the engine. FREE goes from the engine to the nodes and is
waited for, so no replica reuses slots a node has not freed yet.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict

from lamina.computenode.sampling import Sampler
from lamina.computenode.server import READER_SPIN_US, RING_BYTES, ReplicaConfig, serve_replica
from lamina.launcher import Launcher, MultiprocessingLauncher, stop_process
from lamina.pipeline import PipelineConfig
from lamina.pool import NodeFailure
from lamina.remote import START_TIMEOUT_S, RemoteNode
from lamina.simulator import replica_for
from lamina.step_codec import parse_tokens, step_message
from lamina.timeline import Timeline
from lamina.transport import codec
from lamina.transport.base import ChannelClosed, PeerDied
from lamina.transport.shm import ShmChannel
from lamina.transport.wire import Message, MsgKind
from lamina.types import NodeStats, SamplingParams, StepPlan
from lamina.worker import WorkerClient, WorkerTimes

REPLY_TIMEOUT_S = 600.0


class ProcessReplicas(WorkerClient):
    """``config.replicas`` compute replica processes on this host, wired to ``nodes`` (memory
    nodes in other processes, owned by the caller) and to each other. Owns the processes:
    :meth:`close` stops them."""

    def __init__(self, model: str, nodes: list[RemoteNode], config: PipelineConfig, *,
                 num_slices: int, device: str = "cpu", dtype: str | None = None,
                 timeline: Timeline | None = None, launcher: Launcher | None = None,
                 num_threads: int = 1):
        if not all(isinstance(n, RemoteNode) for n in nodes):
            raise ValueError("compute replicas in processes need memory nodes in processes "
                             "(transport='shm')")
        self.config = config
        self.micro_batches = config.micro_batches
        self.nodes = nodes
        self.num_slices = num_slices
        self.timeline = timeline
        self.sampler = Sampler()
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[int, int] = {}  # step id -> slot
        self.max_in_flight = 0  # most micro-batches in flight at once so far
        self.dead: dict[int, NodeFailure] = {}  # replicas found gone (their reader ended)
        self._times = WorkerTimes()
        self.channels: list[ShmChannel] = []
        self.procs = []
        launcher = launcher or MultiprocessingLauncher()
        try:
            for i in range(config.replicas):
                cfg = ReplicaConfig(model, device, dtype, i, config.replicas, config.schedule,
                                    config.attn_parts, num_threads, timeline is not None)
                ch = ShmChannel.create(capacity=RING_BYTES)
                proc = launcher.start(serve_replica, (ch.spec.to_dict(), asdict(cfg)),
                                      name=f"lamina-compute-{i}")
                ch.set_peer_alive(proc.is_alive)
                self.channels.append(ch)
                self.procs.append(proc)
            for i in range(config.replicas):
                self._call(i, codec.ping(), START_TIMEOUT_S)
            self._wire()
        except BaseException:
            self.close()
            raise
        for i, ch in enumerate(self.channels):
            threading.Thread(target=self._read, args=(i, ch), daemon=True).start()

    # -- set-up ---------------------------------------------------------------------------------
    def _call(self, i: int, msg: Message, timeout: float = REPLY_TIMEOUT_S) -> Message:
        try:
            self.channels[i].send(msg)
            return codec.raise_if_error(self.channels[i].recv(timeout))
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise self._dead(i, e) from e

    def _dead(self, i: int, e: BaseException) -> NodeFailure:
        code = getattr(self.procs[i], "exitcode", None)
        return NodeFailure(f"compute replica {i} (pid {self.procs[i].pid}) is gone"
                           + (f", exit code {code}" if code is not None else "") + f": {e}")

    def _wire(self) -> None:
        n = self.config.replicas
        nexts = [None] * n
        if n > 1:
            for i in range(n):
                ep = self._call((i + 1) % n, Message(MsgKind.OPEN)).meta["endpoint"]
                nexts[i] = ep
        for i in range(n):
            nodes = [node.open_peer(i) for node in self.nodes]
            self._call(i, Message(MsgKind.CONNECT, meta={"nodes": nodes, "next": nexts[i]}))

    def _read(self, i: int, ch: ShmChannel) -> None:
        try:
            while True:
                self.inbox.put((i, ch.recv()))
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.inbox.put((i, e))

    # -- WorkerClient ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan, routes, req_ids, params) -> list[int]:
        self.submit(plan.micro_batch, plan, routes, req_ids, params)
        return self.wait()[0][1]

    def submit(self, slot: int, plan: StepPlan, routes, req_ids: list[int],
               params: list[SamplingParams]) -> None:
        if not 0 <= slot < self.micro_batches or slot in self.pending.values():
            raise ValueError(f"micro-batch slot {slot} is busy or out of range")
        if plan.micro_batch != slot:
            raise ValueError(f"plan of micro-batch {plan.micro_batch} submitted to slot {slot}")
        msg = step_message(plan, routes, req_ids, params, self.sampler.draw(req_ids, params))
        if self.dead:
            raise next(iter(self.dead.values()))
        n = self.config.replicas
        runs = {replica_for(self.config.schedule, slot, k, n) for k in range(self.num_slices)}
        for i in sorted(runs):
            try:
                self.channels[i].send(msg)
            except (PeerDied, ChannelClosed, TimeoutError) as e:
                raise self._dead(i, e) from e
        self.pending[plan.step_id] = slot
        self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def wait(self) -> list[tuple[int, list[int]]]:
        """The next micro-batch to finish: ``[(slot, tokens)]``. A replica's ERROR for a step
        in flight (or a replica that died) raises; answers for steps no longer in flight (a
        duplicate error, a step dropped by :meth:`reset`) are skipped."""
        start = time.perf_counter()
        while self.pending:
            if self.dead:
                raise next(iter(self.dead.values()))
            try:
                i, msg = self.inbox.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise NodeFailure(f"no compute replica answered in {REPLY_TIMEOUT_S:.0f} s") from None
            if isinstance(msg, BaseException):
                self.dead[i] = self._dead(i, msg)
                continue
            if msg.step_id not in self.pending:
                continue
            slot = self.pending.pop(msg.step_id)
            self._times.wait_s += time.perf_counter() - start
            codec.raise_if_error(msg)
            self._times.steps += 1
            self._record(msg.meta.get("spans", []))
            return [(slot, parse_tokens(msg))]
        return []

    def reset(self) -> None:
        """Forget the micro-batches in flight, here and on every replica (RESET; the replicas
        then drop late messages of those steps). Their steps stay prepared on the memory nodes,
        as after a reset of the in-process executor."""
        self.pending.clear()
        for i, ch in enumerate(self.channels):
            if i not in self.dead:
                try:
                    ch.send(Message(MsgKind.RESET))
                except (PeerDied, ChannelClosed, TimeoutError) as e:
                    self.dead[i] = self._dead(i, e)

    def times(self) -> WorkerTimes:
        """``steps`` finished micro-batches; ``wait_s`` the engine's time blocked on them (the
        replicas' own times are in the timeline, with ``trace``)."""
        return self._times

    def free(self, req_ids: list[int], release: list[int]) -> None:
        for r in release:
            self.sampler.release(r)
        if req_ids:
            for node in self.nodes:
                node.free(req_ids, wait=True)

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]

    def close(self) -> None:
        for ch, proc in zip(self.channels, self.procs):
            if proc.is_alive() and not ch.closed:
                try:
                    ch.send(codec.shutdown())
                except Exception:
                    pass
        for proc in self.procs:
            stop_process(proc)
        for ch in self.channels:
            ch.close()
        self.procs, self.channels = [], []

    def _record(self, spans: list) -> None:
        if self.timeline is None:
            return
        for role, track, name, start, end, slot, step in spans:
            self.timeline.add(role, int(track), name, start, end, micro_batch=slot, step=step)
