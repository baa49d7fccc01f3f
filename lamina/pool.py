"""Clients for the memory nodes of one instance (the memory pool), one per node.

``NodeClient`` is the engine's view of one memory node: the same operations whether the node
lives in this process (``InProcessNode``: plain method calls on a ``MemoryNode``, the *local*
backend: no encoding, no copy) or in another process (``RemoteNode`` in :mod:`lamina.remote`:
the wire protocol over a transport channel). ATTEND is split into ``send_attend`` and
``recv_attend`` so the engine can fan a layer out to every node before collecting the results,
and several steps (micro-batches) may have ATTENDs outstanding on one node: results come back
in the order the ATTENDs were sent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from lamina.memnode import MemoryNode
from lamina.types import AttendMsg, AttendResult, KVChunk, NodeStats, PrepareMsg


class NodeFailure(RuntimeError):
    """A memory node died or stopped answering; the message names it."""


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

    def close(self) -> None:  # noqa: B027 - optional
        pass


class InProcessNode(NodeClient):
    """A MemoryNode in this process; results of ``send_attend`` are computed at once."""

    def __init__(self, node: MemoryNode, name: str = "memory node"):
        self.node = node
        self.name = name
        self._results: deque[AttendResult] = deque()

    def prepare(self, msg: PrepareMsg) -> None:
        self.node.prepare(msg)

    def send_attend(self, msg: AttendMsg) -> None:
        self._results.append(self.node.attend(msg))

    def recv_attend(self) -> AttendResult:
        return self._results.popleft()

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
