"""The C++ CPU kernels: build, cache, call. One extension holds the paged-attention kernel
(``kernels/csrc/paged_attention_cpu.cpp``) and the decode-sized linear layer
(``kernels/csrc/skinny_linear_cpu.cpp``: ``pack_linear_weight`` / ``skinny_linear``, used by
:mod:`lamina.computenode.cpu_linear`), the linear layer over GGUF-quantised weights
(``kernels/csrc/quant_linear_cpu.cpp``: ``quant_linear`` for Q4_0, Q4_1 and Q8_0 blocks) and the
slices' fused small ops (``kernels/csrc/fused_cpu.cpp``: ``rms_norm``, ``silu_mul``, ``rope``,
used by :mod:`lamina.computenode.fused_ops`);
``bindings.cpp`` exposes them (without the GIL).

:func:`paged_attention_cpp` has the contract of :func:`lamina.kernels.reference.paged_attention_ref`
(``q[T,H,D]``, ``k_pool/v_pool[S,Hkv,D]``, CSR ``qo_indptr[R+1]``/``kv_indptr[R+1]``/
``kv_indices[N]``, ``q_positions[T]``, ``kv_start_pos[R]``; returns ``o[T,H,D]`` in q's dtype and
``lse[T,H]`` float32, ``o = 0, lse = -inf`` where a query sees no key). It takes CPU tensors
with pools in every KV format (:mod:`lamina.kernels.kv_format`: float32, bfloat16, int8 and
float8 e4m3 with ``k_scale``/``v_scale[S, Hkv]``, bfloat16 K with int8 V; last dimension
contiguous) and float32 / bfloat16 / float16 queries; other float inputs go to the torch path
(:func:`lamina.kernels.torch_sparse.paged_attention_cpu`). ``kv_store`` writes K or V into an
8-bit pool, quantised (the bytes of :meth:`lamina.kernels.kv_format.KVPart.quantize`).
Computation is float32. Threads: torch's intra-op pool (``torch.set_num_threads``).

Build: :func:`load` compiles the sources on first use and caches them (~30 s once per CPU,
toolchain and source version; see :mod:`lamina.build`). When the build fails
:func:`load` emits one ``RuntimeWarning`` naming the cause and returns ``None``;
:func:`build_error` keeps the cause, and the dispatcher uses the torch path.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from lamina.build import CFLAGS, EXCHANGE_HEADER, Extension, cache_root, extra_cflags
from lamina.build import compiler as _compiler
from lamina.kernels.reference import check_shapes
from lamina.types import AttentionSpec

__all__ = ["CFLAGS", "SOURCES", "HEADERS", "load", "available", "build_error", "build_key",
           "cache_root", "extra_cflags", "cpp_eligible", "attention_fn", "paged_attention_cpp",
           "_compiler"]

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("paged_attention_cpu.cpp", "skinny_linear_cpu.cpp",
                                          "quant_linear_cpu.cpp", "quant_dot_cpu.cpp",
                                          "fused_cpu.cpp", "slice_program.cpp",
                                          "bindings.cpp"))
HEADERS = (*sorted(_CSRC.glob("*.h")), EXCHANGE_HEADER)  # every header: each is in the build key
POOLS = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.int8, torch.int8), (torch.float8_e4m3fn, torch.float8_e4m3fn),
         (torch.bfloat16, torch.int8))  # (K, V) pool dtypes: every KV format's
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

EXTENSION = Extension("lamina_paged_attention", SOURCES, HEADERS, fallback="the torch paths")
build_key = EXTENSION.build_key


def load(extra: tuple[str, ...] | None = None, verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first use; ``None`` (after one warning) if they cannot be.
    ``extra``: compile flags added to ``-O3 -march=native -fopenmp`` (default:
    ``LAMINA_CPP_CFLAGS``); each set of flags is built (and warned about) once per process."""
    return EXTENSION.load(extra, verbose)


def available() -> bool:
    """Whether the extension is built (building it now if it was never tried)."""
    return load() is not None


def build_error() -> str | None:
    """Why the last :func:`load` with the current flags failed (``None``: it did not)."""
    return EXTENSION.build_error()


def cpp_eligible(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these tensors (else :func:`paged_attention_cpp` hands them
    to the torch path)."""
    return (q.device.type == "cpu" and k_pool.device.type == "cpu"
            and v_pool.device.type == "cpu" and q.dtype in Q_DTYPES
            and (k_pool.dtype, v_pool.dtype) in POOLS
            and k_pool.dim() == 3 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1)


def attention_fn() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`paged_attention_cpp` bound to the built extension (raises ``RuntimeError``, as it
    does, when the extension cannot be built): what a memory node calls layer after layer."""
    ext = load()
    if ext is None:
        raise RuntimeError(f"the C++ CPU attention kernel is unavailable ({build_error()}); "
                           "set LAMINA_KERNELS=torch")
    kernel = ext.paged_attention

    def paged_attention_bound(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                              kv_start_pos, spec, k_scale=None, v_scale=None):
        check_shapes(q, k_pool, spec)
        if k_scale is not None or v_scale is not None:  # 8-bit pools: only this kernel
            return kernel(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                          kv_start_pos, float(spec.scale), int(spec.window or 0),
                          float(spec.softcap or 0.0), k_scale, v_scale)
        if not cpp_eligible(q, k_pool, v_pool):
            from lamina.kernels.torch_sparse import paged_attention_cpu
            return paged_attention_cpu(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                                       q_positions, kv_start_pos, spec)
        return kernel(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                      kv_start_pos, float(spec.scale), int(spec.window or 0),
                      float(spec.softcap or 0.0))
    return paged_attention_bound


def paged_attention_cpp(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, q_positions: torch.Tensor,
                        kv_start_pos: torch.Tensor, spec: AttentionSpec,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention by the C++ kernel (see the module docstring); raises ``RuntimeError``
    naming the cause when the extension cannot be built."""
    return attention_fn()(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                          kv_start_pos, spec, k_scale, v_scale)
