"""Devices a role owns: ``cpu`` (no pinning), ``cpu:0``, ``cpu:1-7``,
``cpu:0,2,4-5`` (these cores), ``cuda`` / ``cuda:0`` (that GPU).

A role that owns cores pins itself to them (``sched_setaffinity``) and sizes torch's thread
pool (OpenMP) to exactly that many (:func:`own_cores`); two roles never share a core unless
told to. Several memory nodes on one ``memory_device`` split its cores (:func:`split`). With
no cores named, roles out of the engine's process get disjoint cores whenever the host has
enough (:func:`default_cores`).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Device:
    """``kind`` ``cpu`` or ``cuda``; ``index`` the GPU; ``cores`` the CPU cores owned (None:
    not pinned)."""

    kind: str
    index: int | None = None
    cores: tuple[int, ...] | None = None

    @property
    def torch(self) -> str:
        """The torch device string (``cpu``, ``cuda:0``)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index or 0}"

    def __str__(self) -> str:
        if self.kind == "cuda":
            return self.torch
        return "cpu" if self.cores is None else f"cpu:{_ranges(self.cores)}"


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def parse(spec: str | Device) -> Device:
    """A :class:`Device` from its string; ValueError naming what is wrong (unknown kind, a core
    this process may not use, a GPU that is not there)."""
    if isinstance(spec, Device):
        return spec
    s = str(spec).strip().lower()
    kind, _, rest = s.partition(":")
    if kind == "cuda":
        index = int(rest) if rest.isdigit() else 0 if not rest else None
        if index is None:
            raise ValueError(f"device {spec!r}: expected cuda or cuda:N")
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} needs a CUDA GPU, and none is visible here "
                             f"(use cpu, cpu:N or cpu:A-B)")
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} GPU(s) here")
        return Device("cuda", index)
    if kind != "cpu":
        raise ValueError(f"device {spec!r}: expected cpu, cpu:N, cpu:A-B, cuda or cuda:N")
    if not rest:
        return Device("cpu")
    cores = _parse_cores(rest, spec)
    missing = sorted(set(cores) - set(available_cores()))
    if missing:
        raise ValueError(f"device {spec!r}: core(s) {missing} are not available to this "
                         f"process (available: {_ranges(available_cores())})")
    return Device("cpu", cores=cores)


def split(device: Device, n: int) -> list[Device]:
    """``n`` roles on ``device``: its cores in ``n`` contiguous shares (roles share cores only
    when there are fewer cores than roles); unpinned and CUDA devices are shared as they are."""
    if device.cores is None or device.kind != "cpu":
        return [device] * n
    cores = device.cores
    if len(cores) < n:
        return [Device("cpu", cores=(cores[i % len(cores)],)) for i in range(n)]
    base, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append(Device("cpu", cores=cores[start:start + size]))
        start += size
    return out


def default_cores(compute: int, memory: int) -> tuple[Device, Device]:
    """Compute and memory devices for roles out of the engine's process when none were named:
    the available cores split between the roles in proportion to their number (compute first),
    so the two sides are disjoint whenever there are at least two cores; one core is shared."""
    cores = available_cores()
    if len(cores) < 2:
        return Device("cpu", cores=cores), Device("cpu", cores=cores)
    n_compute = max(1, min(len(cores) - 1, round(len(cores) * compute / (compute + memory))))
    return (Device("cpu", cores=cores[:n_compute]), Device("cpu", cores=cores[n_compute:]))


def exclusive(devices: list[Device]) -> list[bool]:
    """Whether each device names CPU cores that no other device of the list shares."""
    out = []
    for i, d in enumerate(devices):
        mine = set(d.cores or ())
        others = {c for j, e in enumerate(devices) if j != i for c in (e.cores or ())}
        out.append(d.kind == "cpu" and bool(mine) and not mine & others)
    return out


@dataclass(frozen=True)
class CallerState:
    """What :func:`own_cores` changes in a process: its CPU affinity and torch's intra-op thread
    count. An in-process deployment pins the process that created it; it saves this first and
    :meth:`restore` puts it back when it closes, so its caller is left as it was found."""

    cores: frozenset[int]
    threads: int

    @classmethod
    def save(cls) -> "CallerState":
        return cls(frozenset(os.sched_getaffinity(0)), torch.get_num_threads())

    def restore(self) -> None:
        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(self.threads)


