"""Sparse-op torch paged attention: the default CPU path (DESIGN.md §4).

Same contract as :func:`lamina.kernels.reference.paged_attention_ref`. Decode (and short
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

Requests with more than ``max_sparse_q`` queries (prefill chunks), non-float32 pools, and
non-CPU tensors go to :func:`lamina.kernels.torch_batched.paged_attention_batched` (padded
``bmm``), which is also what long extends should use: a GEMM beats per-score dot products there.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lamina.kernels import plan_cache
from lamina.kernels.torch_batched import (MAX_SCORE_ELEMS, MIN_CHUNK_BYTES, _attend_group,
                                          _request_chunks, paged_attention_batched)
from lamina.types import AttentionSpec

MAX_SPARSE_Q = 1  # requests with at most this many queries take the sparse path
_NEG = float("-inf")


@dataclass
class SparsePlan:
    """Index work for one call's shapes and index tensors (reused across layers)."""

    rows: torch.Tensor | None  # int64 [Tg] query rows of the sparse group; None = all rows
    pattern: torch.Tensor | None  # float32 sparse CSR [Tg*H, S*Hkv]; None = no sparse rows
    col: torch.Tensor  # [nnz] pool rows (slot * Hkv + kv head), int32 or int64
    offsets: torch.Tensor  # [Tg*H] bag starts (same dtype as col)
    pos: torch.Tensor  # int64 [nnz] position of each entry in the [Tg*H*Nmax] buffer
    scores: torch.Tensor  # float32 [Tg*H, Nmax] buffer, -inf except at ``pos``
    extend: list[tuple[torch.Tensor, ...]]  # old-path request chunks (q_off, q_len, ...)


