"""The memory node's native data plane (``memnode/csrc/attend_plane.cpp``): ATTENDs served in C++
on the thread of the peer channel they arrive on, without the GIL.

A :class:`NativePlane` belongs to one :class:`~lamina.memnode.node.MemoryNode` (``node.plane``)
and sits between it and the :class:`~lamina.memnode.server.NodeServer`:

* the node registers each prepared step (:meth:`NativePlane.add_step`) and drops it when Python
  ends it (:meth:`~NativePlane.drop_step`); :meth:`MemoryNode.sync` ends the steps the plane
  finished (:meth:`~NativePlane.finished`);
* the server registers each peer's reply ring (:meth:`~NativePlane.add_peer`), and its peer
  threads call :meth:`~NativePlane.serve` on their receive ring before taking a message the
  Python way: the plane answers every ATTEND it can (the same RESULT the Python path computes,
  with the same kernel) and hands back the rest, untouched, in order;
* :attr:`~NativePlane.lock` is the node's lock: Python holds it while it handles a message,
  the plane while it serves one;
* :meth:`MemoryNode.attend` asks :meth:`~NativePlane.attend` first: an ATTEND from tensors
  (a node in the engine's process, or a message the ring path handed back) runs the same
  checks, append and kernel in one C++ call.

Used where it builds and applies: a CPU pool (every KV format: the C++ kernel takes them all), the C++ attention
kernel chosen (``attention`` ``auto`` or ``cpp``), the C++ ring fast path, and the ``plane``
kernel choice ``auto`` (``native``: that or an error; ``python``: never). Rings whose writes must
be published (RDMA) are served the Python way (:meth:`RingChannel.native_rx` says so).
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable

import torch

from lamina.build import EXCHANGE_HEADER, Extension
from lamina.config import kernels_in_use
from lamina.kernels import cpp_ext
from lamina.kernels.dispatch import backend_for
from lamina.transport import shm_fast
from lamina.transport.wire import DEFAULT_LIMITS, DTYPE_CODES, MsgKind
from lamina.types import AttendMsg, AttendResult, NativeExchange

if TYPE_CHECKING:
    from lamina.transport.mailbox import Mailbox
    from lamina.memnode.node import MemoryNode
    from lamina.memnode.plan import StepState

__all__ = ["EXTENSION", "NativePlane", "IDLE", "HANDOFF", "plane_for", "unavailable"]

_CSRC = Path(__file__).resolve().parent / "csrc"
_RING = Path(shm_fast.__file__).resolve().parent / "csrc"
EXTENSION = Extension("lamina_attend_plane", (_CSRC / "attend_plane.cpp",),
                      headers=(_RING / "ring_layout.h", _RING / "ring_io.h",
                               _CSRC / "mailbox_io.h", EXCHANGE_HEADER),
                      fallback="the Python ATTEND path")
IDLE, HANDOFF = 0, 1  # NativePlane.serve's results (checked against the module's at load)


class NativeLock:
    """The plane's mutex as a context manager (waits without the GIL)."""

    def __init__(self, plane) -> None:
        self._plane = plane

    def __enter__(self) -> "NativeLock":
        self._plane.lock()
        return self

    def __exit__(self, *exc) -> None:
        self._plane.unlock()


