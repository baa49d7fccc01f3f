"""The step mailbox: a whole decode step's attention exchange at fixed addresses, so that a
CUDA graph can hold every slice of the step with its sends and waits (issue 41, item 3).

A ring (:mod:`lamina.transport.ring`) moves messages of any size to wherever its head is; a
captured graph replays the same addresses every time. The mailbox is therefore one fixed
section per micro-batch slot, in memory that both sides reach (host memory mapped into the GPU
for the compute side: :mod:`lamina.computenode.step_graphs`), laid out as follows (every region
starts on its own 64-byte line, so no word the device writes shares a line with one a node
writes)::

    words    int64[8]   SEND (the device: BASE + layer + 1 once the layer's q/k/v are in),
                        BASE (the host, per step), STEP (its id), TOKENS (rows in use),
                        MISSED (a device wait gave up)
    per node int64[8]   REPLY (the node: the SEND value it answered), STATUS (0; FAILED, or
                        GONE: a stand-in for a dead node; kept for the step once set),
                        NQ, NA (its query and appended rows this step)
             int64[Tp]  q_rows, int64[Tp] kv_rows (rows of the step, in its works' order)
             uint8[256] the error text of a FAILED answer
    q[Tp, H, D], k[Tp, Hkv, D], v[Tp, Hkv, D]                (the model's dtype)
    per node o[Tp, H, D] (the model's dtype), lse[Tp, H] (float32)

One round: before launching slot s's step the host :meth:`Mailbox.post`\\ s it (step id, BASE,
each node's rows, the landing areas cleared: o = 0, lse = -inf); per layer the device writes
q/k/v, then SEND; each node sees SEND move (:class:`MailboxServer`), attends its rows, writes
its o/lse rows and STATUS, then REPLY = SEND (a release); the device waits for every REPLY and
merges the nodes' o by LSE (a row no node saw stays 0). Values only grow: BASE is the step
count of the slot times the layers. One section per slot is enough: the device writes layer
k+1's q/k/v only after every node answered layer k, and a node reads them before it answers.

Contract: ``buffer`` is uint8 of :meth:`MailboxShape.nbytes` on any device (the host's mapping
or a CUDA alias of it); the section of a slot is touched by its one micro-batch at a time.
A node answers every SEND, failing or not, so the device never waits on a node that is up; a
node that is gone is found by the device's bounded wait (MISSED), or sooner by a stand-in on
the compute side that answers FAILED in its place (a :class:`MailboxServer` whose attend
raises). An ATTEND that cannot run yet (:class:`NotReady`: a node in another process may see
SEND before the step's PREPARE, which travels on its ring) is polled again, for at most
``ready_timeout_s``.

Across processes (a memory node in a process of its own) the buffer is a memory file of the
compute side's process (:class:`SharedMailbox`), which a node maps by the handle in a MAILBOX
message (:func:`map_shared`); nothing is named on disk, so nothing is left behind whoever dies.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from lamina.errors import NodeFailure
from lamina.transport.ring_memory import fence
from lamina.types import AttendMsg, AttendResult, NodeRoute

SEND, BASE, STEP, TOKENS, MISSED = range(5)  # slot words
REPLY, STATUS, NQ, NA = range(4)  # node words
FAILED, GONE = 1, 2  # STATUS: a layer failed; the node is gone (NodeFailure)
ERROR_BYTES = 256
READY_TIMEOUT_S = 10.0  # how long a SEND may wait for its step's PREPARE
_LINE = 64


class NotReady(Exception):
    """An attend that cannot run yet (its step is not prepared); :class:`MailboxServer` polls
    it again."""


def _up(n: int) -> int:
    return -(-n // _LINE) * _LINE


@dataclass(frozen=True)
class MailboxShape:
    """``slots`` micro-batch slots of up to ``tokens`` rows for ``nodes`` memory nodes; q has
    ``heads`` x ``dim``, k/v ``kv_heads`` x ``dim`` per row, in ``dtype``."""

    slots: int
    nodes: int
    tokens: int
    heads: int
    kv_heads: int
    dim: int
    dtype: torch.dtype = torch.float32

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def _node_bytes(self) -> int:
        return _up(8 * 8) + 2 * _up(8 * self.tokens) + _up(ERROR_BYTES)

    def _landing_bytes(self) -> int:
        return _up(self.tokens * self.heads * self.dim * self.itemsize) + \
            _up(self.tokens * self.heads * 4)

    def section_bytes(self) -> int:
        t, i = self.tokens, self.itemsize
        qkv = _up(t * self.heads * self.dim * i) + 2 * _up(t * self.kv_heads * self.dim * i)
        return _up(8 * 8) + self.nodes * self._node_bytes() + qkv + \
            self.nodes * self._landing_bytes()

    def nbytes(self) -> int:
        return self.slots * self.section_bytes()

    def to_meta(self) -> dict[str, Any]:
        """The shape as JSON-able plain data (:meth:`from_meta`)."""
        return {**asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "MailboxShape":
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a mailbox shape with dtype {meta['dtype']!r}")
        return cls(*(int(meta[k]) for k in ("slots", "nodes", "tokens", "heads", "kv_heads",
                                             "dim")), dtype)


def host_buffer(shape: MailboxShape) -> torch.Tensor:
    """A zeroed, page-aligned host buffer for ``shape``: an anonymous mapping (which
    ``cudaHostRegister`` can map into a GPU), kept alive by the tensor."""
    return torch.frombuffer(mmap.mmap(-1, shape.nbytes()), dtype=torch.uint8)


class SharedMailbox:
    """A zeroed buffer for ``shape`` in a memory file (``memfd``) of this process, which other
    processes of this host and user map by :attr:`handle` (:func:`map_shared`) for as long as
    it is open; :meth:`close` releases the file (mappings stay valid)."""

    def __init__(self, shape: MailboxShape) -> None:
        self.shape = shape
        self.fd = os.memfd_create("lamina-mailbox", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, shape.nbytes())
        self.buffer = torch.frombuffer(mmap.mmap(self.fd, shape.nbytes()), dtype=torch.uint8)

    @property
    def handle(self) -> dict[str, Any]:
        """What a MAILBOX message carries: the file's path as another process opens it, and
        the shape."""
        return {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "shape": self.shape.to_meta()}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_shared(handle: dict[str, Any]) -> Mailbox:
    """The mailbox of another process's :attr:`SharedMailbox.handle`, mapped here."""
    shape = MailboxShape.from_meta(handle["shape"])
    fd = os.open(str(handle["path"]), os.O_RDWR)
    try:
        if os.fstat(fd).st_size < shape.nbytes():
            raise ValueError(f"the mailbox file {handle['path']} is smaller than its shape")
        buffer = torch.frombuffer(mmap.mmap(fd, shape.nbytes()), dtype=torch.uint8)
    finally:
        os.close(fd)
    return Mailbox(shape, buffer)


