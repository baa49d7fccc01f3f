"""Attention kernels over a paged KV pool.

``paged_attention`` and ``merge_states`` pick their implementation by device: the Triton
kernels on CUDA (or anywhere with ``LAMINA_KERNELS=triton``, e.g. under ``TRITON_INTERPRET=1``),
the C++ kernel on CPU (:mod:`lamina.kernels.cpp_ext`, built on first use and cached), and the
torch path where that cannot be built or is asked for (:mod:`lamina.kernels.torch_sparse` for
decode, falling back to the padded-``bmm`` :mod:`lamina.kernels.torch_batched`); see
:mod:`lamina.kernels.dispatch`.
Contracts are in :mod:`lamina.kernels.reference`, whose per-request functions are the test
oracle. Triton is imported only when a Triton path runs
(``lamina.kernels.triton_attention`` / ``lamina.kernels.triton_merge``).
"""
from lamina.kernels.reference import attention_over_keys, merge_states_ref, paged_attention_ref
from lamina.kernels.torch_batched import paged_attention_batched
from lamina.kernels.torch_sparse import paged_attention_cpu
from lamina.kernels.dispatch import backend_for, merge_states, paged_attention, triton_available

__all__ = ["paged_attention", "merge_states", "paged_attention_ref", "merge_states_ref",
           "attention_over_keys", "paged_attention_batched", "paged_attention_cpu", "backend_for",
           "triton_available"]
