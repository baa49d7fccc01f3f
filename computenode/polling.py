"""Pre-launched slices: a replica enqueues slice k+1 before layer k's attention has come back.

Lamina §5.3: with compute on a GPU and memory nodes elsewhere, the CPU should not stand
between an attention result and the next slice. After a replica sends layer k's ATTENDs, it
reserves a device buffer for the attention output and enqueues, on the micro-batch's own CUDA
stream, a wait on that slot's :class:`~lamina.computenode.device_wait.DeviceFlag`, a copy from
the slot's pinned host staging buffer into the device buffer, and all of slice k+1 (reading the
buffer). The slice's kernels are then queued on the GPU while the memory nodes work. When the
results arrive, :meth:`Polling.land` writes the merged output into the staging buffer (a plain
host copy) and moves the flag: the GPU copies it in and starts the slice at once.

Landing makes no CUDA call. Some CUDA calls the host makes while a wait is pending block until
that wait ends (measured on an H100: an H2D copy from pageable memory on the waiting stream, a
mapped host allocation, the first launch of a kernel whose module is not loaded; a synchronize
of the waiting stream, by definition); the thread that would move the flag would then never
get there, and the wait would run into its timeout. So everything that allocates happens
before the first wait: flags, streams and staging for every slot (``slots`` micro-batches of
up to ``max_tokens`` tokens) are made at the first :meth:`Polling.prelaunch`. One staging
buffer per slot is enough: layer k's results cannot arrive before layer k's q was read back to
the host, which needs the slice that consumed layer k-1's staged output (a data dependency,
not a timing one).

Lazy module loading (CUDA's default since 12.2) is such a call: the first launch of a kernel
loads its module, which can synchronize the context, so a slice launched behind a wait would
block the host until the wait gives up (seen on an H100: ``scripts/polling_probe.py``; the CUDA
programming guide's lazy-loading hazards describe the same). A polling replica therefore runs
with ``CUDA_MODULE_LOADING=EAGER`` (:func:`eager_module_loading`, before CUDA starts).

One stream per micro-batch slot, so a slot parked on its flag never holds up another slot's
work; per slot, layers land in order (flag values only grow). Everything a micro-batch does
on the GPU (slices, sampling, the copies that send q/k/v) runs on its slot's stream
(:meth:`Polling.stream`).

:class:`Polling` is the CUDA implementation (needs cupy and host-mapped memory:
:func:`~lamina.computenode.device_wait.unavailable`); :class:`EmulatedPolling` is its CPU
stand-in, which keeps the pre-launched slice as a closure and runs it at :meth:`land`, so the
replica's bookkeeping (what is pre-launched, what lands where, errors) runs in CI.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Prelaunched:
    """One slice enqueued ahead of its attention output: ``buffer`` (``o[T,H,Dv]`` on the
    device) receives the output, ``target`` is the flag value that releases the slice;
    ``outputs`` are the slice's (``SplitModel.advance``) results, valid once landed."""

    slot: int
    buffer: torch.Tensor
    target: int
    outputs: Any = None
    run: Callable[[torch.Tensor], Any] | None = field(default=None, repr=False)


def unavailable(device: torch.device | str) -> str | None:
    """Why :class:`Polling` cannot run for a replica on ``device`` (None: it can)."""
    from lamina.computenode.device_wait import unavailable as flag_unavailable

    device = torch.device(device)
    if device.type != "cuda":
        return f"device-side polling needs a CUDA compute device; the replica runs on {device}"
    return flag_unavailable(device.index or 0)


def eager_module_loading() -> None:
    """Make this process load every CUDA module when its context starts: sets
    ``CUDA_MODULE_LOADING=EAGER`` if CUDA has not started yet, else raises unless it was set."""
    if os.environ.get("CUDA_MODULE_LOADING") == "EAGER":
        return
    if torch.cuda.is_initialized():
        raise RuntimeError("device-side polling needs CUDA_MODULE_LOADING=EAGER before CUDA starts "
                           "in the replica's process (a lazily loaded kernel launched behind a "
                           "pending flag wait blocks the host until the wait gives up)")
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


