"""Triton paged decode attention replayed from CUDA graphs: one host call per layer and step.

Contract: :func:`paged_attention_graphed` is :func:`~lamina.kernels.triton_attention.
paged_attention_triton`'s (host ``qo_indptr``/``kv_indptr``; returns fresh ``o[T,H,D]`` and
``lse[T,H]``), for calls up to :data:`MAX_GRAPH_TOKENS` query tokens; other calls run the
eager kernel.

An eager call spends its host time on two Triton launches, the plan lookup and allocations,
several times the kernel's own time at small batches. Here a step's calls replay a captured
graph instead:

* a *family* is a padded shape: ``T_pad`` tokens and ``R_pad`` requests (powers of two), the
  plan's work list padded to ``W_pad`` items with no-op items (a request with no queries), the
  merge's part count to ``P_pad``, the KV chunk rounded to a power of two, ``N_cap`` key
  slots. It owns static device buffers: the query input, the plan and index tensors, the
  split-KV scratch and the outputs. Consecutive decode steps land in the same family until a
  bucket boundary is crossed;
* within a family, one graph per layer (per ``k_pool``/``v_pool`` pair: their addresses are
  baked into the launch), captured at the layer's first call and replayed after;
* once per step (when the indptrs or index tensors change) the padded plan is uploaded into
  the family's buffers: one asynchronous copy from pinned memory and three device copies;
  per call: the query copied in, the graph replayed, the outputs copied out (one copy of a
  buffer holding both: a fresh result that later replays cannot overwrite).
bench/kernels.py's ``host us`` column gives the host time per call of both paths.

Buffers are used in stream order; a family used from a new stream first makes that stream wait
for the previous one. Families are per thread (like :mod:`lamina.kernels.plan_cache`) and the
:data:`MAX_FAMILIES` most recent are kept. Without CUDA (the interpreter), the same padded
launch runs eagerly, which is how CI checks the padding.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import triton

from lamina.kernels import plan_cache
from lamina.kernels.triton_attention import check_pools, launch, paged_attention_triton
from lamina.kernels.triton_plan import _LaunchPlan, host_plan
from lamina.types import AttentionSpec

MAX_GRAPH_TOKENS = 512  # larger calls (prefill chunks) run eagerly: few, and device-bound
MAX_FAMILIES = 8  # padded shapes kept per thread (each holds its graphs and scratch)
MIN_INDEX_CAP = 1024  # smallest key-slot capacity of a family


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@dataclass
class StepPlan:
    """One step's padded plan, made on the host: the family it needs (``shape``) and the int32
    metadata to upload (``meta``, pinned on CUDA): ``work[3,W_pad] | tok_wbase[T_pad] |
    tok_row0*GP[T_pad] | tok_nch[T_pad] | qo[R_pad+1] | kv[R_pad+1]``."""

    shape: tuple
    meta: torch.Tensor
    T: int
    R: int
    split: bool


def step_plan(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, T: int, Hkv: int, G: int,
              D: int, dev: torch.device) -> StepPlan | None:
    """The padded plan for host indptrs, or None where the call has no work."""
    qo = qo_indptr.to(torch.int64).numpy()
    kv = kv_indptr.to(torch.int64).numpy()
    R = len(qo) - 1
    T_pad, R_pad = _pow2(T), _pow2(R + 1)  # request R (no queries, no keys) pads the work
    qo_p = np.concatenate([qo, np.full(R_pad - R, qo[-1])])
    kv_p = np.concatenate([kv, np.full(R_pad - R, kv[-1])])
    hp = host_plan(qo_p, kv_p, T_pad, Hkv, G, D, None, None, dev, pow2_chunk=True)
    if hp is None:
        return None
    W = hp.work.shape[1]
    W_pad, P_pad = _pow2(W), _pow2(hp.max_ch)
    work = np.concatenate([hp.work, np.tile(np.array([[R], [0], [0]]), (1, W_pad - W))], axis=1)
    tok_wbase, tok_row0, tok_nch = hp.tok
    meta = torch.from_numpy(np.concatenate(
        [work.reshape(-1), tok_wbase, tok_row0 * hp.GP, tok_nch, qo_p, kv_p]).astype(np.int32))
    if dev.type == "cuda":
        meta = meta.pin_memory()
    shape = (T_pad, R_pad, W_pad, P_pad, hp.chunk, hp.GP, hp.block_q, hp.block_m, hp.block_n)
    return StepPlan(shape, meta, T, R, split=P_pad > 1)


@dataclass
class Family:
    """Static buffers and graphs of one padded shape (see the module docstring)."""

    lp: _LaunchPlan
    q: torch.Tensor  # [T_pad, H, D]
    index: torch.Tensor  # int32 [N_cap]: kv_indices
    q_pos: torch.Tensor  # int32 [T_pad]
    kv_start: torch.Tensor  # int32 [R_pad]
    meta: torch.Tensor  # int32, the StepPlan layout
    out: torch.Tensor  # uint8: o[T_pad, H, D] (q's dtype), then lse[T_pad, H] (float32)
    o: torch.Tensor  # a view of ``out``
    lse: torch.Tensor  # a view of ``out``
    graphs: dict = field(default_factory=dict)
    loaded: tuple = ()
    stream: tuple = ()  # (raw handle, torch.cuda.Stream) of the last caller's stream

    def results(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the first ``T`` rows of o and lse: one device copy of ``out``."""
        out = self.out.clone()
        nbytes = self.o.numel() * self.o.element_size()
        o = out[:nbytes].view(self.o.dtype).view(self.o.shape)
        lse = out[nbytes:].view(torch.float32).view(self.lse.shape)
        return o[:T], lse[:T]


