"""The shared-memory pieces under :class:`~lamina.transport.shm.ShmChannel`: channel specs,
one-direction byte rings in POSIX shared-memory segments (the ring protocol's memory,
:class:`~lamina.transport.ring.RingMemory`, with both ends mapping one segment), and their
doorbell FIFOs.

Segment layout: the protocol's (:mod:`lamina.transport.ring`): a 4096-byte control block of
u64 words then ``capacity`` data bytes; each side's pid lives in the block too. Naming,
attaching and unlinking rules are in :mod:`lamina.transport.shm`'s docstring.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import select
import stat
import tempfile
from dataclasses import asdict, dataclass, fields
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from lamina.transport.base import ChannelClosed
from lamina.transport.ring_memory import CAP, CTL_BYTES, MAGIC, RING_MAGIC, Bell, RingMemory

try:  # attach without registering with multiprocessing's resource tracker (see _Ring)
    import _posixshmem
except ImportError:  # pragma: no cover - not POSIX
    _posixshmem = None

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}")


def _pid_alive(pid: int) -> bool:
    """True unless process ``pid`` is gone or a zombie (Linux /proc; kill(0) elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_ = f.read()
        return stat_[stat_.rindex(b")") + 2:][:1] not in (b"Z", b"X", b"x")
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def default_bell_dir() -> str:
    """Where doorbell FIFOs go: ``/dev/shm`` (next to the segments) when it is a writable
    directory, else the temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


@dataclass(frozen=True)
class RingSpec:
    """One direction, derived from a :class:`ShmChannelSpec`: segment name, data capacity and
    the paths of its two doorbell FIFOs."""

    name: str
    capacity: int
    data_bell: str  # rung by the writer when the reader sleeps waiting for data
    space_bell: str  # rung by the reader when the writer sleeps waiting for space


@dataclass(frozen=True)
class ShmChannelSpec:
    """Everything a peer needs to attach, as plain data (picklable, JSON via :meth:`to_dict`).

    ``name``: base name; the segments are ``<name>_ab`` (side "a", the creator, writes) and
    ``<name>_ba``, the doorbells ``<bell_dir>/<name>_ab.data``, ``..._ab.space``,
    ``..._ba.data`` and ``..._ba.space``. ``capacity``: data bytes of each ring."""

    name: str
    capacity: int
    bell_dir: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"bad shm channel name {self.name!r}")
        if type(self.capacity) is not int or self.capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {self.capacity!r}")
        if not isinstance(self.bell_dir, str) or not os.path.isabs(self.bell_dir) \
                or "\0" in self.bell_dir:
            raise ValueError(f"bell_dir must be an absolute path, got {self.bell_dir!r}")

    def _ring(self, suffix: str) -> RingSpec:
        name = f"{self.name}_{suffix}"
        base = os.path.join(self.bell_dir, name)
        return RingSpec(name, self.capacity, base + ".data", base + ".space")

    @property
    def a_to_b(self) -> RingSpec:
        return self._ring("ab")

    @property
    def b_to_a(self) -> RingSpec:
        return self._ring("ba")

    def paths(self) -> list[str]:
        """Filesystem paths behind this spec: the segments (Linux ``/dev/shm``) and FIFOs."""
        return [p for r in (self.a_to_b, self.b_to_a)
                for p in (f"/dev/shm/{r.name}", r.data_bell, r.space_bell)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShmChannelSpec":
        """Inverse of :meth:`to_dict` (e.g. after ``json.loads``); checks keys and types."""
        if not isinstance(d, dict):
            raise ValueError(f"an shm channel spec must be a dict, got {type(d).__name__}")
        want = {f.name for f in fields(cls)}
        if set(d) != want:
            raise ValueError(f"shm channel spec keys {sorted(d)}, expected {sorted(want)}")
        return cls(**d)


class _Doorbell(Bell):
    """A named FIFO opened read-write and non-blocking: ``ring`` writes a byte, ``wait`` polls
    for one (and drains), ``drain`` drops pending rings."""

    def __init__(self, path: str, create: bool) -> None:
        self.path = path
        self.fd = -1
        if create:
            os.mkfifo(path, 0o600)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            if not stat.S_ISFIFO(os.fstat(self.fd).st_mode):
                raise ValueError(f"{path!r} is not a FIFO")
        except BaseException as exc:
            self.close(unlink=create)
            if isinstance(exc, FileNotFoundError):
                raise ChannelClosed(f"doorbell {path!r} is gone (creator closed)") from None
            raise
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def ring(self) -> None:
        try:
            os.write(self.fd, b"\x01")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float) -> None:
        """Block until rung or ``timeout`` seconds passed (consumes the pending rings)."""
        if self._poll.poll(max(1, math.ceil(timeout * 1000))):
            self.drain()

    def close(self, unlink: bool) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _prefault(buf: memoryview, write: bool) -> None:
    """Map every page of a segment now, one byte per page (written by the creator, whose new
    segment is zeros anyway; read by an attacher), so that the first pass of messages through
    a ring does not take a page fault per page on each side."""
    pages = np.frombuffer(buf, dtype=np.uint8)[::mmap.PAGESIZE]
    if write:
        pages[:] = 0
    else:
        int(pages.max())  # reads every page
    del pages


class _Ring(RingMemory):
    """A mapped ring segment: ``ctl`` (u64 control words), ``data`` (bytes) and doorbells. Both
    ends map the same segment: ``store`` is a plain store, ``publish`` nothing."""

    def __init__(self, spec: RingSpec, create: bool) -> None:
        self.spec = spec
        self.capacity = spec.capacity
        self.shm: SharedMemory | None = None
        self.mm: mmap.mmap | None = None
        self.bells: list[_Doorbell] = []
        self.owner_pid = os.getpid()
        size = CTL_BYTES + spec.capacity
        self.tracked = False  # registered with this process's multiprocessing resource tracker
        if create:  # the tracker unlinks the segment if we are killed before a peer attaches
            self.shm = SharedMemory(name=spec.name, create=True, size=size)
            self.tracked = True
            buf = self.shm.buf
        else:
            buf = self._attach(spec.name)
        _prefault(buf, write=create)
        self.ctl = buf[:CTL_BYTES].cast("Q")
        self.data = buf[CTL_BYTES:CTL_BYTES + spec.capacity]
        # addresses for the C++ fast path (valid while mapped: release() runs only under both
        # of the channel's locks, and the fast path is called only under one of them)
        self.ctl_addr = int(np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data)
        self.data_addr = self.ctl_addr + CTL_BYTES
        try:
            if create:  # a new segment is zero-filled
                self.ctl[CAP] = spec.capacity
                self.ctl[MAGIC] = RING_MAGIC
            elif len(buf) < size or self.ctl[MAGIC] != RING_MAGIC \
                    or self.ctl[CAP] != spec.capacity:
                raise ValueError(f"{spec.name!r} is not a Lamina ring of capacity {spec.capacity}")
            self.data_bell = self._bell(spec.data_bell, create)
            self.space_bell = self._bell(spec.space_bell, create)
        except BaseException:
            self.release(unlink=create)
            raise

    def _attach(self, name: str) -> memoryview:
        """Map an existing segment *without* registering it with multiprocessing's resource
        tracker (Python < 3.13 registers attachers too, and the tracker of a process that was
        not started by the creator would unlink the segment when that process exits)."""
        try:
            if _posixshmem is None:  # pragma: no cover
                self.shm = SharedMemory(name=name)
                self.tracked = True
                return self.shm.buf
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise ChannelClosed(f"shared memory {name!r} is gone (creator closed)") from None
        try:
            size = os.fstat(fd).st_size
            if size < CTL_BYTES:
                raise ValueError(f"{name!r} is not a Lamina ring ({size} bytes)")
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = memoryview(self.mm)
        return self._buf

    def _bell(self, path: str, create: bool) -> _Doorbell:
        bell = _Doorbell(path, create)
        self.bells.append(bell)
        return bell

    def release(self, unlink: bool) -> None:
        """For the creator (``unlink``; only in the process that created it, never in a forked
        child) unlink the segment and FIFOs first; then close the doorbells and unmap (when no
        view is alive). Every step runs even if an earlier one failed."""
        if unlink and os.getpid() == self.owner_pid:
            self.unlink()
        for view in ("ctl", "data", "_buf"):
            try:
                if hasattr(self, view):
                    getattr(self, view).release()
            except BufferError:
                pass
        for bell in self.bells:
            bell.close(unlink=False)
        self.bells = []
        for m in (self.shm, self.mm):
            try:
                if m is not None:
                    m.close()
            except (BufferError, OSError):  # a stray view is alive: the mapping goes with us
                pass

    def unlink(self) -> None:
        """Remove the names (segment and FIFOs) if still there - mappings and open doorbells
        stay usable - and drop the resource tracker's registration (exactly once)."""
        for path in (self.spec.data_bell, self.spec.space_bell):
            try:
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        if self.tracked and self.shm is not None:
            self.tracked = False
            try:
                self.shm.unlink()  # also unregisters
            except FileNotFoundError:  # the peer removed the name already
                try:
                    resource_tracker.unregister(self.shm._name, "shared_memory")
                except Exception:  # noqa: BLE001 - bookkeeping only
                    pass
        elif _posixshmem is not None:
            try:
                _posixshmem.shm_unlink("/" + self.spec.name)
            except FileNotFoundError:
                pass


def _release_rings(rings: list[_Ring], unlink: bool) -> None:
    for ring in rings:
        ring.release(unlink)