class Polling:
    """CUDA streams, device flags and pinned staging per micro-batch slot (module docstring).
    ``slots``: micro-batch slots (0..slots-1); ``max_tokens``: the most tokens one micro-batch
    carries (the scheduler's ``max_num_batched_tokens``)."""

    def __init__(self, device: torch.device | str, slots: int = 1, max_tokens: int = 0) -> None:
        self.device = torch.device(device)
        self.index = self.device.index or 0
        if (why := unavailable(self.device)) is not None:
            raise RuntimeError(why)
        eager_module_loading()
        self.slots, self.max_tokens = slots, max_tokens
        self.flags: dict[int, Any] = {}
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.staging: dict[int, torch.Tensor] = {}  # slot -> pinned host bytes
        self.counts: dict[int, int] = {}

    def _allocate(self, like: torch.Tensor) -> None:
        """Flags, streams and staging for every slot, sized from the first q (``[T,H,D]``):
        called before the first wait, so no allocation ever waits behind one."""
        from lamina.computenode.device_wait import DeviceFlag

        row = like[0].numel() * like.element_size()
        tokens = max(self.max_tokens, like.shape[0])
        for slot in range(self.slots):
            self.flags[slot] = DeviceFlag(self.index)
            self._stream(slot)  # slice 0 may already have run on it
            self.staging[slot] = torch.empty(tokens * row, dtype=torch.uint8, pin_memory=True)
            self.counts[slot] = 0

    def _stream(self, slot: int) -> torch.cuda.Stream:
        if slot not in self.streams:  # before the first prelaunch: nothing is waiting yet
            self.streams[slot] = torch.cuda.Stream(self.device)
        return self.streams[slot]

    def stream(self, slot: int):
        """Context in which a micro-batch's GPU work is enqueued."""
        return torch.cuda.stream(self._stream(slot))

    def _staged(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """``slot``'s staging bytes viewed as a tensor shaped like ``like``."""
        nbytes = like.numel() * like.element_size()
        staging = self.staging[slot]
        if nbytes > staging.numel():
            raise ValueError(f"device-side polling: a {like.shape[0]}-token micro-batch does not fit "
                             f"the staging buffer sized for {self.max_tokens} tokens")
        return staging[:nbytes].view(like.dtype).view(like.shape)

    def prelaunch(self, slot: int, like: torch.Tensor, run: Callable[[torch.Tensor], Any]) -> Prelaunched:
        """Reserve ``o`` shaped like ``like`` (q: ``[T,H,D]``), enqueue the flag wait, the copy
        from staging and ``run(o)`` on ``slot``'s stream; returns at once."""
        if not self.flags:
            self._allocate(like)
        if slot not in self.flags:
            raise ValueError(f"micro-batch slot {slot} out of range: polling has {self.slots} slots")
        staged = self._staged(slot, like)  # raises before anything is enqueued
        self.counts[slot] += 1
        with self.stream(slot):
            buffer = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            self.flags[slot].wait(self.counts[slot], self.streams[slot])
            buffer.copy_(staged, non_blocking=True)  # pinned: a DMA queued behind the wait
            return Prelaunched(slot, buffer, self.counts[slot], run(buffer))

    def land(self, p: Prelaunched, o: torch.Tensor) -> Any:
        """Write the merged attention output ``o`` (host memory, as received) into ``p``'s
        staging and release the slice; returns its outputs (being computed on the slot's
        stream). No CUDA call."""
        _check(p, o)
        if o.device.type != "cpu":
            raise ValueError(f"device-side polling lands attention outputs from host memory; got {o.device}")
        self._staged(p.slot, p.buffer).copy_(o)  # converts a dtype on the host
        flag = self.flags[p.slot]
        flag.set(p.target)  # a release: the staged bytes are visible before the flag moves
        if flag.timed_out:  # the slice already ran on an unfilled buffer: never hand it on
            flag.clear_timed_out()
            raise RuntimeError(f"device-side polling: a wait on slot {p.slot} gave up before its "
                               "attention output landed; the pre-launched slice is void")
        return p.outputs

    def release(self, p: Prelaunched) -> None:
        """Move the flag past a pre-launched slice whose micro-batch was dropped, so its stream
        goes on (the slice runs on stale staging; nobody reads its outputs)."""
        self.flags[p.slot].set(max(p.target, self.flags[p.slot].value))

    def close(self) -> None:
        for f in self.flags.values():
            f.close()


class EmulatedPolling:
    """CPU stand-in for :class:`Polling`: ``prelaunch`` keeps ``run`` and ``land`` runs it
    on the filled buffer (the order a released stream would run it in)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.counts: dict[int, int] = {}
        self.landed = 0  # slices released by land (for tests)

    def stream(self, slot: int):
        return contextlib.nullcontext()

    def prelaunch(self, slot: int, like: torch.Tensor, run: Callable[[torch.Tensor], Any]) -> Prelaunched:
        self.counts[slot] = self.counts.get(slot, 0) + 1
        buffer = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return Prelaunched(slot, buffer, self.counts[slot], run=run)

    def land(self, p: Prelaunched, o: torch.Tensor) -> Any:
        _check(p, o)
        p.buffer.copy_(o)
        self.landed += 1
        return p.run(p.buffer)

    def release(self, p: Prelaunched) -> None:
        pass

    def close(self) -> None:
        pass


def _check(p: Prelaunched, o: torch.Tensor) -> None:
    if o.shape != p.buffer.shape:
        raise ValueError(f"attention output {tuple(o.shape)} does not fit the pre-launched slice's "
                         f"buffer {tuple(p.buffer.shape)} (value head dim differs from q's?)")


def make_polling(mode: str, device: torch.device | str, slots: int = 1,
                 max_tokens: int = 0) -> Polling | EmulatedPolling | None:
    """``off`` -> None, ``cuda`` -> :class:`Polling` (raises where it cannot run),
    ``emulated`` -> :class:`EmulatedPolling`."""
    if mode == "off":
        return None
    if mode == "cuda":
        return Polling(device, slots, max_tokens)
    if mode == "emulated":
        return EmulatedPolling(device)
    raise ValueError(f"device_polling must be off, cuda or emulated; got {mode!r}")
