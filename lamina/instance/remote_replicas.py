"""The engine's worker for compute replicas out of its process (placements ``procs`` and
``ray``): :class:`RemoteReplicas` runs staggered pipelining across replica servers
(:mod:`lamina.computenode.server`) started by :mod:`lamina.instance.procs`.

Wiring of ``N`` replicas (each loads and splits the model itself): every memory node opens one
peer channel per replica (OPEN on the node's primary channel; the replica joins it with
CONNECT); every replica opens a channel for its predecessor's contexts (a ring; none when
``N == 1``). Each link is shm when both ends share a host, else tcp (:func:`link_kind`).

Per micro-batch: the engine draws its sampling uniforms (so seeded requests sample the same
whichever replica samples them), sends the STEP to every replica that runs one of its slices,
and receives TOKENS from the replica that runs the last one. Between slices, contexts go from
replica to replica and attention results from the nodes straight to the next replica: nothing
of the hot path passes through the engine. FREE goes from the engine to the nodes and is
waited for, so no replica reuses slots a node has not freed yet. Borrowing attaches another
instance's node: each replica joins a new peer channel of it (:meth:`RemoteReplicas.attach`).
A dead node's place goes to its restarted successor (:meth:`RemoteReplicas.replace_node`), a
dead replica is started again in its own (:meth:`RemoteReplicas.replace_replica`).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

from lamina.config import PipelineConfig
from lamina.computenode.sampling import Sampler
from lamina.computenode.schedule import replica_for
from lamina.computenode.replica_config import ReplicaConfig
from lamina.computenode.server import serve_replica
from lamina.device import Device
from lamina.engine.worker import WorkerClient, WorkerTimes
from lamina.errors import NodeFailure
from lamina.instance.launcher import Launcher
from lamina.instance.procs import spawn_roles, stop_roles
from lamina.timeline import Timeline
from lamina.transport import codec
from lamina.transport.base import REPLY_TIMEOUT_S, ChannelClosed, PeerDied
from lamina.transport.endpoint import SPIN_US, link_kind
from lamina.transport.node_client import RemoteNode
from lamina.transport.step_codec import parse_tokens, step_message
from lamina.transport.wire import Message, MsgKind
from lamina.types import NodeStats, SamplingParams, StepPlan

CONTROL_STEP = -1  # step id of control requests sent while steps are in flight


@dataclass
class _Ended:
    """What a reader thread files when its link to a replica ends."""

    channel: Any
    error: BaseException


class RemoteReplicas(WorkerClient):
    """``config.replicas`` compute-replica servers started by ``launcher``, wired to ``nodes``
    (the engine's clients of memory-node servers, owned by the caller) and to each other.
    ``replica`` is the template of every replica's :class:`ReplicaConfig` (model, dtype,
    threads, peer base); replica ``i`` runs on ``devices[i]`` (pinned to its cores) and its
    receivers poll ``spin_us[i]`` before sleeping (its main thread ``idle_spin_us[i]``);
    :meth:`close` stops the replicas."""

    def __init__(self, launcher: Launcher, replica: ReplicaConfig,
                 nodes: list[RemoteNode] | Callable[[], list[RemoteNode]],
                 config: PipelineConfig, devices: list[Device], *, num_slices: int,
                 transport: str = "auto", timeline: Timeline | None = None,
                 spin_us: list[float] | None = None, idle_spin_us: list[float] | None = None):
        self.config = config
        self.micro_batches = config.micro_batches
        self.nodes: list[RemoteNode] = []  # own pool's nodes, then attached (borrowed) ones
        self.num_slices = num_slices
        self.timeline = timeline
        self.transport = transport
        self.peer_base = replica.peer_base
        self.sampler = Sampler()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # C-level put/get: on the hot path
        self.held: deque = deque()  # (replica, message) read by _request for wait()
        self.pending: dict[int, int] = {}  # step id -> slot
        self.max_in_flight = 0  # most micro-batches in flight at once so far
        self.dead: dict[int, NodeFailure] = {}  # replicas found gone (their reader ended)
        self._times = WorkerTimes()
        configs = [asdict(ReplicaConfig(**{**asdict(replica), "index": i,
                                           "replicas": config.replicas,
                                           "schedule": config.schedule,
                                           "attn_parts": config.attn_parts,
                                           "trace": timeline is not None,
                                           "device": d.torch,
                                           "cores": list(d.cores) if d.cores else None,
                                           "spin_us": spin_us[i] if spin_us else SPIN_US,
                                           "idle_spin_us": (idle_spin_us[i] if idle_spin_us
                                                            else SPIN_US)}))
                   for i, d in enumerate(devices)]
        self._spawn = lambda first, count: spawn_roles(  # all replicas, or one to restart
            launcher, serve_replica, configs[first:first + count], role="compute",
            device=replica.device, transport=transport, first=first)
        starting = self._spawn(0, len(configs))
        try:  # the nodes (when still starting: side by side with the replicas), then these
            self.nodes = list(nodes() if callable(nodes) else nodes)
            self.procs, self.channels = starting.ready()
        except BaseException:
            starting.stop()
            raise
        try:
            self._wire()
        except BaseException:
            self.close()
            raise
        for i, ch in enumerate(self.channels):
            threading.Thread(target=self._read, args=(i, ch), daemon=True).start()

    def replace_replica(self, i: int) -> None:
        """Replica ``i`` died: start it again with its index (it reads the split and packs its
        weights as at start-up), join it to every node on a new peer channel (which replaces
        the dead one's) and, with several replicas, into the ring of contexts. The nodes keep
        every request's KV; the micro-batches it had in flight were reset and cancelled."""
        procs, channels = self._spawn(i, 1).ready()
        old = (self.procs[i], self.channels[i])
        self.procs[i], self.channels[i] = procs[0], channels[0]
        self.dead.pop(i, None)
        stop_roles([old[0]], [old[1]])
        n = self.config.replicas
        nxt = None
        if n > 1:  # i joins the channel its next replica opens; its previous joins i's
            j, p = (i + 1) % n, (i - 1) % n
            nxt = self._request(j, self._open_for(j, i)).meta["endpoint"]
            prev = self._call(i, self._open_for(i, p)).meta["endpoint"]
            self._request(p, Message(MsgKind.CONNECT, CONTROL_STEP,
                                     meta={"nodes": [], "next": prev}))
        nodes = [self._peer_endpoint(node, i) for node in self.nodes]
        self._call(i, Message(MsgKind.CONNECT, meta={"nodes": nodes, "next": nxt}))
        threading.Thread(target=self._read, args=(i, self.channels[i]), daemon=True).start()

    def _open_for(self, opener: int, joiner: int) -> Message:
        """OPEN on replica ``opener`` of a context channel that replica ``joiner`` joins."""
        link = link_kind(self.transport, self.procs[opener].where, self.procs[joiner].where)
        return Message(MsgKind.OPEN, CONTROL_STEP, meta={"kind": link[0], "host": link[1]})

    # -- set-up ---------------------------------------------------------------------------------
    def _call(self, i: int, msg: Message, timeout: float = REPLY_TIMEOUT_S) -> Message:
        try:
            self.channels[i].send(msg)
            return codec.raise_if_error(self.channels[i].recv(timeout))
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise self._dead(i, e) from e

    def _request(self, i: int, msg: Message) -> Message:
        """A control request once the readers run (micro-batches may be in flight): the reply
        is the next message of replica ``i`` tagged ``CONTROL_STEP``; whatever else arrives
        meanwhile is held for :meth:`wait`."""
        try:
            self.channels[i].send(msg)
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise self._dead(i, e) from e
        while True:
            try:
                j, reply = self.inbox.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise self._dead(i, TimeoutError(f"no reply in {REPLY_TIMEOUT_S:.0f} s")) from None
            if isinstance(reply, _Ended):
                if (e := self._ended(j, reply)) is not None:
                    if j == i:
                        raise self._dead(i, e)
                    self.dead[j] = self._dead(j, e)
                continue
            if j == i and reply.step_id == CONTROL_STEP:
                return codec.raise_if_error(reply)
            self.held.append((j, reply))

    def _dead(self, i: int, e: BaseException) -> NodeFailure:
        code = getattr(self.procs[i], "exitcode", None)
        return NodeFailure(f"compute replica {i} (pid {self.procs[i].pid}) is gone"
                           + (f", exit code {code}" if code is not None else "") + f": {e}")

    def _wire(self) -> None:
        n = self.config.replicas
        nexts = [None] * n
        if n > 1:
            for i in range(n):
                j = (i + 1) % n  # opens the channel that i joins
                nexts[i] = self._call(j, self._open_for(j, i)).meta["endpoint"]
        for i in range(n):
            nodes = [self._peer_endpoint(node, i) for node in self.nodes]
            self._call(i, Message(MsgKind.CONNECT, meta={"nodes": nodes, "next": nexts[i]}))

    def _peer_endpoint(self, node: RemoteNode, i: int) -> dict:
        """A new peer channel of ``node`` for replica ``i`` to join."""
        kind, host = link_kind(self.transport, node.process.where, self.procs[i].where)
        return node.open_peer(self.peer_base + i, kind, host)

    def replace_node(self, k: int, client: RemoteNode) -> None:
        """Node ``k`` died and ``client`` is the engine's client of the empty node restarted in
        its place: every replica joins a new peer channel of it instead (after :meth:`reset`)."""
        for i in range(self.config.replicas):
            ep = self._peer_endpoint(client, i)
            self._request(i, Message(MsgKind.CONNECT, CONTROL_STEP,
                                     meta={"nodes": [ep], "next": None, "at": k}))
        self.nodes[k] = client

    def dead_replicas(self) -> list[int]:
        """Replicas whose process (or actor) is gone."""
        return [i for i, p in enumerate(self.procs) if i in self.dead or not p.is_alive()]

    def attach(self, client: RemoteNode) -> int:
        """Borrowing: another instance's node (its engine-side client, in this process) joins
        every replica's nodes; returns its index in routes. Called between steps."""
        for i in range(self.config.replicas):
            ep = self._peer_endpoint(client, i)
            self._request(i, Message(MsgKind.CONNECT, CONTROL_STEP, meta={"nodes": [ep],
                                                                          "next": None}))
        self.nodes.append(client)
        return len(self.nodes) - 1

    def _read(self, i: int, ch) -> None:
        try:
            while True:
                self.inbox.put((i, ch.recv()))
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.inbox.put((i, _Ended(ch, e)))

    def _ended(self, i: int, item: Any) -> BaseException | None:
        """The error that ended replica ``i``'s current link, if ``item`` says so (an end of
        a replaced replica's link is no news: None)."""
        if isinstance(item, _Ended) and self.channels[i] is item.channel:
            return item.error
        return None

    # -- WorkerClient ----------------------------------------------------------------------------
    def submit(self, slot: int, plan: StepPlan, routes, req_ids: list[int],
               params: list[SamplingParams]) -> None:
        if not 0 <= slot < self.micro_batches or slot in self.pending.values():
            raise ValueError(f"micro-batch slot {slot} is busy or out of range")
        if plan.micro_batch != slot:
            raise ValueError(f"plan of micro-batch {plan.micro_batch} submitted to slot {slot}")
        msg = step_message(plan, routes, req_ids, params,
                           self.sampler.draw(req_ids, params, plan.sampled_positions()))
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
                i, msg = self.held.popleft() if self.held else self.inbox.get(
                    timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise NodeFailure(f"no compute replica answered in {REPLY_TIMEOUT_S:.0f} s") from None
            if isinstance(msg, _Ended):
                if (e := self._ended(i, msg)) is not None:
                    self.dead[i] = self._dead(i, e)
                continue
            if msg.step_id not in self.pending:
                continue
            slot = self.pending.pop(msg.step_id)
            elapsed = time.perf_counter() - start
            self._times.wait_s += elapsed
            self._times.execute_s += elapsed  # the engine's time in this worker
            codec.raise_if_error(msg)
            self._times.steps += 1
            self._record(msg.meta.get("spans", []))
            return [(slot, parse_tokens(msg))]
        return []

    def reset(self) -> None:
        """Forget the micro-batches in flight, here and on every replica (RESET; the replicas
        then drop late messages of those steps). Their steps stay prepared on the memory nodes,
        as after a reset of the in-process replicas."""
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
        """FREE on every node, also past one that is gone (whose failure is raised after: the
        others must not keep the KV)."""
        for r in release:
            self.sampler.release(r)
        failure = None
        for node in self.nodes if req_ids else []:
            try:
                node.free(req_ids, wait=True)
            except NodeFailure as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def stats(self) -> list[NodeStats]:
        return [n.stats() for n in self.nodes]

    def close(self) -> None:
        stop_roles(self.procs, self.channels)
        self.procs, self.channels = [], []

    def _record(self, spans: list) -> None:
        if self.timeline is None:
            return
        for role, track, name, start, end, slot, step in spans:
            self.timeline.add(role, int(track), name, start, end, micro_batch=slot, step=step)
