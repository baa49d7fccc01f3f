"""The C++ fast path of the shared-memory ring (``lamina/transport/csrc/shm_ring.cpp``).

:class:`~lamina.transport.shm.ShmChannel` uses it, when it builds, for what costs most in
Python per message:

* ``Writer`` (one per channel end and direction; holds the ring, the limits and HEAD):
  ``send`` encodes a whole message (header, descriptors, meta, tensor bytes) straight into the
  ring when it fits in the free space: each tensor is copied once, no intermediate buffer, no
  Python per tensor;
* ``Reader`` (holds the ring, the limits and TAIL): ``recv`` copies a whole, well-formed
  message out of the ring into fresh tensors (one copy each) after spinning (without the GIL)
  up to a given time for one to arrive, and builds its ``Message`` when it has no meta (then
  frees its bytes too), so a receiver that is already waiting costs one call; a message with
  meta is handed back as fields and freed by ``commit`` once the meta parsed. Messages up to
  64 KB are copied without dropping the GIL (cheaper than the hand-over);
* ``exchange``: a request and its reply in one call (``RingChannel.exchange``): a message
  without meta written as ``Writer.send`` writes it, then a wait for the next message, taken
  only if it is the reply (its kind, step and layer, no meta), else left in the ring;
* ``ring_wait``: spins on a control word without the GIL (so a role's other threads run while
  a receiver polls), yielding now and then when asked.

Anything else (a message larger than the free space or the ring, malformed input, tensors
that are not contiguous CPU ones) takes the Python path in :mod:`lamina.transport.shm`, which
writes the same bytes and raises the precise :class:`~lamina.transport.wire.WireError`; both
paths interoperate message by message. Built on first use and cached like the kernels
(:mod:`lamina.build`); the ``ring`` kernel choice ``python`` (``LAMINA_KERNELS=torch``: no C++
at all) or a failed build (one warning) leaves the Python path.

Results. ``Writer.send`` returns one status: :data:`SENT` or :data:`SENT_WAKE` (written; with
the latter the reader sleeps and the caller rings its doorbell), or, with nothing written,
:data:`NO_ROOM`, :data:`INELIGIBLE` (also for an argument that does not convert, such as an
id out of range) or :data:`PEER_CLOSED` (the Python path then streams, encodes or refuses the
message, or raises). It raises nothing itself. ``Reader.recv`` returns ``(status, payload)``:
``(EMPTY, None)``, ``(STREAM, None)`` (the Python stream decoder's business), ``(TAKEN,
message)`` or ``(TAKEN_WAKE, message)`` (its bytes freed; with the latter the writer sleeps and
the caller rings its doorbell), or ``(HELD, (kind, step_id, layer, reply_to, meta, tensors))``
(meta as bytes; the bytes stay in the ring until ``commit()``, which returns :data:`TAKEN` or
:data:`TAKEN_WAKE`).

One layout. Python defines the layout (:mod:`lamina.transport.wire`, the control words of
:mod:`lamina.transport.ring_memory`) and the statuses (here). The extension keeps its own copy
(``csrc/ring_layout.h``) and exports it (``layout()`` and the status attributes); :func:`load`
compares them with Python's once per process and raises :class:`LayoutMismatch`, naming every
field that differs, instead of returning a module that would write other bytes.
"""
from __future__ import annotations

import re
import struct
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lamina.build import EXCHANGE_HEADER, Extension
from lamina.config import kernels_in_use
from lamina.transport import ring_memory, wire

__all__ = ["EXTENSION", "load", "check_layout", "expected_layout", "LayoutMismatch", "STATUSES",
           "SENT", "SENT_WAKE", "NO_ROOM", "INELIGIBLE", "PEER_CLOSED", "EMPTY", "STREAM",
           "TAKEN", "TAKEN_WAKE", "HELD"]

# Writer.send's statuses
SENT = 0  # written; the reader is awake
SENT_WAKE = 1  # written; the reader sleeps (ring its doorbell)
NO_ROOM = 2  # nothing written: the message does not fit in the free space now
INELIGIBLE = 3  # nothing written: the Python encoder's business (it encodes or refuses it)
PEER_CLOSED = 4  # nothing written: the reader closed its end
# Reader.recv's statuses (the first of its pair; commit returns TAKEN or TAKEN_WAKE)
EMPTY = 5  # nothing arrived within the spin
STREAM = 6  # not whole yet, malformed, over the limits, too big: for the Python decoder
TAKEN = 7  # a Message, its bytes freed
TAKEN_WAKE = 8  # the same; the writer sleeps (ring its doorbell)
HELD = 9  # a message's fields; its bytes stay in the ring until commit()
STATUSES = {"SENT": SENT, "SENT_WAKE": SENT_WAKE, "NO_ROOM": NO_ROOM, "INELIGIBLE": INELIGIBLE,
            "PEER_CLOSED": PEER_CLOSED, "EMPTY": EMPTY, "STREAM": STREAM, "TAKEN": TAKEN,
            "TAKEN_WAKE": TAKEN_WAKE, "HELD": HELD}  # the extension's attributes of these names
CTL_WORDS = ("HEAD", "TAIL", "R_WAIT", "W_WAIT", "W_CLOSED", "R_CLOSED")  # the control words C++ touches

_CSRC = Path(__file__).resolve().parent / "csrc"
EXTENSION = Extension("lamina_shm_ring", (_CSRC / "shm_ring.cpp",),
                      headers=(_CSRC / "ring_layout.h", _CSRC / "ring_io.h", EXCHANGE_HEADER),
                      fallback="the Python ring code")
_checked: weakref.WeakSet[ModuleType] = weakref.WeakSet()  # the modules whose layout matched


