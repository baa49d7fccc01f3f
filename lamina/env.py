"""The environment variables Lamina reads, in one place.

Switches that choose what a role runs are read once, when this module is imported, and reach
the roles through the config (:class:`lamina.config.KernelConfig`), never by a role reading its
own environment:

* ``LAMINA_KERNELS``: the default :class:`~lamina.config.KernelConfig` by one name: ``auto``
  (the default), ``cpp``, ``triton``, ``torch`` (no C++ at all: torch attention, torch linear
  layers, the Python ring), ``batched``, ``ref``, ``gguf`` or ``gguf-q8`` (a GGUF's own
  blocks in the linear layers; :meth:`~lamina.config.KernelConfig.named`).

Paths and build settings are read where they are used, through :func:`path` and :func:`text`
(so a test or a launcher may change them for the next use): ``LAMINA_CACHE`` (built extensions,
converted models; default ``~/.cache/lamina``), ``LAMINA_SPLIT_CACHE`` (split models; ``0``:
off), ``LAMINA_CPP_CFLAGS`` (extra C++ flags), ``LAMINA_HARDWARE`` (extra device catalogs),
``LAMINA_RDMA_GID_INDEX``, ``CXX``, ``TRITON_INTERPRET``.

Two variables of the libraries Lamina runs on are set (not read as settings) where they act:
``OMP_WAIT_POLICY`` (:mod:`lamina.omp`) and ``CUDA_MODULE_LOADING``
(:mod:`lamina.computenode.polling`).
"""
from __future__ import annotations

import os
from pathlib import Path

KERNELS = os.environ.get("LAMINA_KERNELS", "").strip().lower() or "auto"


def text(name: str, default: str = "") -> str:
    """The variable ``name`` as it is now (``default`` when unset)."""
    return os.environ.get(name, default)


def path(name: str, default: Path) -> Path:
    """The variable ``name`` as a path (``default`` when unset or empty)."""
    return Path(os.environ.get(name) or default).expanduser()


def cache_root() -> Path:
    """``LAMINA_CACHE``: where built extensions and converted models go (default
    ``~/.cache/lamina``)."""
    return path("LAMINA_CACHE", Path.home() / ".cache" / "lamina")
