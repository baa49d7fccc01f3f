"""Clients of memory nodes, one per node: the engine's view of a node (and, in process, the
replicas' too; replica processes speak to their nodes over raw peer channels).

``NodeClient`` offers the same operations whether the node lives in this process
(:class:`InProcessNode`: plain method calls on a ``MemoryNode``, the *local* backend: no encoding,
no copy) or in another process (:class:`RemoteNode`: the wire protocol over a channel). ATTEND
is split into ``send_attend`` and ``recv_attend`` so a caller can fan a layer out to every node
before collecting the results, and several steps (micro-batches) may have ATTENDs outstanding
on one node: results come back in the order the ATTENDs were sent. A remote node that dies or
stops answering raises :class:`~lamina.errors.NodeFailure` naming it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any

from lamina.errors import NodeFailure
from lamina.transport import codec
from lamina.transport.base import REPLY_TIMEOUT_S, Channel, ChannelClosed, PeerDied
from lamina.transport.wire import Message, MsgKind
from lamina.types import AttendMsg, AttendResult, KVChunk, NativeExchange, NodeStats, PrepareMsg

codec.register_error(NodeFailure)


class NodeClient(ABC):
    name: str = "memory node"

    @abstractmethod
    def prepare(self, msg: PrepareMsg) -> None: ...

    def send_prepare(self, msg: PrepareMsg) -> None:
        """PREPARE without waiting for the reply (a pipelined engine keeps other steps' ATTENDs
        outstanding on the node); an error surfaces at the next receive. Default: synchronous."""
        self.prepare(msg)

    @abstractmethod
    def send_attend(self, msg: AttendMsg) -> None: ...

    @abstractmethod
    def recv_attend(self) -> AttendResult: ...

    @abstractmethod
    def free(self, req_ids: list[int]) -> None: ...

    @abstractmethod
    def stats(self) -> NodeStats: ...

    @abstractmethod
    def export(self, req_id: int, start: int, end: int) -> KVChunk:
        """EXPORT positions ``[start, end)`` of a request's shard (moving KV between pools)."""

    @abstractmethod
    def import_kv(self, chunk: KVChunk) -> None:
        """IMPORT a chunk as (or onto) the request's shard on this node."""

    @abstractmethod
    def free_range(self, req_id: int, start: int, end: int) -> None:
        """Free positions ``[start, end)`` of a request (the source side of a KV move)."""

    @abstractmethod
    def cancel(self, step_ids: list[int]) -> None:
        """Roll back steps dropped in flight and refuse their PREPAREs from now on (waits)."""

    @abstractmethod
    def share(self, dst: int, parts: list[tuple[int, int, int]]) -> None:
        """Shard ``dst`` takes the slots of ``parts = [(src, start, end)]`` (prefix caching;
        waits)."""

    def native_exchange(self) -> NativeExchange | None:
        """The node's ATTEND as C++ in this process calls it, for a whole-step program
        (:meth:`MemoryNode.native_exchange`); None where there is none (the default)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        pass


class InProcessNode(NodeClient):
    """A MemoryNode in this process; results of ``send_attend`` are computed at once."""

    def __init__(self, node: Any, name: str = "memory node"):  # a lamina.memnode.MemoryNode
        self.node = node
        self.name = name
        self._results: deque[AttendResult] = deque()

    def prepare(self, msg: PrepareMsg) -> None:
        self.node.prepare(msg)

    def send_attend(self, msg: AttendMsg) -> None:
        self._results.append(self.node.attend(msg))

    def recv_attend(self) -> AttendResult:
        return self._results.popleft()

    def native_exchange(self) -> NativeExchange | None:
        return None if self._results else self.node.native_exchange()

    def free(self, req_ids: list[int]) -> None:
        self.node.free(req_ids)

    def stats(self) -> NodeStats:
        return self.node.stats()

    def export(self, req_id: int, start: int, end: int) -> KVChunk:
        return self.node.export(req_id, start, end)

    def import_kv(self, chunk: KVChunk) -> None:
        self.node.import_kv(chunk)

    def free_range(self, req_id: int, start: int, end: int) -> None:
        self.node.free_range(req_id, start, end)

    def cancel(self, step_ids: list[int]) -> None:
        self.node.cancel_steps(step_ids)

    def share(self, dst: int, parts: list[tuple[int, int, int]]) -> None:
        self.node.share(dst, parts)


class RemoteNode(NodeClient):
    """Engine-side client of a memory node in another process."""

    def __init__(self, channel: Channel, process: Any = None, name: str = "memory node"):
        self.ch = channel
        self.process = process  # its handle (pid, is_alive(), exitcode), for error messages
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

    def open_peer(self, peer: int, kind: str = "shm", host: str = "127.0.0.1") -> dict:
        """Have the node open a channel (backend ``kind``) for peer ``peer``, a compute replica
        that will join it; returns the channel's endpoint (:mod:`lamina.transport.endpoint`)."""
        msg = Message(MsgKind.OPEN, meta={"peer": peer, "kind": kind, "host": host})
        return self._call(msg).meta["endpoint"]

    def stats(self) -> NodeStats:
        return codec.from_message(self._call(codec.stats_request()))

    def export(self, req_id: int, start: int, end: int) -> KVChunk:
        return codec.from_message(self._call(codec.export_request(req_id, start, end)))

    def import_kv(self, chunk: KVChunk) -> None:
        self._call(codec.to_message(chunk, MsgKind.IMPORT))

    def free_range(self, req_id: int, start: int, end: int) -> None:
        self._call(codec.free_range_request(req_id, start, end))

    def cancel(self, step_ids: list[int]) -> None:
        self._call(codec.cancel_request(step_ids))

    def share(self, dst: int, parts: list[tuple[int, int, int]]) -> None:
        self._call(codec.share_request(dst, parts))

    def close(self) -> None:
        """SHUTDOWN and close the channel (whoever started the process stops it)."""
        alive = self.process is None or self.process.is_alive()
        if alive and not self.ch.closed:
            try:
                self.ch.send(codec.shutdown())
                self.ch.recv(5.0)
            except Exception:
                pass  # the process's owner stops it
        self.ch.close()
