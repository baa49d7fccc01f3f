"""MemoryNode: the memory-node service logic, independent of any transport.

A node owns one :class:`KVPool` and its :class:`SlabAllocator`, holds at most one shard (a
contiguous position range) per request, and answers plain method calls taking and returning
the dataclasses of :mod:`lamina.types`:

* ``prepare(PrepareMsg)`` - reserve slots for the step's appended tokens and precompute the
  kernel indices, kept per ``step_id`` so several micro-batches can be in flight.
* ``attend(AttendMsg) -> AttendResult`` - store the layer's k/v, run paged attention.
* ``free(req_ids)``, ``free_range``, ``export``, ``import_kv``, ``share``, ``cancel``, ``stats``.

A native data plane (:attr:`MemoryNode.plane`) serves ATTENDs on the same state, off a ring or
(asked first by :meth:`attend`) from tensors; :meth:`sync` ends the steps it finished.

Semantics (the contract other components rely on):

* **Shards.** Appended positions must start at the request's shard end on this node, or open
  its first shard here (at any ``append_start``). ``import_kv`` may also extend a shard at its
  front. A request may be in at most one in-flight step per node (step s+1 of a micro-batch
  needs the token sampled in step s), so a request in flight is *busy*.
* **PREPARE validation.** Counts and positions are >= 0; a request appears at most once per
  step; a work with ``num_append == 0`` must name a request this node holds (queries sent to a
  node that holds nothing of the request are a scheduler bug: :class:`UnknownRequest`); when a
  work has both queries and appends, its last query must not precede its last appended position
  (``q_start + num_q >= append_start + num_append``). ``num_q == 0`` (store only) is allowed.
* **All-or-nothing.** Every method validates, then allocates (the only step that may run out:
  :class:`OutOfSlots`), then commits. On any exception the node is unchanged, with one
  exception: ``attend`` writes the layer's k/v before calling the kernel, so a failing kernel
  leaves that layer's appended K/V written (harmless; the layer may be attended again).
* **Steps.** A step's state is dropped after every layer has been attended once (layers in any
  order; attending a layer twice is an error). ``cancel(step_id)`` drops a step early and rolls
  its appends back (the slots return to the pool; a shard the step opened disappears).
  ``cancel_steps(ids)`` does so for steps dropped in flight when a role died, and refuses a
  later PREPARE of any of them (its PREPARE may still be on its way from a replica; the last
  :data:`CANCELLED_KEPT` ids are remembered).
* **free.** ``free(req_ids)`` ignores ids this node does not hold (the engine frees finished
  requests on every node) and returns the ids it freed. Freeing a busy request removes it at
  once; its slots go back to the pool when its step finishes or is cancelled, so the in-flight
  kernel never reads reused slots.
* **Export/import/share** touch only the written part of a shard (positions whose K/V is in
  every layer); ``free_range``/``import_kv`` refuse busy requests (:class:`RequestBusy`).
  Moving a shard is ``dst.import_kv(src.export(r, a, b))`` then ``src.free_range(r, a, b)``
  where ``[a, b)`` is a prefix or suffix of the source shard.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch

from lamina.config import CacheConfig
from lamina.kernels import dispatch
from lamina.kernels.kv_format import kv_format
from lamina.memnode.allocator import OutOfSlots, SlabAllocator
from lamina.memnode.cascade import attend_cascade
from lamina.memnode.kv_pool import KVPool
from lamina.memnode.plan import StepState, build_step
from lamina.memnode.kv_moves import KVMoves
from lamina.memnode.shard import RequestBusy, Shard, UnknownRequest
from lamina.types import (AttendMsg, AttendResult, AttentionSpec, NativeExchange,
                          NodeStats, PrepareMsg, ShardWork)

if TYPE_CHECKING:
    from lamina.memnode.native import NativePlane

__all__ = ["MemoryNode", "OutOfSlots", "UnknownRequest", "UnknownStep", "RequestBusy"]
CANCELLED_KEPT = 4096  # step ids a node refuses after cancel_steps (the newest)


class UnknownStep(LookupError):
    """No prepared step with this id (never prepared, finished, or cancelled)."""


class MemoryNode(KVMoves):
    """One memory node: a KV pool, its allocator, the shards it holds and its prepared steps.

    ``specs`` has one AttentionSpec per attention layer; ``AttendMsg.layer`` names
    ``spec.layer`` and pool layer ``i`` stores ``specs[i]``. All layers must share
    ``num_kv_heads`` and ``head_dim`` (one pool shape). Give either ``pool`` or
    ``capacity_slots`` (then a pool on ``device`` in KV format ``kv_dtype`` is created:
    :mod:`lamina.kernels.kv_format`, ``auto`` being the model's ``dtype``). A format the
    device's attention kernel cannot read is a ``ValueError`` here."""

    def __init__(self, specs: Sequence[AttentionSpec], capacity_slots: int | None = None, *,
                 pool: KVPool | None = None, slab_size: int = CacheConfig.slab_size,
                 dtype: torch.dtype = torch.float32, kv_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        self.specs = list(specs)
        if not self.specs:
            raise ValueError("a memory node needs at least one AttentionSpec")
        hkv, d = self.specs[0].num_kv_heads, self.specs[0].head_dim
        if any(s.num_kv_heads != hkv or s.head_dim != d for s in self.specs):
            raise ValueError("all layers of one node must share num_kv_heads and head_dim")
        self._layer_index = {s.layer: i for i, s in enumerate(self.specs)}
        if len(self._layer_index) != len(self.specs):
            raise ValueError("AttentionSpec.layer values must be distinct")
        if pool is None:
            if capacity_slots is None:
                raise ValueError("give either pool or capacity_slots")
            pool = KVPool(len(self.specs), hkv, d, capacity_slots, kv_format(kv_dtype, dtype),
                          device)
        elif (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (len(self.specs), hkv, d):
            raise ValueError("pool shape does not match the AttentionSpecs")
        dispatch.check_format(pool.device, pool.fmt)
        self.pool = pool
        self.allocator = SlabAllocator(pool.capacity, slab_size)
        self._windows = {s.window for s in self.specs}
        self._shards: dict[int, Shard] = {}
        self._steps: dict[int, StepState] = {}
        self._cancelled: deque[int] = deque(maxlen=CANCELLED_KEPT)  # refused by prepare
        self._attend_ns = 0  # cumulative ATTEND time, reported by STATS
        self.plane: NativePlane | None = None  # a native data plane serving ATTENDs (see sync)
        self._attention = None  # the kernel for the pool's device, resolved at the first ATTEND
        self._merge = None  # with the LSE merge of a cascade's rows

    def native_exchange(self) -> NativeExchange | None:
        """:meth:`attend` as a whole-step program in this process calls it, without Python (the
        native plane's; None without one). The caller is the node's only thread, as for
        :meth:`attend`."""
        return self.plane.exchange(self.sync) if self.plane is not None else None

    def sync(self) -> None:
        """End the steps the native plane finished (the caller holds its lock)."""
        if self.plane is not None:
            for step_id in self.plane.finished():
                step = self._steps.get(step_id)
                if step is not None:
                    self._finish(step)

    # -- PREPARE ------------------------------------------------------------------------------
    def prepare(self, msg: PrepareMsg) -> None:
        """Reserve slots for ``msg.works``' appends and precompute the step's kernel indices.

        Raises ValueError (bad plan), UnknownRequest, RequestBusy or OutOfSlots; in every case
        the node is unchanged.
        """
        if msg.step_id in self._steps:
            raise ValueError(f"step {msg.step_id} is already prepared on this node")
        if msg.step_id in self._cancelled:
            raise UnknownStep(f"step {msg.step_id} was cancelled on this node")
        works = list(msg.works)
        seen: set[int] = set()
        shards = [self._check_work(w, seen) for w in works]
        counts = [w.num_append for w in works]
        slots = self.allocator.alloc(sum(counts))  # may raise OutOfSlots: nothing changed yet
        try:
            new_slots = np.split(slots, np.cumsum(counts)[:-1]) if works else []
            step = build_step(msg.step_id, works, shards, new_slots, self._windows,
                              len(self.specs), self.pool.device)
        except BaseException:
            self.allocator.free(slots)
            raise
        for w, sh, new in zip(works, shards, new_slots):  # commit: nothing below can fail
            if sh is None:
                sh = self._shards[w.req_id] = Shard(w.append_start, new)
            else:
                sh.append(new)
            sh.pending, sh.step = w.num_append, msg.step_id
            step.shards.append(sh)
        self._steps[msg.step_id] = step
        if self.plane is not None:
            self.plane.add_step(step)

    def _check_work(self, w: ShardWork, seen: set[int]) -> Shard | None:
        if min(w.q_start, w.num_q, w.append_start, w.num_append) < 0:
            raise ValueError(f"request {w.req_id}: negative position or count in {w}")
        if w.req_id in seen:
            raise ValueError(f"request {w.req_id} appears twice in one step")
        seen.add(w.req_id)
        if w.num_q and w.num_append and w.q_start + w.num_q < w.append_start + w.num_append:
            raise ValueError(f"request {w.req_id}: appended positions beyond the last query")
        sh = self._shards.get(w.req_id)
        if sh is None:
            if w.num_append == 0:
                raise UnknownRequest(f"request {w.req_id}: queries sent to a node that holds "
                                     f"no shard of it")
            return None
        if sh.step is not None:
            raise RequestBusy(f"request {w.req_id} is already in step {sh.step}")
        if w.num_append and w.append_start != sh.end:
            raise ValueError(f"request {w.req_id}: append at {w.append_start} does not extend "
                             f"its shard [{sh.start}, {sh.end}) contiguously")
        return sh

    # -- ATTEND -------------------------------------------------------------------------------
    def attend(self, msg: AttendMsg) -> AttendResult:
        """Store the layer's appended k/v, then attend the step's queries over the shards.

        ``msg.q[Tq, H, D]`` and ``msg.k/v[Ta, Hkv, D]`` are in plan order (any device; moved to
        the pool's), for every work or for the mini-batch ``msg.works`` (which must continue the
        layer where its previous mini-batch ended; the layer counts as attended after its last
        work). Returns ``o[Tq, H, D]`` (q's dtype) and ``lse[Tq, H]`` (float32) on the
        pool's device; ``lse == -inf`` for queries that see no key here.
        """
        if self.plane is not None and (fast := self.plane.attend(msg)) is not None:
            self.sync()  # ends the step here too if that was its last layer
            return fast
        t0 = time.perf_counter_ns()
        step = self._steps.get(msg.step_id)
        if step is None:
            raise UnknownStep(f"step {msg.step_id} is not prepared on this node")
        li = self._layer_index.get(msg.layer)
        if li is None:
            raise ValueError(f"layer {msg.layer} has no AttentionSpec on this node")
        first = int(step.progress[li])
        if first < 0:
            raise ValueError(f"step {msg.step_id}: layer {msg.layer} was already attended")
        spec = self.specs[li]
        R = len(step.works)
        a, b = msg.works if msg.works is not None else (first, R)
        if a != first or not (a < b <= R or a == b == R == 0):
            raise ValueError(f"step {msg.step_id} layer {msg.layer}: works [{a}, {b}) do not "
                             f"continue the layer at work {first} of {R}")
        view = step.view(a, b)
        want_q = (view.num_q, spec.num_heads, spec.head_dim)
        want_kv = (view.num_append, spec.num_kv_heads, spec.head_dim)
        if tuple(msg.q.shape) != want_q or tuple(msg.k.shape) != want_kv \
                or tuple(msg.v.shape) != want_kv:
            raise ValueError(f"step {msg.step_id} layer {msg.layer} works [{a}, {b}): expected "
                             f"q{want_q}, k/v{want_kv}; got q{tuple(msg.q.shape)}, "
                             f"k{tuple(msg.k.shape)}, v{tuple(msg.v.shape)}")
        self.pool.store_kv(li, view.append_slots, msg.k, msg.v)
        idx = view.kv[spec.window]
        # host indptrs: a GPU pool's Triton kernel plans once per step, never waiting for the GPU
        qo_indptr, kv_indptr = torch.from_numpy(view.qo_indptr), torch.from_numpy(idx.kv_indptr)
        if self._attention is None:  # this role's kernel choices hold for its lifetime
            self._attention = dispatch.resolve(self.pool.device)
            self._merge = dispatch.resolve_merge(self.pool.device)
        q, kv = msg.q.to(self.pool.device), (self.pool.k(li), self.pool.v(li))
        if step.cascade is not None and spec.window is None and (a, b) == (0, R):
            o, lse = attend_cascade(self._attention, self._merge, q, *kv, qo_indptr,
                                    view.q_positions, step.cascade, spec, **self.pool.scales(li))
        else:
            o, lse = self._attention(q, *kv, qo_indptr, kv_indptr, idx.kv_indices,
                                     view.q_positions, idx.kv_start_pos, spec,
                                     **self.pool.scales(li))
        if b < R:
            step.progress[li] = b
        else:
            step.progress[li] = -1
            step.progress[-1] -= 1
            if step.progress[-1] == 0:
                self._finish(step)
        t1 = time.perf_counter_ns()
        self._attend_ns += t1 - t0
        return AttendResult(step_id=msg.step_id, layer=msg.layer, o=o, lse=lse, span_ns=(t0, t1))

    def _finish(self, step: StepState) -> None:
        del self._steps[step.step_id]
        if self.plane is not None:
            self.plane.drop_step(step.step_id)
        for sh in step.shards:
            sh.pending, sh.step = 0, None
        for slots in step.deferred_free:
            self.allocator.free(slots)

    def cancel(self, step_id: int) -> None:
        """Drop a prepared step and roll back its appends (their slots return to the pool)."""
        step = self._steps.get(step_id)
        if step is None:
            raise UnknownStep(f"step {step_id} is not prepared on this node")
        for w, sh in zip(step.works, step.shards):
            if w.num_append and self._shards.get(w.req_id) is sh:
                self.allocator.free(sh.drop_back(w.num_append))
                if sh.length == 0:
                    del self._shards[w.req_id]
        self._finish(step)

    def cancel_steps(self, step_ids: Iterable[int]) -> None:
        """Cancel each of ``step_ids`` that is prepared here, and refuse a later PREPARE of
        any of them (a step dropped in flight, whose PREPARE may not have arrived yet)."""
        for step_id in step_ids:
            if step_id in self._steps:
                self.cancel(step_id)
            if step_id not in self._cancelled:
                self._cancelled.append(step_id)

    # -- FREE (export, import, share: KVMoves) --------------------------------------------------
    def free(self, req_ids: Iterable[int]) -> list[int]:
        """Free every slot of the given requests; ids not held here are ignored.

        Returns the ids that were held. A busy request's slots are released when its step ends.
        """
        freed = []
        for r in dict.fromkeys(req_ids):
            sh = self._shards.pop(r, None)
            if sh is None:
                continue
            freed.append(r)
            if sh.step is not None:
                self._steps[sh.step].deferred_free.append(sh.slots.copy())
            else:
                self.allocator.free(sh.slots)
        return freed

    # -- STATS --------------------------------------------------------------------------------
    def shard(self, req_id: int) -> tuple[int, int] | None:
        """``(start_pos, length)`` of the request's shard here, or None."""
        sh = self._shards.get(req_id)
        return None if sh is None else (sh.start, sh.length)

    @property
    def in_flight(self) -> list[int]:  # ids of prepared steps not finished yet
        return list(self._steps)

    def stats(self) -> NodeStats:
        a, plane_ns = self.allocator, self.plane.attend_ns if self.plane else 0
        return NodeStats(a.capacity, a.num_used, a.num_free, a.slab_size, a.num_slabs,
                         a.used_slabs, a.free_slabs, len(self._shards),
                         (self._attend_ns + plane_ns) // 1000,
                         {r: (sh.start, sh.length) for r, sh in self._shards.items()})