def own_cores(cores: tuple[int, ...] | list[int] | None, threads: int | None = None) -> int:
    """Pin the calling process to ``cores`` and size torch's thread pool to them (or to
    ``threads``); returns the thread count. ``None``: no pinning, ``threads`` (default 1)."""
    if cores:
        os.sched_setaffinity(0, set(cores))
        n = threads or len(cores)
    else:
        n = threads or 1
    torch.set_num_threads(n)
    return n


def _parse_cores(text: str, spec: str) -> tuple[int, ...]:
    cores: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b) if b else int(a)
            if lo < 0 or hi < lo:
                raise ValueError
            cores.extend(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"device {spec!r}: cores must look like 0, 1-7 or 0,2,4-5") from None
    return tuple(sorted(set(cores)))


def _ranges(cores: tuple[int, ...]) -> str:
    out, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64, arm64 with 4 KB base pages)


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype, commit: str = "now",
                    advise: bool = True) -> torch.Tensor:
    """Zeros on the CPU in memory the kernel backs with transparent huge pages where it allows
    (THP in ``madvise`` mode needs this advice; ``always`` gives them anyway; ``never``: 4 KB
    pages as before): for memory a role streams through every step. A KV pool read at random
    slots misses the TLB on nearly every slab with 4 KB pages (in a VM each miss is a
    two-level walk) and the hardware prefetcher stops at every 4 KB boundary.

    ``commit``: ``now`` touches every page here, so the memory is committed now, as with
    ``torch.zeros`` (which this falls back to below one huge page or where the advice is
    refused); ``background``: a thread faults the pages in without writing them
    (:func:`populate`), so the caller goes on at once and may use the memory meanwhile; ``lazy``:
    each page on its first use (for memory the caller writes whole right away). ``advise=False``:
    the same mapping without the huge-page advice, for the caller to give it once written
    (:func:`advise_huge_pages`)."""
    if commit not in ("now", "background", "lazy"):
        raise ValueError(f"commit must be now, background or lazy; got {commit!r}")
    numel = math.prod(int(n) for n in shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(tuple(shape), dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advise:
            buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(tuple(shape), dtype=dtype)
    out = torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(shape))  # holds buf
    if commit == "now":
        return out.zero_()  # fault every page in now (as huge pages where the kernel has them)
    if commit == "background":
        t = threading.Thread(target=populate, args=(out, True), daemon=True,
                             name="lamina-populate")
        _populating[:] = [p for p in _populating if p.is_alive()]  # no dead threads kept
        _populating.append(t)
        t.start()
    return out  # an anonymous mapping reads as zeros


_populating: list[threading.Thread] = []  # this process's background commits (huge_page_zeros)


def wait_populated(timeout: float | None = None) -> bool:
    """Wait until every ``commit="background"`` allocation of this process is committed (for a
    measurement of steady state: until then a first write to a page faults it in, ~0.1 ms a
    huge page). True when all are; False where ``timeout`` (seconds, overall) ran out first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in list(_populating):
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            return False
        _populating.remove(t)
    return True


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, leaving their contents


POPULATE_CHUNK = 2 << 20  # bytes per madvise call of populate: one huge page


def populate(t: torch.Tensor, background: bool = False) -> bool:
    """Fault the pages of CPU tensor ``t`` in, writable, without writing them (safe while
    others use ``t``); False where the kernel cannot (before Linux 5.14, or not Linux): the
    pages then fault in on first use. Chunk by chunk (:data:`POPULATE_CHUNK`): each madvise
    holds the process's memory-map lock, which every ``mmap`` of another thread (an
    allocation, a library loaded, a ring) waits for, and a huge page's fault may compact
    memory first (slow where free memory is fragmented, as right after an export). ``background``: the calling thread (a
    ``lamina-populate`` thread) first lowers its own priority, so that a start's other work
    (its own threads', other role processes') goes first on a shared core."""
    if background:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
        except (OSError, AttributeError):
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    start, end = addr - addr % mmap.PAGESIZE, addr + n
    while start < end:
        size = min(POPULATE_CHUNK - start % POPULATE_CHUNK, end - start)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), MADV_POPULATE_WRITE):
            return False
        start += size
    return True


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the whole huge pages inside CPU tensor ``t`` for transparent huge pages, after
    the caller wrote it with 4 KB pages: khugepaged then collapses them in the background (with
    its defaults ~16 MB every 10 s), where a fault in an advised region may compact memory
    synchronously (seconds for a few hundred MB on a host whose free memory is fragmented).
    False where the kernel refuses or ``t`` spans no whole huge page."""
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + n) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                        mmap.MADV_HUGEPAGE) == 0
