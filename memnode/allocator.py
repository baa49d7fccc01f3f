"""Token-granular slot allocator with a LIFO free list, reference counts and slab accounting.

A KV pool has ``capacity_slots`` slots (one token each). Slots are grouped into slabs of
``slab_size`` consecutive slots: slab ``i`` is slots ``[i*slab_size, (i+1)*slab_size)``. The
capacity need not be a multiple of ``slab_size``; the last slab is then partial. A partial slab
counts in ``num_slabs``/``used_slabs``/``free_slabs`` but is never handed out by
:meth:`SlabAllocator.alloc_slabs`, whose unit (a whole slab) is what nodes lend and migrate.

Contracts:

* Slot arrays in and out are 1-D ``numpy.int64`` arrays (anything ``numpy.asarray`` turns into
  integers is accepted: lists, CPU torch tensors). Returned arrays belong to the caller.
* Every live slot has a reference count >= 1. :meth:`alloc` hands out slots with count 1;
  :meth:`fork` adds one per occurrence; :meth:`free` removes one per occurrence, and a slot goes
  back to the free list when its count reaches 0.
* The free list is a stack. ``alloc(n)`` pops the ``n`` most recently freed slots. The slots
  released by one ``free`` call come back in the order they were released in that call (a
  slot is released at its last occurrence), so freeing a request and allocating the same number
  of slots returns the same array.
  At construction ``alloc(n)`` returns ``0, 1, ..., n-1``.
* Every method validates before mutating: on any exception the allocator is unchanged.
  Running out raises :class:`OutOfSlots`; a bad slot (out of range, not live, or freed more
  times than it is referenced) raises :class:`SlotError`.

The hot path (``alloc``/``free``/``fork`` of a whole step) is vectorised numpy; there is no
Python loop over slots.
"""
from __future__ import annotations

import numpy as np

from lamina.config import CacheConfig

__all__ = ["OutOfSlots", "SlotError", "SlabAllocator", "as_slots"]


class OutOfSlots(MemoryError):
    """Not enough free slots (or whole free slabs); nothing was allocated."""

    def __init__(self, requested: int, available: int, what: str = "slots") -> None:
        super().__init__(f"out of KV {what}: requested {requested}, {available} free")
        self.requested = requested
        self.available = available


class SlotError(ValueError):
    """A slot passed to ``free``/``fork`` is out of range or not allocated (double/foreign free)."""