class LayoutMismatch(RuntimeError):
    """The compiled fast path assumes another layout (or other status codes) than Python
    defines; the message names every field that differs."""


def load() -> ModuleType | None:
    """The compiled fast path, or ``None`` (Python path) when the ``ring`` kernel choice is
    ``python`` (:class:`lamina.config.KernelConfig`) or, under ``auto``, when it cannot be built
    (``cpp`` then raises). Raises :class:`LayoutMismatch` when its layout or statuses differ
    from Python's (checked once per process and module)."""
    choice = kernels_in_use().ring
    if choice == "python":
        return None
    module = EXTENSION.load()
    if module is None and choice == "cpp":
        raise RuntimeError(f"ring 'cpp' needs the C++ fast path, which is unavailable "
                           f"({EXTENSION.build_error()})")
    if module is not None and module not in _checked:
        check_layout(module)
        _checked.add(module)
    return module


def check_layout(module: Any) -> None:
    """Raise :class:`LayoutMismatch` unless ``module.layout()`` equals :func:`expected_layout`
    and each of :data:`STATUSES` is an attribute of ``module`` equal to this module's."""
    problems = [f"status {name}: C++ {getattr(module, name, 'missing')}, shm_fast {value}"
                for name, value in STATUSES.items() if getattr(module, name, None) != value]
    got, want = module.layout() if hasattr(module, "layout") else {}, expected_layout()
    for key in want:
        try:
            problems += _mismatches(key, got[key], want[key])
        except KeyError:
            problems.append(f"{key}: missing from the C++ layout()")
        except (TypeError, ValueError):
            problems.append(f"{key}: C++ exports {got[key]!r}, not in the expected form")
    if problems:
        raise LayoutMismatch(f"the C++ ring fast path ({getattr(module, '__file__', module)}) "
                             f"disagrees with the Python layout: " + "; ".join(problems))


def expected_layout() -> dict[str, Any]:
    """What the extension's ``layout()`` must return, from the Python definitions: ``header`` /
    ``descriptor``: ``(size, rows)`` of :data:`~lamina.transport.wire.HEADER_FORMAT` /
    :data:`~lamina.transport.wire.DESC_FORMAT`, a row ``(offset, size, kind)`` per field
    (``kind``: ``s`` bytes, ``i`` / ``u`` signed / unsigned integer, ``f`` float; a repeat count
    makes one array field; pad bytes are no field); ``magic``, ``version``, ``align``,
    ``max_ndim``; ``dtypes``: ``{code: (dtype, item size)}``; ``ctl_words``: ``{name: u64
    index}`` of :data:`CTL_WORDS`; ``limits``: :data:`~lamina.transport.wire.LIMIT_FIELDS`."""
    return {
        "header": (struct.calcsize(wire.HEADER_FORMAT), _rows(wire.HEADER_FORMAT)),
        "descriptor": (struct.calcsize(wire.DESC_FORMAT), _rows(wire.DESC_FORMAT)),
        "magic": wire.MAGIC, "version": wire.VERSION, "align": wire.ALIGN,
        "max_ndim": wire.MAX_NDIM,
        "dtypes": {code: (dt, torch.empty((), dtype=dt).element_size())
                   for dt, code in wire.DTYPE_CODES.items()},
        "ctl_words": {name: getattr(ring_memory, name) for name in CTL_WORDS},
        "limits": tuple(wire.LIMIT_FIELDS),
    }


def _mismatches(key: str, got: Any, want: Any) -> list[str]:
    """How C++'s value of one key of :func:`expected_layout` differs from Python's."""
    if key in ("header", "descriptor"):
        return _struct_mismatches(key, got, want)
    if key in ("dtypes", "ctl_words"):
        what = "dtype code" if key == "dtypes" else "control word"
        where = "wire.DTYPE_CODES" if key == "dtypes" else "ring_memory"
        return [f"{what} {k}: C++ {got.get(k, 'missing')}, {where} {want.get(k, 'missing')}"
                for k in sorted(set(got) | set(want), key=lambda k: (str(type(k)), k))
                if got.get(k, "missing") != want.get(k, "missing")]
    return [] if got == want else [f"{key}: C++ {got!r}, Python {want!r}"]


def _rows(fmt: str) -> list[tuple[int, int, str]]:
    """``(offset, size, kind)`` of each field of a little-endian struct format (see
    :func:`expected_layout`)."""
    if not fmt.startswith("<"):
        raise ValueError(f"a wire struct format is little endian ('<...'), got {fmt!r}")
    rows, off = [], 0
    for count, code in re.findall(r"(\d*)(\D)", fmt[1:]):
        size = struct.calcsize(f"<{count}{code}")
        if code != "x":
            kind = "s" if code == "s" else "f" if code in "efd" else \
                "i" if code in "bhilqn" else "u"
            rows.append((off, size, kind))
        off += size
    return rows


def _struct_mismatches(what: str, got: tuple, want: tuple) -> list[str]:
    """How C++'s ``(size, rows)`` of one struct differ from Python's."""
    name = "HEADER_FORMAT" if what == "header" else "DESC_FORMAT"
    fmt = f"wire.{name} {getattr(wire, name)!r}"
    (size, rows), (want_size, want_rows) = got, want
    out = [] if size == want_size else [f"{what} size: C++ {size}, {fmt} {want_size}"]
    if len(rows) != len(want_rows):
        out.append(f"{what}: C++ has {len(rows)} fields {[r[0] for r in rows]}, {fmt} has "
                   f"{len(want_rows)}")
    for i, ((field, *row), w) in enumerate(zip(rows, want_rows)):
        if tuple(row) != w:
            out.append(f"{what} field {i} ({field}): C++ (offset, size, kind) {tuple(row)}, "
                       f"{fmt} {w}")
    return out
