"""The KV pool of one memory node: per-layer K and V tensors on one device.

Layout: ``k_cache[L, S, Hkv, D]`` and ``v_cache`` alike, one allocation each, in the storage of
the pool's KV format (:mod:`lamina.kernels.kv_format`); an 8-bit part has ``k_scale[L, S, Hkv]``
(or ``v_scale``) float32 beside it. ``k(layer)`` is the contiguous ``[S, Hkv, D]`` view that
:func:`lamina.kernels.paged_attention` reads, ``scales(layer)`` its scales. Slot ``s``
of every layer belongs to the same token; which slots are live is the allocator's business
(:mod:`lamina.memnode.allocator`), not the pool's: the pool only moves bytes.

Slot indices may be numpy arrays, lists or int tensors on any device; they are moved to the
pool's device. Tensors written into the pool are copied (cast, or quantised, to the pool's
format); tensors read out (:meth:`KVPool.gather`) are new tensors owned by the caller.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from lamina.device import huge_page_zeros
from lamina.kernels import cpp_ext
from lamina.kernels.kv_format import KVFormat, kv_format

__all__ = ["KVPool", "available_memory"]


def available_memory(device: torch.device | str = "cpu") -> int:
    """Free bytes on ``device``: ``torch.cuda.mem_get_info`` on CUDA, MemAvailable on CPU hosts.

    On CPU it reads ``/proc/meminfo`` (Linux) and falls back to
    ``os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise ValueError(f"cannot measure free memory on device type {device.type!r}")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