def as_slots(slots) -> np.ndarray:
    """``slots`` as a 1-D int64 numpy array (copy only when needed)."""
    arr = np.asarray(slots)
    if arr.ndim != 1:
        raise SlotError(f"slots must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise SlotError(f"slots must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class SlabAllocator:
    """Slot allocator for one KV pool (see module docstring for the contract)."""

    def __init__(self, capacity_slots: int, slab_size: int = CacheConfig.slab_size) -> None:
        if capacity_slots < 0:
            raise ValueError(f"capacity_slots must be >= 0, got {capacity_slots}")
        if slab_size <= 0:
            raise ValueError(f"slab_size must be positive, got {slab_size}")
        self.capacity = int(capacity_slots)
        self.slab_size = int(slab_size)
        self.num_slabs = -(-self.capacity // self.slab_size)
        self.num_full_slabs = self.capacity // self.slab_size
        self._refs = np.zeros(self.capacity, dtype=np.int32)
        # Free stack: _stack[:_top] are free, top of stack (next handed out) at _top-1.
        self._stack = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self._top = self.capacity
        self._slab_live = np.zeros(self.num_slabs, dtype=np.int64)  # live slots per slab

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    @property
    def used_slabs(self) -> int:
        """Slabs holding at least one live slot."""
        return int(np.count_nonzero(self._slab_live))

    @property
    def free_slabs(self) -> int:
        """Slabs with no live slot (the partial last slab included)."""
        return self.num_slabs - self.used_slabs

    @property
    def free_full_slabs(self) -> int:
        """Whole free slabs that :meth:`alloc_slabs` can hand out."""
        return int(np.count_nonzero(self._slab_live[: self.num_full_slabs] == 0))

    def refcount(self, slots) -> np.ndarray:
        """Reference counts of ``slots`` (0 for free slots)."""
        arr = self._check_range(as_slots(slots))
        return self._refs[arr].astype(np.int64)

    def slab_slots(self, slabs) -> np.ndarray:
        """Slots of the given slab ids, slab by slab, ascending within each slab."""
        ids = np.asarray(slabs, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_full_slabs):
            raise SlotError(f"slab ids out of range [0, {self.num_full_slabs}): {ids}")
        return (ids[:, None] * self.slab_size + np.arange(self.slab_size)).reshape(-1)

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray:
        """Allocate ``n`` slots (count 1 each), most recently freed first. Raises OutOfSlots."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._top:
            raise OutOfSlots(n, self._top)
        out = self._stack[self._top - n: self._top][::-1].copy()
        self._top -= n
        self._refs[out] = 1
        self._slab_live += np.bincount(out // self.slab_size, minlength=self.num_slabs)
        return out

    def alloc_slabs(self, n: int) -> np.ndarray:
        """Allocate ``n`` whole free slabs (lowest ids first); returns their slab ids ``int64[n]``.

        Every slot of the returned slabs is live with count 1; free them with
        ``free(slab_slots(ids))``. Raises OutOfSlots (``what="slabs"``) when fewer whole slabs
        are free, even if enough scattered slots are.
        """
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slabs ({n})")
        free_ids = np.flatnonzero(self._slab_live[: self.num_full_slabs] == 0)
        if n > free_ids.size:
            raise OutOfSlots(n, int(free_ids.size), what="slabs")
        ids = free_ids[:n].astype(np.int64)
        if n == 0:
            return ids
        taken = np.zeros(self.num_slabs, dtype=bool)
        taken[ids] = True
        stack = self._stack[: self._top]
        keep = stack[~taken[stack // self.slab_size]]  # order of the remaining free list kept
        self._stack[: keep.size] = keep
        self._top = keep.size
        slots = self.slab_slots(ids)
        self._refs[slots] = 1
        self._slab_live[ids] = self.slab_size
        return ids

    def fork(self, slots) -> None:
        """Add one reference per occurrence of each (live) slot, e.g. to share a prefix."""
        arr = self._check_live(as_slots(slots))
        np.add.at(self._refs, arr, 1)

    def free(self, slots) -> np.ndarray:
        """Drop one reference per occurrence; returns the slots released to the free list.

        Raises SlotError, changing nothing, if a slot is out of range, not live, or occurs more
        often than its reference count.
        """
        arr = self._check_live(as_slots(slots))
        uniq, rev_first, counts = np.unique(arr[::-1], return_index=True, return_counts=True)
        last = arr.size - 1 - rev_first  # index of each slot's last occurrence in arr
        if np.any(counts > self._refs[uniq]):
            bad = uniq[counts > self._refs[uniq]]
            raise SlotError(f"slots freed more times than referenced (double free): {bad[:16]}")
        remaining = self._refs[uniq] - counts
        self._refs[uniq] = remaining
        released = uniq[remaining == 0]
        released = released[np.argsort(last[remaining == 0])]  # release order
        k = released.size
        self._stack[self._top: self._top + k] = released[::-1]
        self._top += k
        if k:
            self._slab_live -= np.bincount(released // self.slab_size, minlength=self.num_slabs)
        return released

    # -- validation ---------------------------------------------------------------------------
    def _check_range(self, arr: np.ndarray) -> np.ndarray:
        if arr.size and (arr.min() < 0 or arr.max() >= self.capacity):
            bad = arr[(arr < 0) | (arr >= self.capacity)]
            raise SlotError(f"slots out of range [0, {self.capacity}): {bad[:16]}")
        return arr

    def _check_live(self, arr: np.ndarray) -> np.ndarray:
        self._check_range(arr)
        dead = self._refs[arr] == 0
        if np.any(dead):
            raise SlotError(f"slots not allocated (double free or foreign slot): {arr[dead][:16]}")
        return arr

    def check_invariants(self) -> None:
        """Assert internal consistency (for tests and debugging; O(capacity))."""
        free = self._stack[: self._top]
        assert np.unique(free).size == free.size, "a slot is on the free list twice"
        assert np.all(self._refs[free] == 0), "a live slot is on the free list"
        assert np.count_nonzero(self._refs) == self.num_used, "used slots != live slots"
        live = np.flatnonzero(self._refs)
        per_slab = np.bincount(live // self.slab_size, minlength=self.num_slabs)
        assert np.array_equal(per_slab, self._slab_live), "slab accounting is off"
