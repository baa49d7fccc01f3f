"""A shard: the contiguous range of one request's positions held by one memory node.

``Shard.slots[i]`` is the pool slot of position ``start + i``. Slots are kept in a growable
int64 numpy buffer (capacity doubling), so appending a decode token is amortised O(1) and
``slots`` is a view, never a copy. Front edits (import before the shard, free of a prefix) copy
once; they happen at migration time only.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Shard", "UnknownRequest", "RequestBusy"]


class UnknownRequest(LookupError):
    """The node holds no shard of this request."""


class RequestBusy(RuntimeError):
    """The request is part of an in-flight step; the operation must wait until it finishes."""


class Shard:
    """Positions ``start .. start+length-1`` of one request on one node.

    ``pending`` counts the tail positions appended by the in-flight step whose K/V is not yet
    written in every layer; ``step`` is that step's id (None when the request is idle). Only the
    written part ``[start, written_end)`` may be exported or forked.
    """

    __slots__ = ("start", "length", "pending", "step", "_buf")

    def __init__(self, start: int, slots: np.ndarray) -> None:
        self.start = int(start)
        self._buf = np.array(slots, dtype=np.int64)  # owned copy
        self.length = int(self._buf.size)
        self.pending = 0
        self.step: int | None = None

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self.length

    @property
    def written_end(self) -> int:
        """One past the last position whose K/V is written in every layer."""
        return self.end - self.pending

    @property
    def slots(self) -> np.ndarray:
        """Slots of positions ``start .. end-1`` (a view; do not keep across edits)."""
        return self._buf[: self.length]

    def slots_of(self, start: int, end: int) -> np.ndarray:
        """Slots of positions ``start .. end-1`` (a view; the range must lie in the shard)."""
        return self._buf[start - self.start: end - self.start]

    def append(self, new: np.ndarray) -> None:
        """Extend at the back with the slots of positions ``end ..``."""
        n = int(new.size)
        if self.length + n > self._buf.size:
            grown = np.empty(max(2 * self._buf.size, self.length + n, 16), dtype=np.int64)
            grown[: self.length] = self._buf[: self.length]
            self._buf = grown
        self._buf[self.length: self.length + n] = new
        self.length += n

    def prepend(self, new: np.ndarray) -> None:
        """Extend at the front with the slots of positions ``start - len(new) .. start-1``."""
        self._buf = np.concatenate([np.asarray(new, dtype=np.int64), self.slots])
        self.start -= int(new.size)
        self.length = int(self._buf.size)

    def drop_back(self, n: int) -> np.ndarray:
        """Remove the last ``n`` positions; returns their slots (a copy)."""
        out = self._buf[self.length - n: self.length].copy()
        self.length -= n
        self.pending = min(self.pending, self.length)
        return out

    def drop_front(self, n: int) -> np.ndarray:
        """Remove the first ``n`` positions; returns their slots (a copy)."""
        out = self._buf[:n].copy()
        self._buf = self._buf[n: self.length].copy()
        self.start += n
        self.length -= n
        return out
