"""Memory nodes in separate processes: the serving loop (child side) and ``RemoteNode``
(engine side), speaking the wire protocol over a transport channel (shm on one host).

The child owns a :class:`~lamina.memnode.MemoryNode` and answers one reply per request, in
order: PREPARE/FREE/IMPORT/PING -> OK, ATTEND -> RESULT, STATS -> STATS, EXPORT -> KV,
SHUTDOWN -> OK then exit. FREE names either requests (all their KV) or one position range of
one request (what a KV move leaves behind). A failing request gets an ERROR reply (the node is unchanged: see
MemoryNode's all-or-nothing contract) and the loop goes on. The child exits when its parent
dies (the channel notices the peer is gone), so it never outlives the engine.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import asdict
from typing import Any, Callable

import torch

from lamina.launcher import Launcher, MultiprocessingLauncher, ProcessHandle, stop_process
from lamina.nodes import MemoryPoolHandle
from lamina.pool import NodeClient, NodeFailure
from lamina.transport import codec
from lamina.transport.base import ChannelClosed, PeerDied
from lamina.transport.shm import ShmChannel, ShmChannelSpec
from lamina.transport.wire import Message, MsgKind
from lamina.types import AttendMsg, AttendResult, AttentionSpec, KVChunk, NodeStats, PrepareMsg

codec.register_error(NodeFailure)
START_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 600.0


def handle(node, msg: Message) -> Message:
    """One request -> one reply (see module docstring). Exceptions become ERROR replies."""
    try:
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
        if kind == MsgKind.STATS:
            return codec.to_message(node.stats())
        if kind == MsgKind.EXPORT:
            return codec.to_message(node.export(*codec.from_message(msg)))
        if kind == MsgKind.IMPORT:
            node.import_kv(codec.from_message(msg))
            return codec.ok()
        if kind in (MsgKind.PING, MsgKind.SHUTDOWN):
            return codec.ok({"pid": os.getpid()})
        raise ValueError(f"memory node cannot handle a {kind.name} message")
    except Exception as e:  # every failure is the caller's to see, never a crash
        return _error_reply(e, msg)


def _error_reply(e: BaseException, msg: Message) -> Message:
    """ERROR for ``msg``, tagged with its step and layer (a replica files it under that step)."""
    reply = codec.to_message(e)
    reply.step_id, reply.layer = msg.step_id, msg.layer
    return reply


def serve(spec: ShmChannelSpec, config: dict[str, Any]) -> None:
    """Child process entry point: build the node from ``config`` and serve until SHUTDOWN."""
    torch.set_num_threads(int(config.get("num_threads", 1)))
    ch = ShmChannel.attach(spec)
    NodeServer(build_node(config)).serve(ch)


class NodeServer:
    """A memory node served on its primary channel (the engine's) and on *peer* channels that
    compute replicas in other processes open with OPEN (staggered pipelining, DESIGN.md §6).

    On a peer channel, an ATTEND's reply (RESULT or ERROR) goes to the peer named by its
    ``reply_to`` - the replica that runs the micro-batch's next slice - and every other reply
    to the sender. One lock serialises the node and every send on a peer channel, so each
    ring has one producer. A peer that goes away only closes its channel."""

    def __init__(self, node, ring_bytes: int = 8 << 20):
        self.node = node
        self.ring_bytes = ring_bytes
        self.lock = threading.Lock()
        self.peers: dict[int, Any] = {}

    def serve(self, ch) -> None:
        serve_loop(ch, self._primary)

    def _primary(self, msg: Message) -> Message:
        if msg.kind == MsgKind.OPEN:
            return self._open(msg)
        with self.lock:
            return handle(self.node, msg)

    def _open(self, msg: Message) -> Message:
        try:
            peer = int(msg.meta["peer"])
        except (KeyError, TypeError, ValueError):
            return codec.to_message(ValueError(f"OPEN needs an int 'peer', got {msg.meta!r}"))
        ch = ShmChannel.create(capacity=self.ring_bytes, spin_us=20.0)
        with self.lock:
            old = self.peers.pop(peer, None)
            self.peers[peer] = ch
        if old is not None:
            old.close()
        threading.Thread(target=self._serve_peer, args=(peer, ch), daemon=True).start()
        return codec.ok({"endpoint": ch.spec.to_dict()})

    def _serve_peer(self, peer: int, ch) -> None:
        try:
            while True:
                msg = ch.recv()
                with self.lock:
                    to = self.peers.get(msg.reply_to) if msg.kind == MsgKind.ATTEND else ch
                    if to is None:  # checked first: a rejected ATTEND changes nothing
                        ch.send(_error_reply(ValueError(
                            f"ATTEND reply_to {msg.reply_to}: no such peer"), msg))
                        continue
                    reply = handle(self.node, msg)
                    try:
                        to.send(reply)
                    except (PeerDied, ChannelClosed) as e:
                        if to is ch:
                            raise
                        # the next replica is gone: forget it, tell the sender, go on
                        self.peers.pop(msg.reply_to, None)
                        ch.send(_error_reply(NodeFailure(
                            f"compute replica {msg.reply_to} is gone: {e}"), msg))
        except (PeerDied, ChannelClosed):
            pass
        finally:
            with self.lock:
                if self.peers.get(peer) is ch:
                    del self.peers[peer]
            ch.close()


def build_node(config: dict[str, Any]):
    """A MemoryNode from the plain-data ``config`` made by :func:`node_config`."""
    from lamina.memnode import MemoryNode

    specs = [AttentionSpec(**s) for s in config["specs"]]
    return MemoryNode(specs, config["capacity"], slab_size=config["slab_size"],
                      dtype=getattr(torch, config["dtype"]), device=config["device"])


def node_config(specs: list[AttentionSpec], capacity: int, device: str, dtype: torch.dtype,
                slab_size: int, num_threads: int = 1) -> dict[str, Any]:
    return {"specs": [asdict(s) for s in specs], "capacity": capacity, "slab_size": slab_size,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "num_threads": num_threads}


def serve_channel(node, ch, lock: threading.Lock | None = None) -> None:
    """Answer a memory node's requests on ``ch`` until SHUTDOWN or until the peer is gone.
    A node served on several channels at once (its own replica, a borrowing replica, the
    deployment moving KV) passes one ``lock`` to all of them: one request at a time."""
    if lock is None:
        serve_loop(ch, lambda msg: handle(node, msg))
        return

    def locked(msg: Message) -> Message:
        with lock:
            return handle(node, msg)

    serve_loop(ch, locked)


def serve_loop(ch, handler: Callable[[Message], Message],
               on_exit: Callable[[], None] | None = None) -> None:
    """One reply per request, in order, until SHUTDOWN or until the peer is gone."""
    try:
        while True:
            msg = ch.recv()
            ch.send(handler(msg))
            if msg.kind == MsgKind.SHUTDOWN:
                break
    except (PeerDied, ChannelClosed):
        pass  # the peer is gone: exit quietly
    finally:
        ch.close()
        if on_exit is not None:
            on_exit()


class RemoteNode(NodeClient):
    """Engine-side client of a memory node in another process."""

    def __init__(self, channel, process: ProcessHandle | None, name: str):
        self.ch = channel
        self.process = process  # None when someone else (Ray) owns the process
        self.name = name
        self._owed: deque[str] = deque()  # replies not yet received, in send order
        self._early: deque[AttendResult] = deque()  # ATTEND results received by _drain

    def _fail(self, e: BaseException) -> NodeFailure:
        if self.process is None:
            state = "died" if isinstance(e, PeerDied) else "stopped answering"
            return NodeFailure(f"{self.name} {state}: {e}")
        state = "died" if not self.process.is_alive() else "stopped answering"
        code = getattr(self.process, "exitcode", None)
        return NodeFailure(f"{self.name} (pid {self.process.pid}) {state}"
                           + (f" with exit code {code}" if code is not None else "") + f": {e}")

    def _call(self, msg: Message, timeout: float = REPLY_TIMEOUT_S) -> Message:
        self._send(msg)
        self._drain()
        return self._recv(timeout)

    def _send(self, msg: Message) -> None:
        try:
            self.ch.send(msg)
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise self._fail(e) from e

    def _recv(self, timeout: float = REPLY_TIMEOUT_S) -> Message:
        try:
            return codec.raise_if_error(self.ch.recv(timeout))
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise self._fail(e) from e

    def _next_attend(self) -> AttendResult | None:
        """Receive the replies still owed, in send order, up to the next ATTEND result."""
        while self._owed:
            kind = self._owed.popleft()
            reply = self._recv()
            if kind == "attend":
                return codec.from_message(reply)
        return None

    def _drain(self) -> None:
        """Receive every owed reply (before a synchronous call), keeping ATTEND results."""
        while self._owed:
            res = self._next_attend()
            if res is not None:
                self._early.append(res)

    def prepare(self, msg: PrepareMsg) -> None:
        self._call(codec.to_message(msg))

    def send_prepare(self, msg: PrepareMsg) -> None:
        self._send(codec.to_message(msg))
        self._owed.append("ok")

    def send_attend(self, msg: AttendMsg) -> None:
        self._send(codec.to_message(msg))
        self._owed.append("attend")

    def recv_attend(self) -> AttendResult:
        if self._early:
            return self._early.popleft()
        res = self._next_attend()
        if res is None:
            raise RuntimeError(f"{self.name}: recv_attend with no ATTEND outstanding")
        return res

    def free(self, req_ids: list[int], wait: bool = False) -> None:
        """FREE without waiting (an error surfaces at the next receive), or, with ``wait``,
        once the node has freed them (before other processes reuse the slots)."""
        if wait:
            self._call(codec.free_request(req_ids))
            return
        self._send(codec.free_request(req_ids))
        self._owed.append("ok")

    def open_peer(self, peer: int) -> dict:
        """Have the node open a channel for peer ``peer`` (a compute replica in another process
        that will attach it); returns the channel's endpoint."""
        return self._call(Message(MsgKind.OPEN, meta={"peer": peer})).meta["endpoint"]

    def stats(self) -> NodeStats:
        return codec.from_message(self._call(codec.stats_request()))

    def export(self, req_id: int, start: int, end: int) -> KVChunk:
        return codec.from_message(self._call(codec.export_request(req_id, start, end)))

    def import_kv(self, chunk: KVChunk) -> None:
        self._call(codec.to_message(chunk, MsgKind.IMPORT))

    def free_range(self, req_id: int, start: int, end: int) -> None:
        self._call(codec.free_range_request(req_id, start, end))

    def close(self) -> None:
        alive = self.process is None or self.process.is_alive()
        if alive and not self.ch.closed:
            try:
                self.ch.send(codec.shutdown())
                self.ch.recv(5.0)
            except Exception:
                pass  # stop_process below (or the process's owner) takes care of it
        if self.process is not None:
            stop_process(self.process)
        self.ch.close()


def start_remote_nodes(specs: list[AttentionSpec], memory: int, capacity: int, *,
                       device: str = "cpu", dtype: torch.dtype = torch.float32,
                       slab_size: int = 256, launcher: Launcher | None = None,
                       num_threads: int = 1, ring_bytes: int = 8 << 20) -> MemoryPoolHandle:
    """Start ``memory`` node processes (in parallel) and wait until each answers a PING."""
    launcher = launcher or MultiprocessingLauncher()
    config = node_config(specs, capacity, device, dtype, slab_size, num_threads)
    handle_ = MemoryPoolHandle([], [])
    try:
        for i in range(memory):
            ch = ShmChannel.create(capacity=ring_bytes)
            proc = launcher.start(serve, (ch.spec, config), name=f"lamina-memory-{i}")
            ch.set_peer_alive(proc.is_alive)
            node = RemoteNode(ch, proc, f"memory node {i}")
            handle_.clients.append(node)
            handle_.capacities.append(capacity)
            handle_.closers.append(node.close)
        for node in handle_.clients:
            node._call(codec.ping(), timeout=START_TIMEOUT_S)
    except BaseException:
        handle_.close()
        raise
    return handle_
