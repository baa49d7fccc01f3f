"""Sparse-op torch paged attention: the default CPU path.

Same contract as :func:`lamina.kernels.reference.paged_attention_ref`. Decode (and most
extend) queries are computed without gathering K/V into a padded buffer, with two stock
sparse kernels that read pool rows in place:

* scores: one ``torch.sparse.sampled_addmm`` over a CSR pattern whose row ``(t, h)`` (query
  row ``t``, query head ``h``) holds exactly the pool rows ``slot * Hkv + h // G`` of the keys
  that query can see (causal and window masks are applied when the pattern is built, so no key
  is ever masked at run time and a query that sees nothing has no row);
* softmax: the CSR values are scattered into a reused ``-inf`` filled ``[rows, Nmax]`` buffer
  (``scatter_``), softmaxed densely, and ``lse = max(s) - log(max(p))`` (exact: the largest
  probability is ``exp(max(s) - lse)``);
* ``p @ V``: one ``F.embedding_bag(mode="sum", per_sample_weights=p)`` over the same indices.

Everything that depends only on the index tensors (the CSR pattern, scatter positions, the
``-inf`` buffer, the old-path request chunks) is a *plan*, built once and cached per thread
(:mod:`lamina.kernels.plan_cache`): the memory node calls the kernel with the same index
tensors for every layer of a step, so later layers skip all index work. A cached plan is only
reused when the new index tensors are equal to the ones it was built from (compared with
``torch.equal``), so reuse never changes results.

Requests with more than ``max_sparse_q`` queries (prefill chunks) go to the padded ``bmm`` of
:mod:`lamina.kernels.torch_batched` when that computes fewer than ``SPARSE_EXTEND_COST`` times
as many scores as the sparse path would (a GEMM over a dense block beats per-score dot products;
ragged prompts pad a lot, so they go sparse). Non-float32 pools and non-CPU tensors go to
:func:`lamina.kernels.torch_batched.paged_attention_batched` whole.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lamina.kernels import plan_cache
from lamina.kernels.torch_batched import (MAX_SCORE_ELEMS, MIN_CHUNK_BYTES, _attend_group,
                                          _request_chunks, paged_attention_batched)
from lamina.kernels.reference import check_shapes
from lamina.types import AttentionSpec

MAX_SPARSE_Q = 8  # requests with at most this many queries take the sparse path
SPARSE_EXTEND_COST = 2.5  # sparse cost per score / padded-bmm cost per score (measured, 2 cores)
_NEG = float("-inf")
_INT32_LIMIT = 2**31  # CSR / bag indices are int32 below this many pool rows and entries


@dataclass
class SparsePlan:
    """Index work for one call's shapes and index tensors (reused across layers)."""

    rows: torch.Tensor | None  # int64 [Tg] query rows of the sparse group; None = all rows
    pattern: torch.Tensor | None  # float32 sparse CSR [Tg*H, S*Hkv]; None = no sparse rows
    col: torch.Tensor  # [nnz] pool rows (slot * Hkv + kv head), int32 or int64
    offsets: torch.Tensor  # [Tg*H] bag starts (same dtype as col)
    pos: torch.Tensor  # int64 [nnz] position of each entry in the [Tg*H*Nmax] buffer
    scores: torch.Tensor  # float32 [Tg*H, Nmax] buffer, -inf except at ``pos``
    flat_scores: torch.Tensor  # the same buffer, flat
    extend: list[tuple[torch.Tensor, ...]]  # old-path request chunks (q_off, q_len, ...)

    @property
    def nbytes(self) -> int:
        ts = [self.col, self.offsets, self.pos, self.scores] + [t for c in self.extend for t in c]
        ts += [] if self.rows is None else [self.rows]
        ts += [] if self.pattern is None else [self.pattern.values()]  # (shares col, offsets)
        return sum(t.numel() * t.element_size() for t in ts)