class Mailbox:
    """Views of the mailbox in ``buffer`` (module docstring); every view aliases ``buffer``,
    so on a CUDA alias of host memory they are what a graph reads and writes."""

    def __init__(self, shape: MailboxShape, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < shape.nbytes():
            raise ValueError(f"a mailbox of shape {shape} needs uint8[{shape.nbytes()}]; got "
                             f"{buffer.dtype}{list(buffer.shape)}")
        self.shape, self.buffer = shape, buffer
        self.bases = [0] * shape.slots  # the host's BASE per slot (post)

    def _region(self, at: int, n: int, dtype: torch.dtype, dims: tuple[int, ...]) -> torch.Tensor:
        return self.buffer[at:at + n * dtype.itemsize].view(dtype).view(dims)

    def _offsets(self, slot: int) -> dict[str, int]:
        s = self.shape
        if not 0 <= slot < s.slots:
            raise ValueError(f"mailbox slot {slot} out of range 0..{s.slots - 1}")
        at = slot * s.section_bytes()
        out = {"words": at}
        at += _up(64)
        out["nodes"] = at
        at += s.nodes * s._node_bytes()
        t, i = s.tokens, s.itemsize
        out["q"], at = at, at + _up(t * s.heads * s.dim * i)
        out["k"], at = at, at + _up(t * s.kv_heads * s.dim * i)
        out["v"], at = at, at + _up(t * s.kv_heads * s.dim * i)
        out["landing"] = at
        return out

    # -- views ---------------------------------------------------------------------------------
    def words(self, slot: int) -> torch.Tensor:
        """int64[8]: SEND, BASE, STEP, TOKENS, MISSED."""
        return self._region(self._offsets(slot)["words"], 8, torch.int64, (8,))

    def node_words(self, slot: int, node: int) -> torch.Tensor:
        """int64[8]: REPLY, STATUS, NQ, NA of ``node``."""
        return self._region(self._node_at(slot, node), 8, torch.int64, (8,))

    def rows(self, slot: int, node: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``node``'s ``(q_rows, kv_rows)`` areas, int64[Tp] each."""
        at, t = self._node_at(slot, node) + _up(64), self.shape.tokens
        return (self._region(at, t, torch.int64, (t,)),
                self._region(at + _up(8 * t), t, torch.int64, (t,)))

    def error(self, slot: int, node: int) -> torch.Tensor:
        at = self._node_at(slot, node) + _up(64) + 2 * _up(8 * self.shape.tokens)
        return self.buffer[at:at + ERROR_BYTES]

    def qkv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q[Tp, H, D]``, ``k/v[Tp, Hkv, D]`` of ``slot``."""
        s, off = self.shape, self._offsets(slot)
        t = s.tokens
        return (self._region(off["q"], t * s.heads * s.dim, s.dtype, (t, s.heads, s.dim)),
                self._region(off["k"], t * s.kv_heads * s.dim, s.dtype, (t, s.kv_heads, s.dim)),
                self._region(off["v"], t * s.kv_heads * s.dim, s.dtype, (t, s.kv_heads, s.dim)))

    def landing(self, slot: int, node: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``node``'s answer areas: ``o[Tp, H, D]`` and ``lse[Tp, H]`` (float32)."""
        s = self.shape
        self._check_node(node)
        at = self._offsets(slot)["landing"] + node * s._landing_bytes()
        t = s.tokens
        o = self._region(at, t * s.heads * s.dim, s.dtype, (t, s.heads, s.dim))
        at += _up(t * s.heads * s.dim * s.itemsize)
        return o, self._region(at, t * s.heads, torch.float32, (t, s.heads))

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.shape.nodes:
            raise ValueError(f"mailbox node {node} out of range 0..{self.shape.nodes - 1}")

    def _node_at(self, slot: int, node: int) -> int:
        self._check_node(node)
        return self._offsets(slot)["nodes"] + node * self.shape._node_bytes()

    # -- the host's side -------------------------------------------------------------------------
    def post(self, slot: int, step_id: int, tokens: int, routes: list[NodeRoute],
             layers: int, padded: int | None = None) -> int:
        """Ready ``slot`` for step ``step_id`` of ``tokens`` rows whose ``layers`` layers go to
        ``routes`` (route i: node ``route.node``) and whose device work reads ``padded`` rows
        (default: every row; those landing rows are cleared); returns the step's BASE. Called
        while no device work and no node touches the slot (its previous step is over)."""
        s = self.shape
        if tokens > s.tokens:
            raise ValueError(f"a {tokens}-token step does not fit the mailbox's {s.tokens} rows")
        padded = s.tokens if padded is None else padded
        for n in range(s.nodes):
            o, lse = self.landing(slot, n)
            o[:padded].zero_()
            lse[:padded].fill_(float("-inf"))
            self.node_words(slot, n)[STATUS:NA + 1] = 0  # a failed layer stays FAILED
        for r in routes:
            w = self.node_words(slot, r.node)
            q_rows, kv_rows = self.rows(slot, r.node)
            nq, na = r.q_rows.numel(), r.kv_rows.numel()
            q_rows[:nq] = r.q_rows
            kv_rows[:na] = r.kv_rows
            w[NQ], w[NA] = nq, na
        base = self.bases[slot]
        self.bases[slot] = base + layers
        words = self.words(slot)
        words[STEP], words[TOKENS], words[BASE] = step_id, tokens, base
        fence()
        return base

    def check(self, slot: int) -> None:
        """After slot ``slot``'s step: raise if a device wait gave up or a node failed
        (:class:`NodeFailure` where a node is gone or stopped answering)."""
        words = self.words(slot)
        if int(words[MISSED]):
            words[MISSED] = 0
            raise NodeFailure(f"a device wait on mailbox slot {slot} gave up before every memory "
                               "node answered (a node stopped answering); the step is void")
        for n in range(self.shape.nodes):
            w = self.node_words(slot, n)
            status = int(w[STATUS])
            if status in (FAILED, GONE):
                w[STATUS] = 0
                text = bytes(self.error(slot, n).tolist()).rstrip(b"\0").decode(errors="replace")
                error = NodeFailure if status == GONE else RuntimeError
                raise error(f"memory node {n} failed step {int(words[STEP])}: {text}")


class MailboxServer:
    """A memory node's side of ``box`` (node index ``node``): :meth:`poll` answers every SEND
    that moved since the last poll, each by ``attend(AttendMsg) -> AttendResult`` (the node's
    :meth:`~lamina.memnode.node.MemoryNode.attend`). An exception there is this step's
    answer (STATUS FAILED with its text), never this loop's end; :class:`NotReady` leaves
    the SEND for a later poll, for at most ``ready_timeout_s``. It starts after the SENDs its
    node index already answered (REPLY: a node that takes a dead one's place does not answer
    them again)."""

    def __init__(self, box: Mailbox, node: int, attend: Callable[[AttendMsg], AttendResult],
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        box._check_node(node)
        self.box, self.node, self.attend = box, node, attend
        self.ready_timeout_s = ready_timeout_s
        self.served = 0
        slots = range(box.shape.slots)  # the words polled, viewed once
        self._words = [box.words(s) for s in slots]
        self._mine = [box.node_words(s, node) for s in slots]
        self.seen = torch.tensor([int(m[REPLY]) for m in self._mine], dtype=torch.int64)
        self._not_ready: dict[int, tuple[int, float]] = {}  # slot -> (its SEND, first try)

    def poll(self) -> bool:
        """Answer what is waiting in every slot; whether anything was."""
        done = False
        for slot in range(self.box.shape.slots):
            while self.answer(slot):
                done = True
        return done

    def answer(self, slot: int) -> bool:
        """Answer ``slot``'s SEND if it moved past :attr:`seen` (int64 [slots]: the last SEND
        answered per slot, which a native poller shares); whether it did."""
        words, mine = self._words[slot], self._mine[slot]
        send = int(words[SEND])
        if send <= int(self.seen[slot]):
            return False
        fence()  # SEND read before the bytes it covers
        step, layer = int(words[STEP]), send - int(words[BASE]) - 1
        nq, na = int(mine[NQ]), int(mine[NA])
        if nq or na:
            try:
                self._attend(slot, step, layer, nq, na)
            except NotReady as e:
                now = time.monotonic()
                first = self._not_ready.get(slot)
                if first is None or first[0] != send:
                    first = self._not_ready[slot] = (send, now)
                if now - first[1] < self.ready_timeout_s:
                    return False  # polled again
                self._failed(slot, TimeoutError(f"step {step} was not ready within "
                                                f"{self.ready_timeout_s:g} s: {e}"))
            except Exception as e:  # noqa: BLE001 - the step's answer, not the loop's end
                self._failed(slot, e)
        self._not_ready.pop(slot, None)
        fence()  # the answer's bytes before REPLY
        mine[REPLY] = send
        self.seen[slot] = send
        self.served += 1
        return True

    def _failed(self, slot: int, e: BaseException) -> None:
        text = f"{type(e).__name__}: {e}".encode()[:ERROR_BYTES - 1]
        err = self.box.error(slot, self.node)
        err.zero_()
        err[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self._mine[slot][STATUS] = GONE if isinstance(e, NodeFailure) else FAILED

    def _attend(self, slot: int, step: int, layer: int, nq: int, na: int) -> None:
        box = self.box
        q_rows, kv_rows = (r[:n] for r, n in zip(box.rows(slot, self.node), (nq, na)))
        q, k, v = box.qkv(slot)
        res = self.attend(AttendMsg(step, layer, q[q_rows], k[kv_rows], v[kv_rows]))
        o, lse = box.landing(slot, self.node)
        o[q_rows] = res.o.to(o.device, o.dtype)
        lse[q_rows] = res.lse.to(lse.device, torch.float32)
