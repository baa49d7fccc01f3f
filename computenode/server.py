"""A compute replica in its own process or Ray actor, one of ``N`` that run a micro-batch
schedule together (staggered pipelining); the engine side is ``instance.remote_replicas.RemoteReplicas``.

Channels of replica ``i`` (shm on one host, tcp across hosts; wire protocol, no pickle):

* **control**, from the engine: PING, OPEN, CONNECT and SHUTDOWN get one reply each; a STEP (a
  micro-batch's plan, routes and sampling uniforms, sent to every replica that runs one of its
  slices) gets none: the replica that runs the last slice answers with TOKENS (or ERROR) for
  that step, on its own control channel.
* **nodes**: one channel to every memory node (opened by the node, joined here; CONNECT adds
  nodes in the engine's node order, borrowed ones included). Replica ``replica_for(j, 0)``
  sends micro-batch j's PREPARE; whoever runs slice k sends layer k's ATTENDs with ``reply_to``
  the peer id of replica ``replica_for(j, k+1)`` (``peer_base`` + its index: unique across
  instances that share a node), so the nodes' RESULTs arrive straight at that replica.
* **prev / next**: a micro-batch's context moves to the next replica as a CONTEXT message while
  its attention runs (``layer``: the slice it feeds; meta: value names, ATTEND parts per node).

The main thread receives on the engine's and the nodes' links itself where they are shm rings
(one native wait over those rings and the inbox, :class:`~lamina.computenode.inbox.Inbox`: a
RESULT wakes the thread that merges it); every other inbound channel has a reader thread that
puts messages into the inbox. The main thread files each message under its step and runs every
slice whose context and attention results have arrived (oldest micro-batch first). A failing
node or peer fails every micro-batch in flight with an ERROR to the engine, which decides the
rest. With ``device_polling`` (:mod:`lamina.computenode.polling`), a micro-batch that stays here
has its next slice pre-launched once its ATTENDs are sent, behind a device flag its results move.
With ``step_graph_tokens`` (graphs and polling together), a micro-batch whose slices all run
here takes its whole decode step as one graph launch, over a step mailbox every node serves
(:mod:`lamina.computenode.remote_steps`; joined at CONNECT).
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from lamina import stages
from lamina.computenode.inbox import WAKE_S, Inbox
from lamina.computenode.polling import eager_module_loading, make_polling
from lamina.computenode.remote_steps import MAILBOX_STEP, RemoteSteps
from lamina.computenode.gguf_linear import blocks_for
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.replica_config import ReplicaConfig
from lamina.computenode.microbatch import MicroBatch
from lamina.computenode.runner import SliceRunner
from lamina.config import KernelConfig, PipelineConfig, use_kernels
from lamina.device import own_cores
from lamina.errors import NodeFailure
from lamina.transport import codec
from lamina.transport.base import ChannelClosed, PeerDied, serve_loop
from lamina.transport.endpoint import connect, listen
from lamina.transport.ring import RingChannel
from lamina.transport.step_codec import parse_step, step_uniforms, tokens_message
from lamina.transport.wire import Message, MsgKind
from lamina.types import AttendMsg, AttendResult, NativeExchange, PrepareMsg

codec.register_error(NodeFailure)


def serve_replica(endpoint: dict, config: dict[str, Any]) -> None:
    """A role's entry point (a process or an actor thread): join the engine's control channel
    at ``endpoint``, load and split the model, then serve until SHUTDOWN. A model that fails to
    load answers every control message with the error."""
    cfg = ReplicaConfig(**config)
    own_cores(cfg.cores, None if cfg.cores else cfg.num_threads)
    if cfg.kernels:
        use_kernels(KernelConfig(**cfg.kernels))
    ctrl = connect(endpoint, spin_us=cfg.spin_us)
    try:
        if cfg.device_polling == "cuda":
            eager_module_loading()  # before the model's load starts CUDA
        from lamina.models import load_model
        from lamina.split_cache import load_split
        dtype = cfg.torch_dtype()
        def load():
            with stages.stage("load model"):
                return load_model(cfg.model, dtype=dtype, device=cfg.device).model
        split = load_split(cfg.model, dtype, cfg.device, load)
        with stages.stage("replica"):
            replica = ComputeReplica(split, cfg.device, None, cfg.cuda_graph_tokens,
                                     blocks_for(cfg.model, cfg.device))
    except Exception as e:  # report it to the engine, which is waiting for a PING reply
        error = e
    else:
        ReplicaServer(replica, cfg, ctrl).run()
        return
    serve_loop(ctrl, lambda msg: codec.to_message(error))


class _Failed(Exception):
    """A send failed; :meth:`ReplicaServer._fail` has already reported it."""


class ReplicaServer:
    """One replica's process: its channels, the inbox they feed, and the replica core
    (:class:`~lamina.computenode.runner.SliceRunner`) it drives; the runner's port."""

    def __init__(self, replica: ComputeReplica, config: ReplicaConfig, ctrl):
        self.cfg = config
        self.ctrl = ctrl
        self.nodes: list = []
        self.next = None  # channel to replica index+1 (None: N == 1)
        self.prev = None  # the link replica index-1 sends contexts on (None: N == 1)
        self.slots: dict[int, int] = {}  # micro-batch slot -> its current step id
        self.early: dict[int, list[tuple[Any, Message]]] = {}  # messages before their STEP
        self.last_step = -1  # newest STEP seen (the engine sends them in step id order)
        self.spans: list[list] = []  # timeline spans not yet sent to the engine
        self.failure: Exception | None = None
        self.inbox = Inbox(config.idle_spin_us, self._current)
        self.steps: RemoteSteps | None = None  # whole-step graphs: made at the first CONNECT
        polling = None if config.step_graph_tokens else make_polling(
            config.device_polling, replica.device, config.micro_batches, config.max_step_tokens)
        pipeline = PipelineConfig(config.schedule, config.micro_batches, config.replicas,
                                  config.attn_parts)
        self.runner = SliceRunner({config.index: replica}, pipeline, self,
                                  peer_base=config.peer_base, polling=polling,
                                  span=self._span if config.trace else None)
        self.inbox.add("engine", ctrl)

    def _current(self, source: Any, link: Any) -> bool:
        """Whether ``link`` is still ``source``'s (a replaced role's link is not)."""
        if isinstance(source, tuple):
            return self.nodes[source[1]] is link
        return self.prev is link if source == "previous" else True

    def run(self) -> None:
        try:
            while True:
                source, item = self.inbox.take()
                if source == "engine":
                    if isinstance(item, BaseException) or not self._control(item):
                        return
                elif isinstance(item, BaseException):
                    self._fail(NodeFailure(f"compute replica {self.cfg.index}: "
                                           f"{self._name(source)} is gone: {item}"))
                else:
                    self._file(source, item)
                try:
                    self.runner.run_ready()
                except _Failed:
                    pass
        finally:
            for step_id in list(self.runner.mbs):
                self.runner.drop(step_id)
            if self.runner.polling is not None:
                self.runner.polling.close()
            if self.steps is not None:
                self.steps.close()
            for ch in [*self.nodes, self.next, self.ctrl]:
                if ch is not None:
                    ch.close()

    @staticmethod
    def _name(source: Any) -> str:
        return f"memory node {source[1]}" if isinstance(source, tuple) else f"{source} replica"

    # -- control --------------------------------------------------------------------------------
    def _control(self, msg: Message) -> bool:
        """Handle one engine message; False after SHUTDOWN."""
        try:
            if msg.kind == MsgKind.STEP:
                try:
                    self._step(msg)
                except _Failed:
                    pass
                return True
            if msg.kind == MsgKind.RESET:  # the engine dropped every micro-batch in flight
                for step_id in list(self.runner.mbs):
                    self.runner.drop(step_id)
                self.slots.clear()
                self.early.clear()
                return True
            if msg.kind == MsgKind.OPEN:  # a channel for the previous replica's contexts
                lst = listen(msg.meta.get("kind", "shm"), msg.meta.get("host", "127.0.0.1"),
                             spin_us=self.cfg.spin_us)
                reply = codec.ok({"endpoint": lst.endpoint})
                reply.step_id = msg.step_id  # the engine may match it among its steps' replies
                self.ctrl.send(reply)
                self.prev, self.failure = lst, None  # (again: the previous replica restarted)
                self.inbox.read("previous", lst)
                return True
            if msg.kind == MsgKind.CONNECT:
                if msg.meta.get("at") is not None:  # a restarted node takes a dead one's place
                    self._replace_node(int(msg.meta["at"]), msg.meta["nodes"][0])
                else:
                    for ep in msg.meta["nodes"]:
                        self.nodes.append(connect(ep, spin_us=self.cfg.spin_us))
                        self.inbox.add(("node", len(self.nodes) - 1), self.nodes[-1])
                    self._join_mailbox(range(len(self.nodes)))
                if msg.meta.get("next") is not None:  # also: a restarted next replica's
                    old, self.next = self.next, connect(msg.meta["next"], spin_us=self.cfg.spin_us)
                    if old is not None:
                        old.close()
                    self.failure = None
                reply = codec.ok()
                reply.step_id = msg.step_id  # the engine may match it among its steps' replies
                self.ctrl.send(reply)
                return True
            if msg.kind in (MsgKind.PING, MsgKind.SHUTDOWN):  # the first: with the start's stages
                self.ctrl.send(codec.ok({"pid": os.getpid(), "stages": stages.take()}))
                return msg.kind == MsgKind.PING
            raise ValueError(f"compute replica cannot handle a {msg.kind.name} message")
        except (PeerDied, ChannelClosed) as e:
            if isinstance(e, PeerDied) or self.ctrl.closed:
                return False  # the engine is gone
            self._fail(NodeFailure(f"compute replica {self.cfg.index}: a channel closed: {e}"))
            return True
        except Exception as e:
            reply = codec.to_message(e)
            reply.step_id = msg.step_id  # a bad STEP fails that step
            self.ctrl.send(reply)
            return True

    def _replace_node(self, k: int, endpoint: dict) -> None:
        """Node ``k`` died and a new one (empty) took its place: join it instead and serve
        steps again (the engine reset every micro-batch in flight first)."""
        if not 0 <= k < len(self.nodes):
            raise ValueError(f"no memory node {k} to replace (this replica has {len(self.nodes)})")
        self.inbox.drop(("node", k))
        old, self.nodes[k] = self.nodes[k], connect(endpoint, spin_us=self.cfg.spin_us)
        old.close()
        self.inbox.add(("node", k), self.nodes[k])
        self.failure = None
        self._join_mailbox([k])

    def _join_mailbox(self, nodes) -> None:
        """With whole-step graphs: make them (at the first CONNECT: the nodes known then are
        the mailbox's), and have each of ``nodes`` serve the mailbox (a MAILBOX; its OK is
        ignored, an ERROR fails every step: :meth:`_file`)."""
        if not self.cfg.step_graph_tokens:
            return
        if self.steps is None:
            replica = self.runner.replicas[self.cfg.index]
            with stages.stage("step graphs"):
                self.steps = RemoteSteps(self.cfg.device_polling, replica.split, self.cfg.index,
                                         replica.device, self.cfg.micro_batches,
                                         self.cfg.step_graph_tokens, self.cfg.torch_dtype(),
                                         self.nodes)
            self.runner.step_graphs, self.runner.serve = self.steps.graphs, self.steps.serve
        for k in nodes:
            if (msg := self.steps.attach(k, self.nodes[k])) is not None:
                self._send(("node", k), msg)

    def _step(self, msg: Message) -> None:
        plan, routes, req_ids, params = parse_step(msg)
        old = self.slots.get(plan.micro_batch)
        if old is not None:  # the slot's previous iteration is over (its tokens were sent)
            self.runner.drop(old)
        self.slots[plan.micro_batch] = plan.step_id
        self.last_step = max(self.last_step, plan.step_id)
        mb = MicroBatch(plan, routes, req_ids, params, step_uniforms(msg))
        if self.failure is not None:
            self.failed(mb, self.failure)
            return
        self.runner.start(mb)
        for source, early in self.early.pop(plan.step_id, []):
            self._file(source, early)

    # -- data -----------------------------------------------------------------------------------
    def _send(self, dest: Any, msg: Message) -> None:
        """Send to a node (``("node", j)``) or the next replica; a channel that is gone fails
        every micro-batch (the replica keeps serving the engine)."""
        ch = self.nodes[dest[1]] if isinstance(dest, tuple) else self.next
        try:
            if isinstance(ch, RingChannel) and self.inbox.direct:
                ch.send(msg, while_full=self.inbox.drain)  # the node may be writing to us
            else:
                ch.send(msg)
        except (PeerDied, ChannelClosed) as e:
            self._fail(NodeFailure(f"compute replica {self.cfg.index}: {self._name(dest)} is "
                                   f"gone: {e}"))
            raise _Failed from e

    def _file(self, source: Any, msg: Message) -> None:
        mb = self.runner.mbs.get(msg.step_id)
        if msg.kind == MsgKind.OK:
            return  # a PREPARE's or a MAILBOX's reply
        if msg.kind == MsgKind.ERROR and msg.step_id == MAILBOX_STEP:
            self._fail(NodeFailure(f"compute replica {self.cfg.index}: {self._name(source)} "
                                   f"cannot serve the step mailbox: {codec.from_message(msg)}"))
            return
        if mb is None:
            if msg.step_id > self.last_step and msg.kind != MsgKind.ERROR:
                self.early.setdefault(msg.step_id, []).append((source, msg))  # before its STEP
            return  # else: for a step that already ended here (an error, a reset): stale
        if msg.kind == MsgKind.ERROR:
            self._error(mb, codec.from_message(msg))
        elif msg.kind == MsgKind.CONTEXT:
            self.runner.on_context(mb, msg.layer, dict(zip(msg.meta["names"], msg.tensors)),
                                   msg.meta["parts"])
        elif msg.kind == MsgKind.RESULT and isinstance(source, tuple):
            route = next((i for i, r in enumerate(mb.routes) if r.node == source[1]), None)
            if route is None:
                self._error(mb, ValueError(f"RESULT from {self._name(source)}, which has no "
                                           f"part of step {msg.step_id}"))
                return
            self.runner.on_result(mb, route, codec.from_message(msg))
        else:
            self._error(mb, ValueError(f"unexpected {msg.kind.name} from {self._name(source)}"))

    # -- the runner's port --------------------------------------------------------------------------
    def to_node(self, node: int, msg: PrepareMsg | AttendMsg) -> None:
        self._send(("node", node), codec.to_message(msg))

    def native_exchange(self, node: int, reply_to: int) -> NativeExchange | None:
        """The ring to node ``node`` as a C++ exchange for a whole step, where this thread
        receives that link itself and nothing waits on it (as :meth:`exchange` requires). The
        PREPARE's OK, which the main loop would ignore (:meth:`_file`), is dropped there."""
        i = self.inbox.index(("node", node))
        if i < 0 or self.inbox.pending(i):
            return None
        native = getattr(self.inbox.direct[i][1], "native_exchange", None)
        return None if native is None else native(MsgKind.ATTEND, reply_to, MsgKind.RESULT,
                                                  *self.inbox.spin, skip=MsgKind.OK)

    def collect(self, node: int, step_id: int, layer: int) -> AttendResult | None:
        return self._await_result(self.inbox.index(("node", node)), step_id, layer)

    def exchange(self, node: int, msg: AttendMsg) -> tuple[int, AttendResult | None]:
        """Send ``msg`` to node ``node`` and, where this thread receives that link itself, wait
        here for its RESULT: one native call that sends and takes the reply
        (:meth:`RingChannel.exchange <lamina.transport.ring.RingChannel.exchange>`), then, if
        the RESULT is not the next message, :meth:`_await_result`."""
        i = self.inbox.index(("node", node))
        if i < 0 or msg.works is not None or self.inbox.pending(i):  # else: the main loop's
            self.to_node(node, msg)
            return time.perf_counter_ns(), None
        ch = self.inbox.direct[i][1]
        try:
            sent_ns, got = ch.exchange(MsgKind.ATTEND, msg.step_id, msg.layer, msg.reply_to,
                                       [msg.q, msg.k, msg.v], MsgKind.RESULT, *self.inbox.spin)
        except (PeerDied, ChannelClosed) as e:
            self._fail(NodeFailure(f"compute replica {self.cfg.index}: memory node {node} is "
                                   f"gone: {e}"))
            raise _Failed from e
        if got is not None:
            return sent_ns, codec.result_of(msg.step_id, msg.layer, got)
        return sent_ns, self._await_result(i, msg.step_id, msg.layer)

    def _await_result(self, i: int, step_id: int, layer: int) -> AttendResult | None:
        """Wait on this thread for the RESULT of ``(step_id, layer)`` on direct link ``i``'s
        ring alone (no trip through the main loop). None once anything else needs the main
        loop: a message other than the PREPARE's OK (filed), data on another direct link or a
        post from a reader thread (another micro-batch may be ready to run), a wait interval
        without data, a failing receive (the main loop meets it again)."""
        inbox = self.inbox
        source, ch = inbox.direct[i]
        while inbox.waits.wait(inbox.rings, inbox.waits.posted, WAKE_S) == i:
            try:
                msg = ch.recv()
            except BaseException:  # noqa: BLE001 - the main loop's receive raises it again
                return None
            if msg.kind == MsgKind.RESULT and msg.step_id == step_id and msg.layer == layer:
                return codec.from_message(msg)
            self._file(source, msg)
            if msg.kind != MsgKind.OK:
                return None
        return None

    def to_next(self, mb: MicroBatch, values: dict[str, torch.Tensor], parts: list[int]) -> None:
        names = list(values)
        self._send("next", Message(MsgKind.CONTEXT, mb.step_id, mb.k + 1,
                                   meta={"names": names, "parts": parts},
                                   tensors=[values[n].contiguous() for n in names]))

    def to_engine(self, mb: MicroBatch, tokens: list[int]) -> None:
        reply = tokens_message(mb.step_id, tokens)
        reply.meta["spans"], self.spans = self.spans, []
        self.ctrl.send(reply)

    def failed(self, mb: MicroBatch, error: BaseException) -> None:
        """End ``mb`` here with an ERROR to the engine (tagged with its step)."""
        reply = codec.to_message(error)
        reply.step_id = mb.step_id
        self.ctrl.send(reply)

    # -- failures and timeline --------------------------------------------------------------------
    def _error(self, mb: MicroBatch, error: BaseException) -> None:
        self.runner.drop(mb.step_id)
        self.failed(mb, error)

    def _fail(self, error: Exception) -> None:
        """A node or peer is gone: fail every micro-batch in flight and every later one."""
        self.failure = error
        for mb in list(self.runner.mbs.values()):
            self._error(mb, error)

    def _span(self, role: str, track: int, name: str, start: int, end: int,
              mb: MicroBatch) -> None:
        self.spans.append([role, track, name, start, end, mb.slot, mb.step_id])