def _split(q_len: np.ndarray, kv_len: np.ndarray, starts: np.ndarray, q_pos: np.ndarray,
           req_of_row: np.ndarray, spec: AttentionSpec, max_sparse_q: int, extend_cost: float,
           max_score_elems: int, min_chunk_bytes: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Which requests take the sparse path, and the padded path's request chunks of the rest.

    Requests with at most ``max_sparse_q`` queries go sparse. Longer ones (prefill chunks) go
    sparse too when ``extend_cost * (scores the sparse path computes)`` is below the padded
    path's ``[requests, Qmax, Nmax]`` score count (ragged prompts pad a lot; a GEMM over a
    dense block beats per-score dot products). The sparse rows' ``[rows * H, Nmax]`` softmax
    buffer is kept under ``max_score_elems`` (else only decode rows go sparse).
    """
    H = spec.num_heads
    active = (q_len > 0) & (kv_len > 0)

    def chunks(mask: np.ndarray) -> list[np.ndarray]:  # sorted by KV length, little padding
        ext = np.flatnonzero(mask)
        ext = ext[np.argsort(kv_len[ext], kind="stable")]
        cuts = _request_chunks(kv_len[ext].tolist(), 2 * spec.num_kv_heads * spec.head_dim * 4,
                               min_chunk_bytes) if ext.size else []
        return [ext[lo:hi] for lo, hi in cuts]

    def elems(mask: np.ndarray) -> int:
        return int(q_len[mask].sum()) * H * int(kv_len[mask].max()) if mask.any() else 0

    sparse = active & (q_len <= max_sparse_q)
    longer = active & ~sparse
    if longer.any() and extend_cost < float("inf") and elems(active) <= max_score_elems:
        padded = sum(c.size * int(q_len[c].max()) * int(kv_len[c].max()) for c in chunks(longer))
        req = req_of_row[longer[req_of_row]]
        qp = q_pos[longer[req_of_row]]
        lo = starts[req] if spec.window is None else np.maximum(starts[req], qp - spec.window + 1)
        seen = np.clip(np.minimum(qp, starts[req] + kv_len[req] - 1) - lo + 1, 0, None).sum()
        if extend_cost * seen < padded:
            sparse = active
    if elems(sparse) > max_score_elems:
        sparse = active & (q_len == 1)
    return sparse, chunks(active & ~sparse)


def _build_plan(T: int, S: int, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, q_positions: torch.Tensor, kv_start_pos: torch.Tensor,
                spec: AttentionSpec, max_sparse_q: int, sparse_extend_cost: float,
                max_score_elems: int, min_chunk_bytes: int) -> SparsePlan:
    """Index work of one call (numpy: a few dozen small array ops, ~0.2 ms for 16 requests)."""
    H, Hkv, G = spec.num_heads, spec.num_kv_heads, spec.group_size
    qo, kv, starts, q_pos, slots_all = (t.numpy().astype(np.int64, copy=False) for t in
                                         (qo_indptr, kv_indptr, kv_start_pos, q_positions,
                                          kv_indices))
    q_len, kv_len = np.diff(qo), np.diff(kv)
    R = q_len.size
    req_of_row = np.repeat(np.arange(R), q_len)
    sparse_req, chunks = _split(q_len, kv_len, starts, q_pos, req_of_row, spec, max_sparse_q,
                                sparse_extend_cost, max_score_elems, min_chunk_bytes)
    extend = [tuple(torch.from_numpy(a[r]) for a in (qo, q_len, kv, kv_len, starts))
              for r in chunks]

    # sparse path: one CSR row per (query row, head) over the keys that query sees
    rows = np.flatnonzero(sparse_req[req_of_row])
    req = req_of_row[rows]
    n = np.arange(kv_len[req].max() if rows.size else 0)
    k_pos = starts[req, None] + n  # [Tg, Nmax]
    qp = q_pos[rows, None]
    vis = (n < kv_len[req, None]) & (k_pos <= qp)
    if spec.window is not None:
        vis &= (qp - k_pos) < spec.window
    keep = vis.any(1)  # a row that sees no key is left out: its o = 0, lse = -inf
    if not keep.all():
        rows, req, vis = rows[keep], req[keep], vis[keep]
    Tg, n_max = rows.size, n.size
    if Tg == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return SparsePlan(empty, None, empty, empty, empty, torch.zeros(0, 0), torch.zeros(0),
                          extend)
    key = kv[req, None] + np.minimum(n, kv_len[req, None] - 1)  # in range for every n
    slots = slots_all[key]
    used = slots[vis]
    if used.min() < 0 or used.max() >= S:
        raise IndexError(f"paged_attention: kv_indices hold slots outside the pool [0, {S})")
    pos = np.flatnonzero(np.broadcast_to(vis[:, None, :], (Tg, H, n_max)))
    col = (slots[:, None, :] * Hkv + (np.arange(H) // G)[:, None]).reshape(-1)[pos]
    crow = np.zeros(Tg * H + 1, dtype=np.int64)
    np.cumsum(np.repeat(vis.sum(1), H), out=crow[1:])
    idx_dtype = np.int32 if max(S * Hkv, col.size) < _INT32_LIMIT else np.int64
    col, crow = torch.from_numpy(col.astype(idx_dtype)), torch.from_numpy(crow.astype(idx_dtype))
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, col, torch.zeros(col.numel()),
                                          size=(Tg * H, S * Hkv))
    with torch.inference_mode(False):  # written in place by calls in and out of inference mode
        scores = torch.full((Tg * H, n_max), _NEG)
    every_row = Tg == T and not extend  # all rows, in order (nothing filtered above)
    return SparsePlan(None if every_row else torch.from_numpy(rows), pattern, col, crow[:-1],
                      torch.from_numpy(pos), scores, scores.view(-1), extend)


def sparse_eligible(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_cpu` takes its sparse path for these tensors."""
    return (q.device.type == "cpu" and k_pool.dtype == torch.float32
            and v_pool.dtype == torch.float32 and k_pool.is_contiguous()
            and v_pool.is_contiguous())


