"""Pre-launched slices: a replica enqueues slice k+1 before layer k's attention has come back.

Lamina §5.3: with compute on a GPU and memory nodes elsewhere, the CPU should not stand
between an attention result and the next slice. After a replica sends layer k's ATTENDs, it
reserves a device buffer for the attention output and enqueues, on the micro-batch's own CUDA
stream, a wait on that slot's :class:`~lamina.computenode.device_wait.DeviceFlag` followed by
all of slice k+1 (reading the buffer). The slice's kernels (or its CUDA graph) are then queued
on the GPU while the memory nodes work. When the results arrive, :meth:`Polling.land` copies
the merged output into the buffer and moves the flag: the GPU starts the slice at once.

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


class Polling:
    """CUDA streams and device flags per micro-batch slot (module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.index = self.device.index or 0
        if (why := unavailable(self.device)) is not None:
            raise RuntimeError(why)
        self.flags: dict[int, Any] = {}
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.copy_stream = torch.cuda.Stream(self.device)
        self.counts: dict[int, int] = {}

    def _slot(self, slot: int) -> None:
        if slot not in self.flags:
            from lamina.computenode.device_wait import DeviceFlag

            self.flags[slot] = DeviceFlag(self.index)
            self.streams[slot] = torch.cuda.Stream(self.device)
            self.counts[slot] = 0

    def stream(self, slot: int):
        """Context in which a micro-batch's GPU work is enqueued."""
        self._slot(slot)
        return torch.cuda.stream(self.streams[slot])

    def prelaunch(self, slot: int, like: torch.Tensor, run: Callable[[torch.Tensor], Any]) -> Prelaunched:
        """Reserve ``o`` shaped like ``like`` (q: ``[T,H,D]``), enqueue the flag wait and
        ``run(o)`` on ``slot``'s stream; returns at once."""
        self._slot(slot)
        self.counts[slot] += 1
        with self.stream(slot):
            buffer = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            self.flags[slot].wait(self.counts[slot], self.streams[slot])
            return Prelaunched(slot, buffer, self.counts[slot], run(buffer))

    def land(self, p: Prelaunched, o: torch.Tensor) -> Any:
        """Copy the merged attention output ``o`` into ``p``'s buffer and release the slice;
        returns its outputs (computed, or being computed, on the slot's stream)."""
        _check(p, o)
        with torch.cuda.stream(self.copy_stream):
            p.buffer.copy_(o, non_blocking=True)
        self.copy_stream.synchronize()  # the data is in place before the flag moves
        flag = self.flags[p.slot]
        flag.set(p.target)
        if flag.timed_out:  # the slice already ran on an unfilled buffer: never hand it on
            raise RuntimeError(f"device-side polling: a wait on slot {p.slot} gave up before its "
                               "attention output landed; the pre-launched slice is void")
        return p.outputs

    def release(self, p: Prelaunched) -> None:
        """Move the flag past a pre-launched slice whose micro-batch was dropped, so its stream
        goes on (the slice runs on an unfilled buffer; nobody reads its outputs)."""
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


def make_polling(mode: str, device: torch.device | str) -> Polling | EmulatedPolling | None:
    """``off`` -> None, ``cuda`` -> :class:`Polling` (raises where it cannot run),
    ``emulated`` -> :class:`EmulatedPolling`."""
    if mode == "off":
        return None
    if mode == "cuda":
        return Polling(device)
    if mode == "emulated":
        return EmulatedPolling(device)
    raise ValueError(f"device_polling must be off, cuda or emulated; got {mode!r}")