def _build_plan(T: int, S: int, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, q_positions: torch.Tensor, kv_start_pos: torch.Tensor,
                spec: AttentionSpec, max_sparse_q: int, min_chunk_bytes: int) -> SparsePlan:
    H, Hkv, G = spec.num_heads, spec.num_kv_heads, spec.group_size
    qo, kv = qo_indptr.long(), kv_indptr.long()
    starts, q_pos, slots_all = kv_start_pos.long(), q_positions.long(), kv_indices.long()
    q_len, kv_len = qo.diff(), kv.diff()
    R = q_len.numel()
    active = (q_len > 0) & (kv_len > 0)
    sparse_req = active & (q_len <= max_sparse_q)

    # old path: extend requests sorted by KV length, cut into request chunks
    extend: list[tuple[torch.Tensor, ...]] = []
    ext = (active & (q_len > max_sparse_q)).nonzero().flatten()
    if ext.numel():
        ext = ext[torch.argsort(kv_len[ext], stable=True)]
        bytes_per_token = 2 * Hkv * spec.head_dim * 4
        for lo, hi in _request_chunks(kv_len[ext].tolist(), bytes_per_token, min_chunk_bytes):
            r = ext[lo:hi]
            extend.append((qo[r], q_len[r], kv[r], kv_len[r], starts[r]))

    # sparse path: one CSR row per (query row, head) over the keys that query sees
    req_of_row = torch.repeat_interleave(torch.arange(R), q_len, output_size=T)
    rows = sparse_req[req_of_row].nonzero().flatten()
    req = req_of_row[rows]
    n_max = int(kv_len[req].max()) if rows.numel() else 0
    n = torch.arange(n_max)
    k_pos = starts[req, None] + n  # [Tg, Nmax]
    qp = q_pos[rows, None]
    vis = (n < kv_len[req, None]) & (k_pos <= qp)
    if spec.window is not None:
        vis &= (qp - k_pos) < spec.window
    keep = vis.any(1)  # a row that sees no key is left out: its o = 0, lse = -inf
    if not bool(keep.all()):
        rows, req, vis = rows[keep], req[keep], vis[keep]
    Tg = rows.numel()
    if Tg == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return SparsePlan(torch.zeros(0, dtype=torch.long), None, empty, empty, empty,
                          torch.zeros(0, 0), extend)
    key = kv[req, None] + torch.minimum(n, kv_len[req, None] - 1)  # in-range for every n
    pool_row = slots_all[key] * Hkv  # [Tg, Nmax]
    vis3 = vis[:, None, :].expand(Tg, H, n_max)
    col = (pool_row[:, None, :] + (torch.arange(H) // G)[:, None])[vis3]
    pos = vis3.reshape(-1).nonzero().flatten()
    crow = torch.zeros(Tg * H + 1, dtype=torch.long)
    torch.cumsum(vis.sum(1).repeat_interleave(H), 0, out=crow[1:])
    idx_dtype = torch.int32 if max(S * Hkv, col.numel()) < 2**31 else torch.int64
    col, crow = col.to(idx_dtype), crow.to(idx_dtype)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, col, torch.zeros(col.numel()),
                                          size=(Tg * H, S * Hkv))
    scores = torch.full((Tg * H, n_max), _NEG)
    if Tg == T and not extend:  # every row, in order (after the `keep` filter above)
        rows = None
    return SparsePlan(rows, pattern, col, crow[:-1], pos, scores, extend)


def sparse_eligible(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_cpu` takes its sparse path for these tensors."""
    return (q.device.type == "cpu" and k_pool.dtype == torch.float32
            and v_pool.dtype == torch.float32 and k_pool.is_contiguous()
            and v_pool.is_contiguous())


def _attend_sparse(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   plan: SparsePlan, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o[Tg*H, D], lse[Tg*H])`` float32 for the plan's sparse rows."""
    S, Hkv, D = k_pool.shape
    qg = q if plan.rows is None else q.index_select(0, plan.rows)
    qg = qg.reshape(-1, D).float()
    alpha = spec.scale / spec.softcap if spec.softcap else spec.scale
    s = torch.sparse.sampled_addmm(plan.pattern, qg, k_pool.view(S * Hkv, D).t(),
                                   beta=0.0, alpha=alpha).values()
    if spec.softcap:
        s = s.tanh_().mul_(spec.softcap)
    dense = plan.scores.view(-1).scatter_(0, plan.pos, s).view(plan.scores.shape)
    p = torch.softmax(dense, -1)
    lse = dense.amax(-1).sub_(p.amax(-1).log_())
    w = p.view(-1).index_select(0, plan.pos)
    o = F.embedding_bag(plan.col, v_pool.view(S * Hkv, D), plan.offsets, mode="sum",
                        per_sample_weights=w)
    return o, lse


def paged_attention_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, q_positions: torch.Tensor,
                        kv_start_pos: torch.Tensor, spec: AttentionSpec, *,
                        max_sparse_q: int = MAX_SPARSE_Q,
                        max_score_elems: int = MAX_SCORE_ELEMS,
                        min_chunk_bytes: int = MIN_CHUNK_BYTES,
                        cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention, sparse ops for short queries (see the module docstring).

    Inputs that the sparse path does not take (see :func:`sparse_eligible`) go to
    :func:`paged_attention_batched` whole. ``max_sparse_q``, ``max_score_elems`` and
    ``min_chunk_bytes`` only trade speed for memory; ``cache=False`` rebuilds the plan.
    """
    T, H, D = q.shape
    if H != spec.num_heads or k_pool.shape[1:] != (spec.num_kv_heads, D) or D != spec.head_dim:
        raise ValueError(f"paged_attention: q{tuple(q.shape)} / k_pool{tuple(k_pool.shape)} do not "
                         f"match spec (H={spec.num_heads}, Hkv={spec.num_kv_heads}, "
                         f"D={spec.head_dim})")
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
    key = (T, S, H, spec.num_kv_heads, D, spec.window, max_sparse_q, min_chunk_bytes)
    plan = plan_cache.lookup(key, index) if cache else None
    if plan is None:
        plan = _build_plan(T, S, qo_indptr, kv_indptr, kv_indices, q_positions, kv_start_pos,
                           spec, max_sparse_q, min_chunk_bytes)
        if cache:
            plan_cache.store(key, index, plan)
    if plan.pattern is not None:
        o_s, lse_s = _attend_sparse(q, k_pool, v_pool, plan, spec)
        if plan.rows is None:
            return o_s.view(T, H, D).to(q.dtype), lse_s.view(T, H)
    o = torch.zeros((T, H, D), dtype=q.dtype)
    lse = torch.full((T, H), _NEG, dtype=torch.float32)
    if plan.pattern is not None:
        o.view(T, H * D).index_copy_(0, plan.rows, o_s.view(-1, H * D).to(q.dtype))
        lse.index_copy_(0, plan.rows, lse_s.view(-1, H))
    for chunk in plan.extend:
        _attend_group(q, k_pool, v_pool, kv_indices, q_positions, *chunk, spec, o, lse,
                      max_score_elems)
    return o, lse
