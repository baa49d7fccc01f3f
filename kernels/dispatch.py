"""Choice between the Triton kernels and the torch paths.

The process's ``attention`` kernel choice (:func:`lamina.config.kernels_in_use`: its role's
:class:`~lamina.config.KernelConfig`, by default what ``LAMINA_KERNELS`` named) selects the
implementation:

* unset / ``auto``: Triton for CUDA tensors (replayed from CUDA graphs per padded shape where
  the indptrs are host tensors: :mod:`lamina.kernels.triton_graphs`), the C++ kernel (:mod:`lamina.kernels.cpp_ext`)
  for CPU tensors when it builds, the torch path otherwise (after one ``RuntimeWarning`` that
  names why the build failed);
* ``cpp``: the C++ kernel on CPU tensors (an error if it cannot be built);
* ``triton``: Triton on any device (CPU tensors need ``TRITON_INTERPRET=1``, set before triton is
  first imported — this module imports triton lazily, at the first Triton call);
* ``torch``: the torch path on any device: :func:`lamina.kernels.torch_sparse.paged_attention_cpu`
  (sparse ops for decode on CPU float32 pools, with per-step plans cached across layers), which
  hands prefill chunks and every other case to :mod:`lamina.kernels.torch_batched`;
* ``batched``: :func:`lamina.kernels.torch_batched.paged_attention_batched` for everything (the
  padded-``bmm`` path that was the CPU default before the sparse one; for A/B runs);
* ``ref``: the per-request reference :func:`paged_attention_ref` (slow; the oracle).

Without an importable ``triton``, CPU work falls back to the torch path, and CUDA work (or an
explicit ``triton``) raises a ``RuntimeError`` naming the fix.
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from lamina import env
from lamina.config import kernels_in_use

from lamina.kernels import cpp_ext
from lamina.kernels.kv_format import KVFormat
from lamina.kernels.reference import merge_rows_ref, merge_states_ref, paged_attention_ref
from lamina.kernels.torch_batched import paged_attention_batched
from lamina.kernels.torch_sparse import paged_attention_cpu
from lamina.types import AttentionSpec

def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def requested() -> str:
    """This process's attention kernel choice, as configured (``auto`` by default)."""
    return kernels_in_use().attention


def backend_for(device: torch.device) -> str:
    """The implementation (``cpp``, ``triton``, ``torch``, ``batched`` or ``ref``) for
    ``device``; ``auto`` on CPU builds (or loads the cached) C++ kernel at the first call."""
    choice = requested()
    if choice == "auto":
        if device.type == "cuda":
            choice = "triton"
        else:
            choice = "cpp" if cpp_ext.load() is not None else "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(f"attention on {device.type} needs the Triton kernels but triton is "
                               "not installed: `pip install triton`, or choose torch kernels "
                               "(--kernels torch, LAMINA_KERNELS=torch)")
        if device.type != "cuda" and env.text("TRITON_INTERPRET") != "1":
            raise RuntimeError("triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                               "triton is imported")
    return choice


def resolve(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The paged-attention function :func:`paged_attention` calls for tensors on ``device``
    under this process's kernel choices, with :func:`paged_attention`'s contract. A caller
    that attends many times with the same choices (a memory node, layer after layer) resolves
    it once instead of per call."""
    backend = backend_for(device)
    if backend == "triton" and device.type == "cuda":  # one graph replay per call where it can
        from lamina.kernels.triton_graphs import paged_attention_graphed
        return paged_attention_graphed
    if backend == "triton":
        from lamina.kernels.triton_attention import paged_attention_triton
        return paged_attention_triton
    fn = {"cpp": cpp_ext.attention_fn() if backend == "cpp" else None,
          "torch": paged_attention_cpu, "batched": paged_attention_batched}.get(
              backend, paged_attention_ref)

    def on_device_indptrs(q, k_pool, v_pool, qo_indptr, kv_indptr, *rest, **scales):
        # host indptrs (the memory node's) are for Triton's planning; the others copy them over
        return fn(q, k_pool, v_pool, qo_indptr.to(q.device), kv_indptr.to(q.device), *rest,
                  **scales)
    return on_device_indptrs if device.type != "cpu" else fn


def check_format(device: torch.device, fmt: KVFormat) -> None:
    """Raise ``ValueError`` (at a node's start) unless the attention kernel for ``device`` reads
    pools in KV format ``fmt``: every kernel reads float32 and bfloat16 pools; 8-bit ones
    (``int8``, ``fp8_e4m3``, ``k16v8``) are read by the C++ and Triton kernels and the
    reference, not by the torch paths (``torch``, ``batched``)."""
    if not fmt.scaled:
        return
    backend = backend_for(device)
    if backend not in ("cpp", "triton", "ref"):
        raise ValueError(f"kv_dtype {fmt.name}: the {backend} attention kernel on "
                         f"{device.type} reads float32 and bfloat16 KV only; 8-bit KV needs "
                         "the C++ kernel (CPU), the Triton kernel (CUDA) or ref")


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    q_positions: torch.Tensor, kv_start_pos: torch.Tensor,
                    spec: AttentionSpec, **scales: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention; see :mod:`lamina.kernels.reference` for the contract. ``qo_indptr``
    and ``kv_indptr`` may also be host tensors: Triton then plans without waiting for the
    device (and reuses the plan across a step's layers); other backends copy them over.
    ``scales``: ``k_scale``/``v_scale[S, Hkv]`` of 8-bit pools (:func:`check_format` says
    which backends read them)."""
    return resolve(q.device)(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions,
                             kv_start_pos, spec, **scales)


def merge_states(os: torch.Tensor | list[torch.Tensor],
                 lses: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge; see :func:`lamina.kernels.reference.merge_states_ref`. Triton
    where :func:`backend_for` would pick it, the torch reference otherwise (also under ``cpp``:
    the merge is a few element-wise ops, not worth a kernel)."""
    first = os[0] if isinstance(os, (list, tuple)) else os
    choice = requested()  # not backend_for: a merge on CPU must not build the C++ kernel
    if choice == "triton" or (choice == "auto" and first.device.type == "cuda"):
        backend_for(first.device)  # raises, naming the fix, where Triton cannot run
        from lamina.kernels.triton_merge import merge_states_triton
        return merge_states_triton(os, lses)
    return merge_states_ref(os, lses)


def resolve_merge(device: torch.device) -> Callable[..., None]:
    """The in-place row merge for tensors on ``device`` (``merge_rows(o[T,H,D], lse[T,H],
    rows[n], og[n,H,D], lg[n,H])``, :func:`~lamina.kernels.reference.merge_rows_ref`'s
    contract), resolved once as :func:`resolve` is: the C++ kernel where :func:`backend_for`
    picks it, for float32 (one call instead of a dozen element-wise ops, ~0.2 ms a layer at a
    cascade's 64 rows), the reference otherwise."""
    if backend_for(device) != "cpp":
        return merge_rows_ref
    kernel = cpp_ext.load().merge_rows

    def merge_rows(o, lse, rows, og, lg) -> None:
        if o.dtype == og.dtype == torch.float32:
            kernel(o, lse, rows.to(torch.int64), og.contiguous(), lg.contiguous())
        else:
            merge_rows_ref(o, lse, rows, og, lg)
    return merge_rows