def _attend_sparse(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   plan: SparsePlan, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o[Tg*H, D], lse[Tg*H])`` float32 for the plan's sparse rows."""
    S, Hkv, D = k_pool.shape
    qg = (q if plan.rows is None else q.index_select(0, plan.rows)).reshape(-1, D)
    if qg.dtype != torch.float32:
        qg = qg.float()
    alpha = spec.scale / spec.softcap if spec.softcap else spec.scale
    s = torch.sparse.sampled_addmm(plan.pattern, qg, k_pool.view(S * Hkv, D).t(),
                                   beta=0.0, alpha=alpha).values()
    if spec.softcap:
        s = s.tanh_().mul_(spec.softcap)
    plan.flat_scores.scatter_(0, plan.pos, s)
    p = torch.softmax(plan.scores, -1)
    lse = plan.scores.amax(-1).sub_(p.amax(-1).log_())
    w = p.view(-1).index_select(0, plan.pos)
    o = F.embedding_bag(plan.col, v_pool.view(S * Hkv, D), plan.offsets, mode="sum",
                        per_sample_weights=w)
    return o, lse


def paged_attention_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, q_positions: torch.Tensor,
                        kv_start_pos: torch.Tensor, spec: AttentionSpec, *,
                        max_sparse_q: int = MAX_SPARSE_Q,
                        sparse_extend_cost: float = SPARSE_EXTEND_COST,
                        max_score_elems: int = MAX_SCORE_ELEMS,
                        min_chunk_bytes: int = MIN_CHUNK_BYTES,
                        cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention, sparse ops for short queries (see the module docstring).

    Inputs that the sparse path does not take (see :func:`sparse_eligible`) go to
    :func:`paged_attention_batched` whole. ``max_sparse_q`` and ``sparse_extend_cost`` choose
    the path of each request (see :func:`_split`; ``sparse_extend_cost=inf`` keeps every request
    with more than ``max_sparse_q`` queries on the padded path), ``max_score_elems`` and
    ``min_chunk_bytes`` bound memory; none changes results. ``cache=False`` rebuilds the plan.
    """
    check_shapes(q, k_pool, spec)
    T, H, D = q.shape
    if not sparse_eligible(q, k_pool, v_pool):
        return paged_attention_batched(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                                       q_positions, kv_start_pos, spec,
                                       max_score_elems=max_score_elems,
                                       min_chunk_bytes=min_chunk_bytes)
    if T == 0 or qo_indptr.numel() < 2:
        return (torch.zeros((T, H, D), dtype=q.dtype),
                torch.full((T, H), _NEG, dtype=torch.float32))
    S = k_pool.shape[0]
    index = (qo_indptr, kv_indptr, kv_start_pos, q_positions, kv_indices)
    key = (T, S, H, spec.num_kv_heads, D, spec.window, max_sparse_q, sparse_extend_cost,
           max_score_elems, min_chunk_bytes)
    plan = plan_cache.lookup(key, index) if cache else None
    if plan is None:
        plan = _build_plan(T, S, qo_indptr, kv_indptr, kv_indices, q_positions, kv_start_pos,
                           spec, max_sparse_q, sparse_extend_cost, max_score_elems,
                           min_chunk_bytes)
        if cache:
            plan_cache.store(key, index, plan, plan.nbytes)
    if plan.pattern is not None:
        o_s, lse_s = _attend_sparse(q, k_pool, v_pool, plan, spec)
        if plan.rows is None:
            o_s = o_s.view(T, H, D)
            return (o_s if q.dtype == torch.float32 else o_s.to(q.dtype)), lse_s.view(T, H)
    o = torch.zeros((T, H, D), dtype=q.dtype)
    lse = torch.full((T, H), _NEG, dtype=torch.float32)
    if plan.pattern is not None:
        o.view(T, H * D).index_copy_(0, plan.rows, o_s.view(-1, H * D).to(q.dtype))
        lse.index_copy_(0, plan.rows, lse_s.view(-1, H))
    for chunk in plan.extend:
        _attend_group(q, k_pool, v_pool, kv_indices, q_positions, *chunk, spec, o, lse,
                      max_score_elems)
    return o, lse
