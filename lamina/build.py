"""Building lamina's C++ extensions: compile once with ``torch.utils.cpp_extension``, cache by a
key, load; one warning and ``None`` when the build fails.

An :class:`Extension` is a name plus its sources. :meth:`Extension.load` compiles them on first
use (``-O3 -march=native -fopenmp``) into ``$LAMINA_CACHE/torch_extensions/<key>``
(``LAMINA_CACHE`` defaults to ``~/.cache/lamina``). ``<key>`` hashes the sources and their
folder, the flags, the CPU (model and feature flags from ``/proc/cpuinfo``), the compiler, torch
and Python, so a cache never serves a binary built for another CPU or toolchain; later
processes just load it, without a ninja run (concurrent builders take turns on an flock in that folder, which a
builder that dies does not leave behind). ``LAMINA_CPP_CFLAGS`` adds flags (e.g.
``-mno-avx512f`` to try portable paths). When the build fails (no compiler, no ninja, a compile
error) :meth:`Extension.load` emits one ``RuntimeWarning`` naming the cause and the fallback,
and returns ``None``; :meth:`Extension.build_error` keeps the cause.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lamina import env

CFLAGS = ("-O3", "-march=native", "-fopenmp")
# the contract between a whole-step program (kernels) and what answers its layers' attention
# without Python (a memory node's plane, a ring to a node's process): one header for them all
EXCHANGE_HEADER = Path(__file__).resolve().parent / "csrc" / "exchange.h"
LDFLAGS = ("-fopenmp",)


def cache_root() -> Path:
    """``$LAMINA_CACHE/torch_extensions`` (``LAMINA_CACHE`` defaults to ``~/.cache/lamina``)."""
    base = env.cache_root()
    return base / "torch_extensions"


@functools.cache
def _cpu_fingerprint() -> str:
    """CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    seen: dict[str, str] = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key in keep and key not in seen:
            seen[key] = " ".join(sorted(val.split())) if key in ("flags", "Features") else val.strip()
    return repr(sorted(seen.items()))


def compiler() -> str | None:
    """The C++ compiler's path (``$CXX``, default ``c++``), or None when it is not on PATH."""
    return shutil.which(env.text("CXX", "c++"))


@functools.cache
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "?"


def extra_cflags() -> tuple[str, ...]:
    """Flags added by ``LAMINA_CPP_CFLAGS`` (whitespace separated)."""
    return tuple(env.text("LAMINA_CPP_CFLAGS").split())


def _cause(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errors or lines)[-4:])[:800] or type(exc).__name__


class Extension:
    """One C++ extension: ``name`` (a Python identifier), ``sources`` (compiled), ``headers``
    (hashed into the key only; their folders are on the include path), ``fallback`` (what the
    warning says is used instead)."""

    def __init__(self, name: str, sources: tuple[Path, ...], headers: tuple[Path, ...] = (),
                 fallback: str = "the torch paths") -> None:
        self.name = name
        self.sources = sources
        self.headers = headers
        self.fallback = fallback
        self._lock = threading.Lock()
        self._tried: dict[tuple[str, ...], ModuleType | None] = {}
        self._error: dict[tuple[str, ...], str] = {}

    def build_key(self, cflags: tuple[str, ...], cxx: str) -> str:
        """Hex digest over sources (their content and folders: ninja's build file names the
        paths, so two checkouts sharing one build folder would rebuild each other's), flags,
        CPU, compiler, torch and Python versions."""
        h = hashlib.sha256(self.name.encode())
        for src in self.sources + self.headers:
            h.update(str(src.parent).encode())
            h.update(src.read_bytes())
        for part in (cflags, LDFLAGS, _cpu_fingerprint(), cxx, _compiler_version(cxx),
                     torch.__version__, sys.version, platform.machine()):
            h.update(repr(part).encode())
        return h.hexdigest()[:16]

    def _build(self, extra: tuple[str, ...], verbose: bool) -> ModuleType:
        from torch.utils import cpp_extension
        cxx = compiler()
        if cxx is None:
            raise RuntimeError(f"no C++ compiler: {env.text('CXX', 'c++')!r} is not on PATH")
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (`pip install ninja`)")
        cflags = CFLAGS + extra
        key = self.build_key(cflags, cxx)
        build_dir = cache_root() / key
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's own lock (a ``lock`` file) stays behind when its builder is killed, and every
        # later load would wait on it forever. Builders here first take an flock, which the
        # kernel drops with a dead process; whoever holds it may remove a leftover ``lock``.
        with open(build_dir / "lamina.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            built = build_dir / f"{self.name}_{key}.so"
            if built.is_file():  # the key pins what it was built from: load it, no ninja run
                return _import(f"{self.name}_{key}", built)
            return cpp_extension.load(name=f"{self.name}_{key}",
                                      sources=[str(s) for s in self.sources],
                                      extra_cflags=list(cflags), extra_ldflags=list(LDFLAGS),
                                      extra_include_paths=sorted({str(h.parent)
                                                                  for h in self.headers}),
                                      build_directory=str(build_dir), verbose=verbose)

    def load(self, extra: tuple[str, ...] | None = None,
             verbose: bool = False) -> ModuleType | None:
        """The compiled module, built on first use; ``None`` (after one warning) if it cannot be.
        ``extra``: compile flags added to :data:`CFLAGS` (default: ``LAMINA_CPP_CFLAGS``); each
        set of flags is built (and warned about) once per process."""
        extra = extra_cflags() if extra is None else tuple(extra)
        with self._lock:
            if extra in self._tried:
                return self._tried[extra]
            try:
                mod = self._build(extra, verbose)
            except Exception as exc:  # noqa: BLE001 - any build failure means the fallback
                mod = None
                self._error[extra] = _cause(exc)
            self._tried[extra] = mod  # before warning: a warnings filter may raise
        if mod is None:
            warnings.warn(f"lamina: the C++ extension {self.name} could not be built "
                          f"({self._error[extra]}); using {self.fallback} instead "
                          f"(set LAMINA_KERNELS=torch to skip the build)", RuntimeWarning,
                          stacklevel=3)
        return mod

    def build_error(self) -> str | None:
        """Why the last :meth:`load` with the current flags failed (``None``: it did not)."""
        return self._error.get(extra_cflags())


def _import(name: str, path: Path) -> ModuleType:
    """The extension module ``name`` from its built library (what ``cpp_extension.load`` ends
    with, without its ninja run and compiler checks)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
