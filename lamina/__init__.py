"""Lamina: LLM serving with attention offloading.

The sub-packages ``lamina.splitter``, ``lamina.memnode``, ``lamina.computenode`` and
``lamina.kernels`` live in top-level folders of the repository and are mapped under ``lamina``
by ``pyproject.toml``. When the code runs from a source checkout without installation, the
repository root is appended to this package's search path so the same imports resolve.

Importing ``lamina`` notes whether the user chose an OpenMP wait policy; role processes it
starts get ``PASSIVE`` unless they did (why: :mod:`lamina.omp`).
"""
from __future__ import annotations

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "splitter")) and _root not in __path__:
    __path__.append(_root)  # source checkout: lamina.kernels -> <root>/kernels, ...

__version__ = "0.1.0"

from lamina.omp import remember_choice as _remember_choice  # noqa: E402

_remember_choice()


def __getattr__(name: str):
    """Lazy top-level API (``from lamina import LLM, SamplingParams``) so that importing a
    sub-package such as ``lamina.kernels`` does not import the whole runtime."""
    if name in ("LLM",):
        from lamina.llm import LLM
        return LLM
    if name in ("SamplingParams",):
        from lamina.types import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "StreamDelta"):
        from lamina import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