def _family(plan: StepPlan, N: int, q: torch.Tensor, Hkv: int, dtype: torch.dtype) -> Family:
    T_pad, R_pad, W_pad, P_pad, chunk, GP, block_q, block_m, block_n = plan.shape
    _, H, D = q.shape
    dev = q.device
    i32 = dict(dtype=torch.int32, device=dev)
    meta = torch.zeros(plan.meta.numel(), **i32)
    W3 = 3 * W_pad
    lp = _LaunchPlan(R_pad, W_pad, P_pad, chunk, GP, block_q, block_m, block_n, cover=plan.split,
                     work=meta[:W3], tok=tuple(meta[W3 + i * T_pad: W3 + (i + 1) * T_pad]
                                               for i in range(3)),
                     qo=meta[W3 + 3 * T_pad: W3 + 3 * T_pad + R_pad + 1],
                     kv=meta[W3 + 3 * T_pad + R_pad + 1:])
    if plan.split:
        lp.o_part = torch.empty((W_pad * Hkv * block_m, D), dtype=torch.float32, device=dev)
        lp.lse_part = torch.empty((W_pad * Hkv * block_m,), dtype=torch.float32, device=dev)
    o_bytes = T_pad * H * D * torch.finfo(dtype).bits // 8
    out = torch.zeros(o_bytes + T_pad * H * 4, dtype=torch.uint8, device=dev)
    return Family(lp, torch.zeros((T_pad, H, D), dtype=dtype, device=dev),
                  torch.zeros(max(MIN_INDEX_CAP, _pow2(N)), **i32), torch.zeros(T_pad, **i32),
                  torch.zeros(R_pad, **i32), meta, out,
                  out[:o_bytes].view(dtype).view(T_pad, H, D),
                  out[o_bytes:].view(torch.float32).view(T_pad, H))


class _Local(threading.local):
    def __init__(self) -> None:
        self.families: dict[tuple, Family] = {}
        self.last: tuple = ()  # (key, qo bytes, kv bytes, plan): the last call's, compared cheaply


_LOCAL = _Local()


def clear() -> None:
    """Forget this thread's families and their graphs."""
    _LOCAL.families.clear()
    _LOCAL.last = ()


def _plan_for(key: tuple, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, T: int, Hkv: int,
              G: int, D: int, dev: torch.device) -> StepPlan | bool:
    """The step's plan (False: no work): the last call's when the indptrs' bytes are equal (a
    step's next layer; ~1 us), else :mod:`~lamina.kernels.plan_cache`'s or a new one."""
    qb, kb = qo_indptr.numpy().tobytes(), kv_indptr.numpy().tobytes()
    last = _LOCAL.last
    if last and last[0] == key and last[1] == qb and last[2] == kb:
        return last[3]
    plan = plan_cache.lookup(key, (qo_indptr, kv_indptr))
    if plan is None:
        plan = step_plan(qo_indptr, kv_indptr, T, Hkv, G, D, dev) or False
        plan_cache.store(key, (qo_indptr, kv_indptr), plan, plan.meta.numel() * 4 if plan else 0)
    _LOCAL.last = (key, qb, kb, plan)
    return plan


def _follow_stream(fam: Family, dev: torch.device) -> None:
    """Order the family's buffers after their last use when the caller's stream changed."""
    raw = _raw_stream(dev.index if dev.index is not None else torch.cuda.current_device())
    if fam.stream and fam.stream[0] == raw:
        return
    stream = torch.cuda.current_stream(dev)
    if fam.stream:
        stream.wait_stream(fam.stream[1])
    fam.stream = (raw, stream)


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)  # far cheaper than current_stream()


