"""The memory-node server: one :class:`~lamina.memnode.MemoryNode` answering the wire protocol,
the same code under every placement (a process of its own, a Ray actor).

Requests get one reply each, in order: PREPARE/FREE/IMPORT/CANCEL/SHARE/PING/MAILBOX -> OK, ATTEND -> RESULT,
STATS -> STATS, EXPORT -> KV, OPEN -> OK with a peer channel's endpoint, SHUTDOWN -> OK then
exit. FREE names either requests (all their KV) or one position range of one request (what a
KV move leaves behind). A failing request gets an ERROR reply tagged with its step and layer
(the node is unchanged: see MemoryNode's all-or-nothing contract) and serving goes on.

Channels: the *primary* one, opened by whoever started the node (the engine's: PREPARE-free
requests, FREE, STATS, EXPORT/IMPORT, OPEN), and one *peer* channel per compute replica that
reaches the node (its own instance's replicas and, with borrowing, other instances'). On a peer
channel an ATTEND's reply goes to the peer named by its ``reply_to`` (the replica that runs the
micro-batch's next slice); every other reply goes to the sender. A MAILBOX on a peer channel
starts a thread that serves that replica's step mailbox (:mod:`lamina.memnode.mailbox_loop`:
whole decode steps as one graph) until the peer's channel ends. One lock
serialises the node and every send on a peer channel, so each ring has one producer. The server
exits when the primary channel's peer is gone, so it never outlives the engine.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lamina import stages
from lamina.config import KernelConfig, dtype_name, use_kernels
from lamina.device import own_cores
from lamina.errors import NodeFailure
from lamina.memnode.mailbox_loop import MailboxLoop
from lamina.memnode.native import IDLE, plane_for
from lamina.memnode.node import MemoryNode
from lamina.transport import codec
from lamina.transport.base import ChannelClosed, PeerDied, serve_loop
from lamina.transport.endpoint import SPIN_US, Listening, connect, listen
from lamina.transport.wire import Message, MsgKind, WireError
from lamina.types import AttentionSpec

codec.register_error(NodeFailure)


def handle(node: MemoryNode, msg: Message) -> Message:
    """One request -> one reply (see module docstring). Exceptions become ERROR replies. The
    caller holds the node's lock."""
    try:
        node.sync()
        kind = msg.kind
        if kind == MsgKind.ATTEND:
            return codec.to_message(node.attend(codec.from_message(msg)))
        if kind == MsgKind.PREPARE:
            node.prepare(codec.from_message(msg))
            return codec.ok()
        if kind == MsgKind.FREE:
            what = codec.from_message(msg)
            if isinstance(what, tuple):
                node.free_range(*what)
                return codec.ok()
            return codec.ok({"freed": node.free(what)})
        if kind == MsgKind.CANCEL:
            node.cancel_steps(codec.from_message(msg))
            return codec.ok()
        if kind == MsgKind.SHARE:
            node.share(*codec.from_message(msg))
            return codec.ok()
        if kind == MsgKind.STATS:
            return codec.to_message(node.stats())
        if kind == MsgKind.EXPORT:
            return codec.to_message(node.export(*codec.from_message(msg)))
        if kind == MsgKind.IMPORT:
            node.import_kv(codec.from_message(msg))
            return codec.ok()
        if kind in (MsgKind.PING, MsgKind.SHUTDOWN):  # the first PING: with the start's stages
            return codec.ok({"pid": os.getpid(), "stages": stages.take()})
        raise ValueError(f"memory node cannot handle a {kind.name} message")
    except Exception as e:  # every failure is the caller's to see, never a crash
        return error_reply(e, msg)


def error_reply(e: BaseException, msg: Message) -> Message:
    """ERROR for ``msg``, tagged with its step and layer (a replica files it under that step)."""
    reply = codec.to_message(e)
    reply.step_id, reply.layer = msg.step_id, msg.layer
    return reply


