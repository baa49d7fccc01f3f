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
* ``ring_wait``: spins on a control word without the GIL (so a role's other threads run while
  a receiver polls), yielding now and then when asked.

Anything else (a message larger than the free space or the ring, malformed input, tensors
that are not contiguous CPU ones) takes the Python path in :mod:`lamina.transport.shm`, which
writes the same bytes and raises the precise :class:`~lamina.transport.wire.WireError`; both
paths interoperate message by message. Built on first use and cached like the kernels
(:mod:`lamina.kernels.build`); ``LAMINA_KERNELS=torch`` (no C++ at all) or a failed build
(one warning) leaves the Python path.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from lamina.kernels.build import Extension

__all__ = ["EXTENSION", "load"]

EXTENSION = Extension("lamina_shm_ring", (Path(__file__).resolve().parent / "csrc" / "shm_ring.cpp",),
                      fallback="the Python ring code")


def load() -> ModuleType | None:
    """The compiled fast path, or ``None`` (Python path) under ``LAMINA_KERNELS=torch`` or when
    it cannot be built."""
    if os.environ.get("LAMINA_KERNELS", "auto").strip().lower() == "torch":
        return None
    return EXTENSION.load()