def _load(fam: Family, plan: StepPlan, kv_indices: torch.Tensor, q_positions: torch.Tensor,
          kv_start_pos: torch.Tensor) -> None:
    """Upload the step's plan and index tensors unless they are already the family's (the same
    objects, unmodified: ``loaded`` holds them, so their ids cannot be reused meanwhile)."""
    tensors = (kv_indices, q_positions, kv_start_pos)
    versions = tuple(t._version for t in tensors)
    if fam.loaded and fam.loaded[0] is plan and fam.loaded[2] == versions \
            and all(a is b for a, b in zip(fam.loaded[1], tensors)):
        return
    fam.meta.copy_(plan.meta, non_blocking=True)
    fam.index[:kv_indices.numel()].copy_(kv_indices)
    fam.q_pos[:q_positions.numel()].copy_(q_positions)
    fam.kv_start[:kv_start_pos.numel()].copy_(kv_start_pos)
    fam.loaded = (plan, tensors, versions)


def _run(fam: Family, spec: AttentionSpec, pools: tuple) -> None:
    """The captured work: zero-fill (unsplit plans leave rows of key-less requests unwritten),
    the kernel, the merge. ``pools``: ``(k_pool, v_pool, k_scale, v_scale)``, a scale None for
    a float pool (q's dtype, or bfloat16 under float32 queries)."""
    if not fam.lp.cover:
        fam.o.zero_()
        fam.lse.fill_(float("-inf"))
    launch(fam.q, *pools[:2], fam.index, fam.q_pos, fam.kv_start, fam.lp, fam.o, fam.lse,
           spec, *pools[2:])


def _replay(fam: Family, spec: AttentionSpec, pools: tuple) -> None:
    """Runs :func:`_run` from the family's graph for these pools, captured at first use: one
    graph per layer, keyed by what the launch bakes in (the addresses, strides and dtypes of
    the pools and, for 8-bit ones, of their scales)."""
    if not fam.q.is_cuda:  # the interpreter: the same padded launch, eagerly
        _run(fam, spec, pools)
        return
    key = tuple((t.data_ptr(), t.stride(), t.dtype) for t in pools if t is not None)
    graph = fam.graphs.get(key)
    if graph is None:
        _run(fam, spec, pools)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            _run(fam, spec, pools)
        fam.graphs[key] = graph
    graph.replay()


def _readable(q: torch.Tensor, pools: tuple) -> bool:
    """Whether the launch reads ``pools`` (see :func:`_run`) as they are: contiguous rows in
    formats :func:`~lamina.kernels.triton_attention.check_pools` accepts. Pools in q's dtype,
    the common case, are answered without it: it costs microseconds of host time a call."""
    k_pool, v_pool, k_scale, v_scale = pools
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        return False
    if k_scale is None and v_scale is None and k_pool.dtype == v_pool.dtype == q.dtype:
        return True
    try:
        check_pools(q.dtype, *pools)
    except ValueError:
        return False
    return True


def paged_attention_graphed(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                            kv_indices: torch.Tensor, q_positions: torch.Tensor,
                            kv_start_pos: torch.Tensor, spec: AttentionSpec,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention from a padded shape's graph; the contract of
    :func:`~lamina.kernels.triton_attention.paged_attention_triton`. Device indptrs, more than
    :data:`MAX_GRAPH_TOKENS` queries, a stream that is capturing, pools whose last dim is
    strided, or pools the kernel cannot read as they are run the eager kernel (8-bit pools with
    their scales are captured too)."""
    args = (q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions, kv_start_pos, spec,
            k_scale, v_scale)
    pools = (k_pool, v_pool, k_scale, v_scale)
    T, H, D = q.shape
    Hkv = k_pool.shape[1]
    eligible = qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu" \
        and T <= MAX_GRAPH_TOKENS \
        and not (q.is_cuda and torch.cuda.is_current_stream_capturing()) \
        and (H, Hkv, D) == (spec.num_heads, spec.num_kv_heads, spec.head_dim) \
        and k_pool.shape[2] == D and v_pool.shape == k_pool.shape \
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and _readable(q, pools)
    plan = False
    if eligible:  # (else the eager path runs it, or states what is wrong)
        dev = q.device
        key = ("triton_graph", T, Hkv, spec.group_size, D, dev, qo_indptr.dtype, kv_indptr.dtype)
        plan = _plan_for(key, qo_indptr, kv_indptr, T, Hkv, spec.group_size, D, dev)
    if not plan:  # not eligible, or no work
        return paged_attention_triton(*args)
    N = kv_indices.numel()
    fkey = (plan.shape, H, Hkv, D, q.dtype, spec.scale, spec.softcap, spec.window, dev)
    families = _LOCAL.families
    fam = families.get(fkey)
    if fam is not None and fam.index.numel() < N:
        fam = None  # outgrown: a larger family replaces it
    if fam is None:
        fam = families[fkey] = _family(plan, N, q, Hkv, q.dtype)
        while len(families) > MAX_FAMILIES:
            families.pop(next(iter(families)))
    else:
        families[fkey] = families.pop(fkey)  # most recent last
    if q.is_cuda:
        _follow_stream(fam, dev)
    _load(fam, plan, kv_indices, q_positions, kv_start_pos)
    fam.q[:T].copy_(q)
    _replay(fam, spec, pools)
    return fam.results(T)