class NodeServer:
    """A memory node served on its primary channel and on the peer channels it opens (see the
    module docstring). With a native plane (:mod:`lamina.memnode.native`; ``node.plane`` is set
    here where one applies) each peer's thread lets the plane serve the ATTENDs it can, and
    takes the other messages the Python way; the plane's mutex is then the node's lock."""

    def __init__(self, node: MemoryNode, spin_us: float = SPIN_US):
        self.node = node
        self.spin_us = spin_us  # on peer (data) links
        node.plane = plane_for(node)
        self.plane = node.plane
        self.lock = self.plane.lock if self.plane is not None else threading.Lock()
        self.peers: dict[int, Listening] = {}
        self._native_peers: set[int] = set()  # peers whose reply ring the plane writes
        self.mailboxes: dict[int, tuple[Listening, MailboxLoop]] = {}  # peer -> its link, loop

    def serve(self, ch) -> None:
        """Serve the primary channel until SHUTDOWN or its peer is gone; then close peers."""
        try:
            serve_loop(ch, self._primary)
        finally:
            with self.lock:
                peers, self.peers = list(self.peers.values()), {}
                for peer in self._native_peers:
                    self.plane.remove_peer(peer)
                self._native_peers.clear()
                loops, self.mailboxes = list(self.mailboxes.values()), {}
            for _, loop in loops:
                loop.stop()
            for p in peers:
                p.close()

    def _primary(self, msg: Message) -> Message:
        if msg.kind == MsgKind.OPEN:
            return self._open(msg)
        with self.lock:
            return handle(self.node, msg)

    def _open(self, msg: Message) -> Message:
        try:
            peer = int(msg.meta["peer"])
            lst = listen(msg.meta.get("kind", "shm"), msg.meta.get("host", "127.0.0.1"),
                         spin_us=self.spin_us)
        except (KeyError, TypeError, ValueError) as e:
            return codec.to_message(ValueError(f"OPEN needs an int 'peer' and a channel kind: {e}"))
        with self.lock:
            old = self.peers.pop(peer, None)
            self._forget_native(peer)  # before the old channel closes
            self.peers[peer] = lst
        if old is not None:
            old.close()
        threading.Thread(target=self._serve_peer, args=(peer, lst), daemon=True).start()
        return codec.ok({"endpoint": lst.endpoint})

    def _forget_native(self, peer: int) -> None:
        """The plane stops writing to ``peer`` (the caller holds the lock)."""
        if peer in self._native_peers:
            self._native_peers.discard(peer)
            self.plane.remove_peer(peer)

    def _serve_peer(self, peer: int, lst: Listening) -> None:
        try:
            ch = lst.channel()
            plane = self.plane
            if plane is not None:
                with self.lock:
                    tx = ch.native_tx()
                    if tx is not None and self.peers.get(peer) is lst:
                        plane.add_peer(peer, tx)
                        self._native_peers.add(peer)
            while True:
                if plane is not None:
                    status = ch.serve_native(plane.serve)
                    if status == IDLE:
                        ch.wait_readable()
                        continue
                msg = ch.recv()  # Python's: the plane handed it over, or there is none
                if msg.kind == MsgKind.MAILBOX:
                    reply = self._mailbox(peer, lst, msg)
                    with self.lock:
                        ch.send(reply)
                    continue
                with self.lock:
                    to = self.peers.get(msg.reply_to) if msg.kind == MsgKind.ATTEND else lst
                    if to is None:  # checked first: a rejected ATTEND changes nothing
                        ch.send(error_reply(ValueError(
                            f"ATTEND reply_to {msg.reply_to}: no such peer"), msg))
                        continue
                    reply = handle(self.node, msg)
                    if msg.kind == MsgKind.PREPARE and peer in self.mailboxes:
                        self.mailboxes[peer][1].wake()  # a step through the mailbox is coming
                    try:
                        to.channel().send(reply)
                    except (PeerDied, ChannelClosed, TimeoutError) as e:
                        if to is lst:
                            raise
                        # the next replica is gone: forget it, tell the sender, go on
                        self.peers.pop(msg.reply_to, None)
                        self._forget_native(msg.reply_to)
                        ch.send(error_reply(NodeFailure(
                            f"compute replica {msg.reply_to} is gone: {e}"), msg))
        except (PeerDied, ChannelClosed, TimeoutError):
            pass
        except WireError as e:  # a corrupt stream: this peer's link ends, the node serves on
            logging.getLogger("lamina.memnode").warning(
                "lamina: memory node closes the corrupt link of peer %s: %s", peer, e)
        finally:
            with self.lock:
                if self.peers.get(peer) is lst:
                    del self.peers[peer]
                    self._forget_native(peer)
                mine = self.mailboxes.get(peer)
                if mine is not None and mine[0] is lst:
                    del self.mailboxes[peer]
            if mine is not None and mine[0] is lst:
                mine[1].stop()
            lst.close()

    def _mailbox(self, peer: int, lst: Listening, msg: Message) -> Message:
        """Serve the step mailbox ``msg`` names for ``peer`` (in place of any it had)."""
        try:
            loop = MailboxLoop(self.node, self.lock, msg.meta, self.spin_us).start()
        except Exception as e:  # a bad handle: the replica sees the error, the node goes on
            return error_reply(e, msg)
        with self.lock:
            old = self.mailboxes.get(peer)
            self.mailboxes[peer] = (lst, loop)
        if old is not None:
            old[1].stop()
        return codec.ok()


