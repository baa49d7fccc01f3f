"""Start-up profiling of the borrowing performance model (Infinite-LLM §6).

:func:`profile_perf` measures, on this machine and for this split model, the two curves of
:class:`~lamina.deployment.borrowing.PerfModel`, both per attention layer:

* ``compute_s(β)``: one decode step of β requests through every slice, attention replaced by
  zeros (so only the dense part counts), divided by the number of layers;
* ``attn_s(S)``: one decode query attending a context of S tokens with the paged-attention
  kernel the memory nodes use.

Each point is the median of ``reps`` timed runs after one warm-up.
"""
from __future__ import annotations

import statistics
import time

import torch

from lamina.deployment.borrowing import PerfModel
from lamina.kernels import paged_attention
from lamina.splitter import SplitModel


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_perf(split: SplitModel, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 batches: tuple[int, ...] = (1, 8, 32), contexts: tuple[int, ...] = (64, 512),
                 reps: int = 3) -> PerfModel:
    """Measure ``f`` and ``g`` for ``split`` on ``device``; see the module docstring."""
    layers = len(split.specs)
    spec = split.specs[0]

    def zeros(layer, q, k, v):
        return torch.zeros_like(q)

    compute = []
    for b in batches:
        ids = torch.zeros(b, dtype=torch.long, device=device)
        pos = torch.full((b,), 16, dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)
        with torch.inference_mode():
            compute.append(_median_s(lambda: split.forward(ids, pos, rows, zeros), reps) / layers)

    attn = []
    for s in contexts:
        k = torch.randn(s, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        q = torch.randn(1, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        ptr = torch.tensor([0, 1], dtype=torch.int32, device=device)
        kv_ptr = torch.tensor([0, s], dtype=torch.int32, device=device)
        idx = torch.arange(s, dtype=torch.int32, device=device)
        qpos = torch.tensor([s - 1], dtype=torch.long, device=device)
        start = torch.zeros(1, dtype=torch.long, device=device)
        attn.append(_median_s(lambda: paged_attention(q, k, v, ptr, kv_ptr, idx, qpos, start,
                                                      spec), reps))
    return PerfModel(list(batches), compute, list(contexts), attn)
