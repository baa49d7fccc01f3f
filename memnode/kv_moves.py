"""A memory node's KV moves: a shard's positions exported, imported, freed in part, or shared
by reference (borrowing, recovery, prefix caching). A mixin of
:class:`~lamina.memnode.node.MemoryNode`, whose state it edits (``_shards``, ``allocator``,
``pool``, ``specs``, ``free``); the contract (written parts only, busy requests refused, nothing
changed on an error) is the node module's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from lamina.memnode.shard import RequestBusy, Shard, UnknownRequest
from lamina.types import KVChunk

if TYPE_CHECKING:
    from lamina.memnode.allocator import SlabAllocator
    from lamina.memnode.kv_pool import KVPool
    from lamina.types import AttentionSpec

__all__ = ["KVMoves"]


class KVMoves:
    """Export / import / free a range / share, on a node's shards (see the module docstring)."""

    _shards: dict[int, Shard]
    allocator: "SlabAllocator"
    pool: "KVPool"
    specs: "list[AttentionSpec]"

    def free_range(self, req_id: int, start: int, end: int) -> None:
        """Free positions ``[start, end)``: a prefix or suffix of the request's shard (or all)."""
        sh = self._idle_shard(req_id)
        if not (sh.start <= start < end <= sh.end) or (start != sh.start and end != sh.end):
            raise ValueError(f"request {req_id}: [{start}, {end}) is not a non-empty prefix or "
                             f"suffix of its shard [{sh.start}, {sh.end})")
        if end - start == sh.length:
            self.free([req_id])
        elif start == sh.start:
            self.allocator.free(sh.drop_front(end - start))
        else:
            self.allocator.free(sh.drop_back(end - start))

    def export(self, req_id: int, start: int, end: int) -> KVChunk:
        """Copy the request's K/V of positions ``[start, end)``, all layers: ``k/v[L, n, Hkv, D]``
        as the pool stores them, with their scales for an 8-bit format."""
        sh = self._shards.get(req_id)
        if sh is None:
            raise UnknownRequest(f"request {req_id} is not held by this node")
        if not sh.start <= start <= end <= sh.written_end:
            raise ValueError(f"request {req_id}: [{start}, {end}) is not inside the written part "
                             f"[{sh.start}, {sh.written_end}) of its shard")
        k, v, k_scale, v_scale = self.pool.gather(sh.slots_of(start, end))
        return KVChunk(req_id, start, k, v, k_scale, v_scale)

    def import_kv(self, chunk: KVChunk) -> None:
        """Store ``chunk`` as a new shard, or extend the request's shard at its back or front.

        Raises ValueError (shape/position), RequestBusy or OutOfSlots; then nothing changed.
        """
        n = int(chunk.k.shape[1]) if chunk.k.ndim == 4 else -1
        want = (len(self.specs), n, self.pool.num_kv_heads, self.pool.head_dim)
        if n < 0 or tuple(chunk.k.shape) != want or tuple(chunk.v.shape) != want:
            raise ValueError(f"chunk k/v must be [L, n, Hkv, D] = {want}, got "
                             f"{tuple(chunk.k.shape)} and {tuple(chunk.v.shape)}")
        if chunk.start_pos < 0:
            raise ValueError(f"chunk start_pos must be >= 0, got {chunk.start_pos}")
        if n == 0:
            return
        start, end = chunk.start_pos, chunk.start_pos + n
        sh = self._shards.get(chunk.req_id)
        if sh is not None:
            if sh.step is not None:
                raise RequestBusy(f"request {chunk.req_id} is in step {sh.step}")
            if start != sh.end and end != sh.start:
                raise ValueError(f"request {chunk.req_id}: chunk [{start}, {end}) is not adjacent "
                                 f"to its shard [{sh.start}, {sh.end})")
        slots = self.allocator.alloc(n)
        try:
            self.pool.scatter(slots, chunk.k, chunk.v, k_scale=chunk.k_scale,
                              v_scale=chunk.v_scale)
        except ValueError:
            self.allocator.free(slots)
            raise
        if sh is None:
            self._shards[chunk.req_id] = Shard(start, slots)
        elif start == sh.end:
            sh.append(slots)
        else:
            sh.prepend(slots)

    def share(self, dst: int, parts: Sequence[tuple[int, int, int]]) -> None:
        """New shard ``dst`` (not held here) with one more reference to the slots of ``parts =
        [(src, start, end), ...]``: consecutive ranges, each in the written part of shard
        ``src`` (prefix caching: a request starting on a cached prefix; a new cache entry)."""
        parts = [(int(r), int(a), int(b)) for r, a, b in parts]
        if not parts or dst in self._shards:
            raise ValueError(f"share into {dst}: no parts, or {dst} is held here already")
        for i, (src, a, b) in enumerate(parts):
            sh = self._shards.get(src)
            if sh is None:
                raise UnknownRequest(f"share into {dst}: shard {src} is not held by this node")
            if not sh.start <= a < b <= sh.written_end or (i and a != parts[i - 1][2]):
                raise ValueError(f"share into {dst}: {parts} are not consecutive ranges inside "
                                 f"the written part [{sh.start}, {sh.written_end}) of {src}")
        slots = np.concatenate([self._shards[r].slots_of(a, b) for r, a, b in parts])
        self.allocator.fork(slots)
        self._shards[dst] = Shard(parts[0][1], slots)

    def _idle_shard(self, req_id: int) -> Shard:
        sh = self._shards.get(req_id)
        if sh is None:
            raise UnknownRequest(f"request {req_id} is not held by this node")
        if sh.step is not None:
            raise RequestBusy(f"request {req_id} is in step {sh.step}")
        return sh
