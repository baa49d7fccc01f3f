"""The C++ CPU kernels: build, cache, call. One extension holds the paged-attention kernel
(``kernels/csrc/paged_attention_cpu.cpp``) and the decode-sized linear layer
(``kernels/csrc/skinny_linear_cpu.cpp``: ``pack_linear_weight`` / ``skinny_linear``, used by
:mod:`lamina.computenode.cpu_linear`); ``bindings.cpp`` exposes both (without the GIL).

:func:`paged_attention_cpp` has the contract of :func:`lamina.kernels.reference.paged_attention_ref`
(``q[T,H,D]``, ``k_pool/v_pool[S,Hkv,D]``, CSR ``qo_indptr[R+1]``/``kv_indptr[R+1]``/
``kv_indices[N]``, ``q_positions[T]``, ``kv_start_pos[R]``; returns ``o[T,H,D]`` in q's dtype and
``lse[T,H]`` float32, ``o = 0, lse = -inf`` where a query sees no key). It takes CPU tensors
with float32 or bfloat16 pools (last dimension contiguous) and float32 / bfloat16 / float16
queries; other inputs go to the torch path (:func:`lamina.kernels.torch_sparse.paged_attention_cpu`).
Computation is float32. Threads: torch's intra-op pool (``torch.set_num_threads``).

Build: :func:`load` compiles the source with ``torch.utils.cpp_extension.load`` on first use
(``-O3 -march=native -fopenmp``; ~30 s) into ``$LAMINA_CACHE/torch_extensions/<key>``
(``LAMINA_CACHE`` defaults to ``~/.cache/lamina``). ``<key>`` hashes the sources and their
folder, the flags, the CPU (model and feature flags from ``/proc/cpuinfo``), the compiler, torch
and Python, so a cache never serves a binary built for another CPU or toolchain; later
processes just load it (concurrent builders take turns on an flock in that folder, which a
builder that dies does not leave behind). ``LAMINA_CPP_CFLAGS`` adds flags (e.g.
``-mno-avx512f`` to try the portable path). When the build fails (no compiler, no ninja, a
compile error) :func:`load` emits one ``RuntimeWarning`` naming the cause and returns
``None``; :func:`build_error` keeps the cause, and the dispatcher uses the torch path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lamina.kernels.reference import check_shapes
from lamina.types import AttentionSpec

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("paged_attention_cpu.cpp", "skinny_linear_cpu.cpp",
                                          "bindings.cpp"))
HEADERS = (_CSRC / "simd.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
POOL_DTYPES = (torch.float32, torch.bfloat16)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict = {"tried": {}, "error": {}}  # by extra-flags tuple: module or None / cause


def cache_root() -> Path:
    """``$LAMINA_CACHE/torch_extensions`` (``LAMINA_CACHE`` defaults to ``~/.cache/lamina``)."""
    base = Path(os.environ.get("LAMINA_CACHE", Path.home() / ".cache" / "lamina"))
    return base / "torch_extensions"


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


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "?"


def extra_cflags() -> tuple[str, ...]:
    """Flags added by ``LAMINA_CPP_CFLAGS`` (whitespace separated)."""
    return tuple(os.environ.get("LAMINA_CPP_CFLAGS", "").split())


def build_key(cflags: tuple[str, ...], cxx: str) -> str:
    """Hex digest over sources (their content and folder: ninja's build file names the paths,
    so two checkouts sharing one build folder would rebuild each other's), flags, CPU,
    compiler, torch and Python versions."""
    h = hashlib.sha256(str(_CSRC).encode())
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    for part in (cflags, LDFLAGS, _cpu_fingerprint(), cxx, _compiler_version(cxx),
                 torch.__version__, sys.version, platform.machine()):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def _cause(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errors or lines)[-4:])[:800] or type(exc).__name__


def _build(extra: tuple[str, ...], verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} is not on PATH")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (`pip install ninja`)")
    cflags = CFLAGS + extra
    key = build_key(cflags, cxx)
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock (a ``lock`` file) stays behind when its builder is killed, and every
    # later load would wait on it forever. Builders here first take an flock, which the kernel
    # drops with a dead process; whoever holds it may remove a leftover ``lock``.
    with open(build_dir / "lamina.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(name=f"lamina_paged_attention_{key}",
                                  sources=[str(s) for s in SOURCES], extra_cflags=list(cflags),
                                  extra_ldflags=list(LDFLAGS), build_directory=str(build_dir),
                                  verbose=verbose)


def load(extra: tuple[str, ...] | None = None, verbose: bool = False) -> ModuleType | None:
    """The compiled extension, built on first use; ``None`` (after one warning) if it cannot be.

    ``extra`` are compile flags added to ``-O3 -march=native -fopenmp`` (default:
    ``LAMINA_CPP_CFLAGS``); each set of flags is built (and warned about) once per process.
    """
    extra = extra_cflags() if extra is None else tuple(extra)
    with _lock:
        if extra in _state["tried"]:
            return _state["tried"][extra]
        try:
            mod = _build(extra, verbose)
        except Exception as exc:  # noqa: BLE001 - any build failure means the fallback
            mod = None
            _state["error"][extra] = _cause(exc)
        _state["tried"][extra] = mod  # before warning: a warnings filter may raise
    if mod is None:
        warnings.warn(f"lamina: the C++ CPU kernels could not be built "
                      f"({_state['error'][extra]}); using the torch paths instead "
                      f"(set LAMINA_KERNELS=torch to skip the build)", RuntimeWarning,
                      stacklevel=2)
    return mod


def available() -> bool:
    """Whether the extension is built (building it now if it was never tried)."""
    return load() is not None


def build_error() -> str | None:
    """Why the last :func:`load` with the current flags failed (``None``: it did not)."""
    return _state["error"].get(extra_cflags())


def cpp_eligible(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these tensors (else :func:`paged_attention_cpp` hands them
    to the torch path)."""
    return (q.device.type == "cpu" and k_pool.device.type == "cpu"
            and v_pool.device.type == "cpu" and q.dtype in Q_DTYPES
            and k_pool.dtype in POOL_DTYPES and v_pool.dtype == k_pool.dtype
            and k_pool.dim() == 3 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1)


def paged_attention_cpp(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, q_positions: torch.Tensor,
                        kv_start_pos: torch.Tensor,
                        spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention by the C++ kernel (see the module docstring); raises ``RuntimeError``
    naming the cause when the extension cannot be built."""
    check_shapes(q, k_pool, spec)
    if not cpp_eligible(q, k_pool, v_pool):
        from lamina.kernels.torch_sparse import paged_attention_cpu
        return paged_attention_cpu(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                                   q_positions, kv_start_pos, spec)
    ext = load()
    if ext is None:
        raise RuntimeError(f"the C++ CPU attention kernel is unavailable ({build_error()}); "
                           "set LAMINA_KERNELS=torch")
    return ext.paged_attention(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                               kv_start_pos, float(spec.scale), int(spec.window or 0),
                               float(spec.softcap or 0.0))