class KVPool:
    """K/V storage for ``num_layers`` attention layers, ``capacity_slots`` tokens each, in the
    KV format ``fmt`` (:mod:`lamina.kernels.kv_format`: a format, its name, or a float dtype)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_slots: int,
                 fmt: KVFormat | str | torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if min(num_layers, num_kv_heads, head_dim) <= 0 or capacity_slots < 0:
            raise ValueError(f"bad pool shape: layers={num_layers} kv_heads={num_kv_heads} "
                             f"head_dim={head_dim} capacity={capacity_slots}")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.capacity = int(capacity_slots)
        self.fmt = kv_format(fmt)
        self.device = torch.device(device)
        shape = (self.num_layers, self.capacity, self.num_kv_heads, self.head_dim)

        def alloc(shape, dtype):
            if self.device.type == "cpu":  # in huge pages: slots are read at random
                # committed in the background: a node answers its first PING without waiting
                return huge_page_zeros(shape, dtype, commit="background")
            return torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_cache = alloc(shape, self.fmt.k.storage)
        self.v_cache = alloc(shape, self.fmt.v.storage)
        # float32 [L, S, Hkv] per 8-bit part (None for a float one)
        self.k_scale = alloc(shape[:3], torch.float32) if self.fmt.k.scaled else None
        self.v_scale = alloc(shape[:3], torch.float32) if self.fmt.v.scaled else None
        # the C++ quantised append, resolved once (None: the torch reference quantises)
        ext = cpp_ext.load() if self.device.type == "cpu" and self.fmt.scaled else None
        self._kv_store = ext.kv_store if ext is not None else None

    # -- sizing -------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_slot_for(num_layers: int, num_kv_heads: int, head_dim: int,
                           fmt: KVFormat | str | torch.dtype) -> int:
        """Bytes one token occupies over all layers, K and V (and their scales)."""
        return num_layers * num_kv_heads * kv_format(fmt).bytes_per_token_head(head_dim)

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_slot_for(self.num_layers, self.num_kv_heads, self.head_dim,
                                       self.fmt)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_slot

    @classmethod
    def capacity_for_bytes(cls, budget_bytes: int, num_layers: int, num_kv_heads: int,
                           head_dim: int, fmt: KVFormat | str | torch.dtype = torch.float32,
                           slab_size: int = 1) -> int:
        """Most slots that fit in ``budget_bytes``, rounded down to a multiple of ``slab_size``."""
        per = cls.bytes_per_slot_for(num_layers, num_kv_heads, head_dim, fmt)
        slots = max(0, int(budget_bytes)) // per
        return slots - slots % max(1, slab_size)

    @classmethod
    def from_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    fmt: KVFormat | str | torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", slab_size: int = 1) -> "KVPool":
        """A pool using at most ``budget_bytes`` (capacity a multiple of ``slab_size``)."""
        cap = cls.capacity_for_bytes(budget_bytes, num_layers, num_kv_heads, head_dim, fmt,
                                     slab_size)
        return cls(num_layers, num_kv_heads, head_dim, cap, fmt, device)

    @classmethod
    def from_free_memory(cls, fraction: float, num_layers: int, num_kv_heads: int,
                         head_dim: int, fmt: KVFormat | str | torch.dtype = torch.float32,
                         device: torch.device | str = "cpu", slab_size: int = 1,
                         reserve_bytes: int = 0) -> "KVPool":
        """A pool taking ``fraction`` of the device's free memory minus ``reserve_bytes``."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        budget = int((available_memory(device) - reserve_bytes) * fraction)
        return cls.from_budget(budget, num_layers, num_kv_heads, head_dim, fmt, device,
                               slab_size)

    # -- access -------------------------------------------------------------------------------
    def k(self, layer: int) -> torch.Tensor:
        """K of one layer, ``[S, Hkv, D]`` in the format's K dtype (a view into the pool)."""
        return self.fmt.k.view(self.k_cache[layer])

    def v(self, layer: int) -> torch.Tensor:
        """V of one layer, ``[S, Hkv, D]`` in the format's V dtype (a view into the pool)."""
        return self.fmt.v.view(self.v_cache[layer])

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The scales of one layer's 8-bit parts, ``[S, Hkv]`` float32 views, as the kernels'
        keyword arguments (``k_scale``, ``v_scale``; empty for a float pool)."""
        return {name: s[layer] for name, s in (("k_scale", self.k_scale),
                                               ("v_scale", self.v_scale)) if s is not None}

    def index(self, slots) -> torch.Tensor:
        """``slots`` as an int64 tensor on the pool's device, range-checked."""
        if isinstance(slots, torch.Tensor):
            idx = slots.to(device=self.device, dtype=torch.int64)
        else:
            idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)
        if idx.ndim != 1:
            raise ValueError(f"slots must be 1-D, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.capacity):
            raise IndexError(f"slots out of range [0, {self.capacity})")
        return idx

    def store_kv(self, layer: int, slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k/v[n, Hkv, D]`` (float values) of one layer into ``slots[n]``, quantised
        where the format says so.

        An int64 tensor on the pool's device is taken as is (no range check, which would cost a
        device sync on CUDA): that is how :class:`MemoryNode` passes slots it allocated.
        """
        idx = slots if _is_index(slots, self.device) else self.index(slots)
        want = (idx.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {layer}: k/v must be {want}, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        for part, data, scale, x in ((self.fmt.k, self.k_cache, self.k_scale, k),
                                     (self.fmt.v, self.v_cache, self.v_scale, v)):
            x = x.to(self.device)
            if self._kv_store is not None and part.scaled:  # in place, the bytes of below
                self._kv_store(part.view(data[layer]), scale[layer], idx, x)
                continue
            q, s = part.quantize(x)
            data[layer].index_copy_(0, idx, q)
            if s is not None:
                scale[layer].index_copy_(0, idx, s)

    def gather(self, slots, layers: Sequence[int] | range | None = None) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Copies of K and V at ``slots[n]`` for ``layers`` (all by default) as stored:
        ``k/v[len(layers), n, Hkv, D]`` and their scales ``[len(layers), n, Hkv]`` (None for a
        float part)."""
        idx = self.index(slots)
        lay = torch.tensor(self._layers(layers), dtype=torch.int64, device=self.device)
        sel = (lay[:, None], idx[None, :])  # one advanced index: never copies whole layers
        return (self.k_cache[sel], self.v_cache[sel],
                None if self.k_scale is None else self.k_scale[sel],
                None if self.v_scale is None else self.v_scale[sel])

    def scatter(self, slots, k: torch.Tensor, v: torch.Tensor,
                layers: Sequence[int] | range | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather`: write ``k/v[len(layers), n, Hkv, D]`` into ``slots[n]``:
        as stored (with their scales) when they come in this pool's format, else float values,
        quantised where the format says so."""
        idx = self.index(slots)
        lay = self._layers(layers)
        want = (len(lay), idx.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
        for part, data, scale, x, xs in ((self.fmt.k, self.k_cache, self.k_scale, k, k_scale),
                                         (self.fmt.v, self.v_cache, self.v_scale, v, v_scale)):
            x = x.to(self.device)
            if xs is not None or (part.scaled and x.dtype == part.storage):
                if not part.scaled or xs is None or x.dtype != part.storage \
                        or tuple(xs.shape) != want[:3]:
                    raise ValueError(f"KV stored as {x.dtype} with scales "
                                     f"{None if xs is None else tuple(xs.shape)} does not fit a "
                                     f"{self.fmt.name} pool")
                q, s = x, xs.to(self.device, torch.float32)
            else:
                q, s = part.quantize(x)
            for i, layer in enumerate(lay):  # one vectorised copy per layer
                data[layer].index_copy_(0, idx, q[i])
                if s is not None:
                    scale[layer].index_copy_(0, idx, s[i])

    def _layers(self, layers) -> list[int]:
        lay = list(range(self.num_layers)) if layers is None else [int(x) for x in layers]
        if any(not 0 <= x < self.num_layers for x in lay):
            raise IndexError(f"layers {lay} out of range [0, {self.num_layers})")
        return lay


def _is_index(t, device: torch.device) -> bool:
    """True for an int64 tensor already on ``device`` (trusted, prepared by the caller)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device == device