@dataclass
class NodeConfig:
    """What a memory-node process needs besides its channel (plain data, sent at spawn):
    ``specs`` (:class:`AttentionSpec` fields), ``capacity`` slots in slabs of ``slab_size``,
    ``dtype`` (a torch dtype name) on ``device``, its pool in KV format ``kv_dtype``; ``cores`` the CPU cores the node owns (it
    pins itself and runs one thread per core; None: ``num_threads`` threads, unpinned);
    ``spin_us``: how long its receivers on replica (data) links poll before sleeping (``inf``:
    it owns its cores alone and never sleeps; the control link always may); ``kernels``: the :class:`KernelConfig` fields it computes with
    (None: its process's default)."""

    specs: list[dict]
    capacity: int
    slab_size: int
    dtype: str
    device: str = "cpu"
    num_threads: int = 1
    cores: list[int] | None = None
    spin_us: float = SPIN_US
    kernels: dict | None = None
    kv_dtype: str = "auto"


def node_config(specs: list[AttentionSpec], capacity: int, device: str, dtype: torch.dtype,
                slab_size: int, num_threads: int = 1, cores: list[int] | None = None,
                spin_us: float = SPIN_US, kernels: KernelConfig | None = None,
                kv_dtype: str = "auto") -> NodeConfig:
    """A :class:`NodeConfig` from the engine's objects."""
    return NodeConfig([asdict(s) for s in specs], capacity, slab_size, dtype_name(dtype),
                      str(device), num_threads, cores, spin_us,
                      asdict(kernels) if kernels is not None else None, kv_dtype)


def build_node(config: NodeConfig) -> MemoryNode:
    """The MemoryNode ``config`` describes."""
    return MemoryNode([AttentionSpec(**s) for s in config.specs], config.capacity,
                      slab_size=config.slab_size, dtype=getattr(torch, config.dtype),
                      kv_dtype=config.kv_dtype,
                      device=config.device)


def serve_node(endpoint: dict[str, Any], config: dict[str, Any]) -> None:
    """A role's entry point (a process or an actor thread): join the primary channel at
    ``endpoint``, build the node from ``config`` (a :class:`NodeConfig` as a dict), serve until
    SHUTDOWN or the engine is gone."""
    cfg = NodeConfig(**config)
    own_cores(cfg.cores, None if cfg.cores else cfg.num_threads)
    if cfg.kernels:
        use_kernels(KernelConfig(**cfg.kernels))
    ch = connect(endpoint)  # control: sleeps when idle
    with stages.stage("build node"):
        node = build_node(cfg)
    with stages.stage("native plane"):
        server = NodeServer(node, spin_us=cfg.spin_us)
    server.serve(ch)