class NativePlane:
    """The C++ plane of ``node``'s pool (see the module docstring)."""

    def __init__(self, node: "MemoryNode", module: ModuleType, kernels: ModuleType) -> None:
        if (module.IDLE, module.HANDOFF) != (IDLE, HANDOFF):
            raise RuntimeError(f"{EXTENSION.name}: serve() statuses differ from native.py's")
        specs = [(s.layer, s.num_heads, s.num_kv_heads, s.head_dim, float(s.scale),
                  int(s.window or 0), float(s.softcap or 0.0)) for s in node.specs]
        pool = node.pool
        k, v = pool.fmt.k.view(pool.k_cache), pool.fmt.v.view(pool.v_cache)
        self._plane = module.AttendPlane(k, v, pool.k_scale, pool.v_scale, specs,
                                         kernels.paged_attention_fn, kernels.kv_store_fn,
                                         kernels.merge_rows_fn,
                                         list(DEFAULT_LIMITS.as_tuple()),
                                         int(MsgKind.ATTEND), int(MsgKind.RESULT))
        self.lock = NativeLock(self._plane)
        self._exchange = (module.exchange_fn, self._plane.handle())

    # -- steps (the node's calls, under the lock) -------------------------------------------------
    def add_step(self, step: "StepState") -> None:
        kv = [(int(w or 0), torch.from_numpy(i.kv_indptr), i.kv_indices, i.kv_start_pos)
              for w, i in step.kv.items()]
        self._plane.add_step(step.step_id, len(step.works), torch.from_numpy(step.q_indptr),
                             torch.from_numpy(step.a_indptr), step.q_positions, step.append_slots,
                             torch.from_numpy(step.progress), kv)
        if (c := step.cascade) is not None:
            s, p = c.suffix, c.prefix
            self._plane.add_cascade(step.step_id, torch.from_numpy(s.kv_indptr), s.kv_indices,
                                    s.kv_start_pos, c.rows, torch.from_numpy(c.qo_indptr),
                                    c.q_positions, torch.from_numpy(p.kv_indptr), p.kv_indices,
                                    p.kv_start_pos)

    def drop_step(self, step_id: int) -> None:
        self._plane.drop_step(step_id)

    def finished(self) -> list[int]:
        """Steps whose last layer the plane attended since the last call."""
        return self._plane.finished()

    @property
    def attend_ns(self) -> int:
        """Time spent attending natively (nanoseconds, cumulative)."""
        return self._plane.attend_ns

    @property
    def served(self) -> int:
        """ATTENDs served natively so far."""
        return self._plane.served

    def attend(self, msg: AttendMsg) -> AttendResult | None:
        """``msg`` attended here, from its tensors (:meth:`MemoryNode.attend`'s fast path, the
        caller holding :attr:`lock` or being the node's only thread): the result the Python path
        computes, or None where that path must answer (it then computes or raises as usual).
        A step whose last layer this was is ended by :meth:`MemoryNode.sync`."""
        a, b = msg.works if msg.works is not None else (-1, -1)
        r = self._plane.attend(msg.step_id, msg.layer, a, b, msg.q, msg.k, msg.v)
        if r is None:
            return None
        o, lse, t0, t1 = r
        return AttendResult(step_id=msg.step_id, layer=msg.layer, o=o, lse=lse, span_ns=(t0, t1))

    def exchange(self, done) -> NativeExchange:
        """:meth:`attend` for a whole-step program in this process (``exchange.h``), under the
        same rule; ``done``: :meth:`MemoryNode.sync`."""
        return NativeExchange(*self._exchange, done)

    # -- peers and serving (the server's calls) -------------------------------------------------
    def add_peer(self, peer: int, tx: tuple[int, int, int, int, int]) -> None:
        """Write RESULTs for ``peer`` into the ring ``tx`` (:meth:`RingChannel.native_tx`);
        under the lock."""
        self._plane.add_peer(peer, *tx)

    def remove_peer(self, peer: int) -> None:
        """Stop writing to ``peer`` (before its channel closes); under the lock."""
        self._plane.remove_peer(peer)

    def mailbox_poll(self, box: "Mailbox", node: int, seen: torch.Tensor
                     ) -> Callable[[int, int], tuple[int, int]]:
        """A poller of ``box``'s SENDs for node index ``node`` in C++ (``mailbox_io.h``):
        ``poll(spin_ns, yield_every) -> (answered, slot)`` answers each SEND past ``seen``
        (int64 [slots], the :class:`~lamina.transport.mailbox.MailboxServer`'s, updated) as that
        server would, without the GIL, taking :attr:`lock` per answer; ``slot`` >= 0: that slot's
        SEND is the Python server's to answer. ``box`` must outlive the poller."""
        rows = []
        for s in range(box.shape.slots):
            (q_rows, kv_rows), (q, k, v), (o, lse) = (box.rows(s, node), box.qkv(s),
                                                      box.landing(s, node))
            rows.append([t.data_ptr() for t in (box.words(s), box.node_words(s, node), q_rows,
                                                kv_rows, q, k, v, o, lse)])
        layout = torch.tensor(rows, dtype=torch.int64)
        sh = box.shape
        dims = [sh.tokens, sh.heads, sh.kv_heads, sh.dim, DTYPE_CODES[sh.dtype]]
        plane = self._plane

        def poll(spin_ns: int, yield_every: int) -> tuple[int, int]:
            return plane.serve_mailbox(layout, seen, dims, spin_ns, yield_every)
        return poll

    def serve(self, ctl: int, data: int, cap: int, tail_addr: int, data_bell: int,
              space_bell: int, spin_ns: int, yield_every: int, budget_ns: int) -> int:
        """Serve ATTENDs off one receive ring (:meth:`RingChannel.serve_native` passes it),
        sleeping on its doorbell between them: :data:`HANDOFF` when the next message is
        Python's, :data:`IDLE` when ``budget_ns`` passed."""
        return self._plane.serve(ctl, data, cap, tail_addr, data_bell, space_bell, spin_ns,
                                 yield_every, budget_ns)


def unavailable(node: "MemoryNode") -> str | None:
    """Why ``node`` cannot have a native plane here (None: it can)."""
    pool = node.pool
    if pool.device.type != "cpu":
        return f"the pool is on {pool.device}"
    if backend_for(pool.device) != "cpp":
        return f"attention runs on the {backend_for(pool.device)} kernels, not the C++ one"
    if shm_fast.load() is None:
        return "the ring has no C++ fast path"
    if EXTENSION.load() is None:
        return f"it does not build ({EXTENSION.build_error()})"
    return None


def plane_for(node: "MemoryNode") -> NativePlane | None:
    """``node``'s native plane per the ``plane`` kernel choice, or None (the Python path);
    ``native`` raises naming why it cannot be."""
    choice = kernels_in_use().plane
    if choice == "python":
        return None
    why = unavailable(node)
    if why is not None:
        if choice == "native":
            raise RuntimeError(f"the memory node's native plane is unavailable: {why}")
        return None
    return NativePlane(node, EXTENSION.load(), cpp_ext.load())

