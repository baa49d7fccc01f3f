"""Torch reference attention over a paged KV pool: the CPU implementation and the test oracle.

Contracts (shared with the Triton implementation):

* ``q[T,H,D]``: new queries of R requests, request r owning rows ``qo_indptr[r]:qo_indptr[r+1]``.
* ``k_pool/v_pool[S,Hkv,D]``: one layer of a KV pool; slot ``s`` holds one token.
* ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` are the slots of request r's shard, holding the
  contiguous positions ``kv_start_pos[r], kv_start_pos[r]+1, ...``.
* ``q_positions[T]``: absolute position of each query. Masking follows ``AttentionSpec``.
* Returns ``o[T,H,D]`` in q's dtype and ``lse[T,H]`` float32 (natural log). A query that sees no
  key gets ``o = 0`` and ``lse = -inf``, so shards merge exactly with :func:`merge_states_ref`.

Index tensors are int32 or int64 on q's device.
"""
from __future__ import annotations

import torch

from lamina.types import AttentionSpec


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            spec: AttentionSpec) -> torch.Tensor:
    """Masked scores ``[H, t, n]`` in float32 for queries ``q[t,H,D]`` over keys ``k[n,H,D]``."""
    s = torch.einsum("thd,nhd->htn", q.float(), k.float()) * spec.scale
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    visible = k_pos[None, :] <= q_pos[:, None]
    if spec.window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < spec.window
    return s.masked_fill(~visible[None], float("-inf"))


def attention_over_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q[t,H,D]`` over contiguous ``k/v[n,Hkv,D]``: ``(o[t,H,D], lse[t,H])``."""
    g = spec.group_size
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = _scores(q, k, q_pos, k_pos, spec)
    lse = torch.logsumexp(s, dim=-1)  # [H, t]; -inf where nothing is visible
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("htn,nhd->thd", p, v.float())
    return o.to(q.dtype), lse.transpose(0, 1).contiguous()


def check_shapes(q: torch.Tensor, k_pool: torch.Tensor, spec: AttentionSpec) -> None:
    """Raise ``ValueError`` unless ``q[T,H,D]`` and ``k_pool[S,Hkv,D]`` match ``spec``."""
    D = q.shape[-1]
    if (q.shape[1] != spec.num_heads or k_pool.shape[1:] != (spec.num_kv_heads, D)
            or D != spec.head_dim):
        raise ValueError(f"paged_attention: q{tuple(q.shape)} / k_pool{tuple(k_pool.shape)} do not "
                         f"match spec (H={spec.num_heads}, Hkv={spec.num_kv_heads}, "
                         f"D={spec.head_dim})")


def _rows(pool: torch.Tensor, scale: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """float32 K or V rows ``pool[idx]``, dequantised with their scales where given."""
    rows = pool[idx].float()
    return rows if scale is None else rows * scale[idx][..., None]


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        q_positions: torch.Tensor, kv_start_pos: torch.Tensor,
                        spec: AttentionSpec, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference paged attention, one request at a time (see module docstring); an 8-bit pool
    (:mod:`lamina.kernels.kv_format`) is dequantised with its ``k_scale``/``v_scale[S,Hkv]``,
    then attended."""
    T, H, D = q.shape
    o = q.new_zeros(T, H, D)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    starts = kv_start_pos.tolist()
    for r in range(len(qo) - 1):
        qs, qe, ks, ke = qo[r], qo[r + 1], kv[r], kv[r + 1]
        if qe == qs or ke == ks:
            continue
        idx = kv_indices[ks:ke].long()
        k_pos = torch.arange(starts[r], starts[r] + ke - ks, device=q.device)
        o[qs:qe], lse[qs:qe] = attention_over_keys(
            q[qs:qe], _rows(k_pool, k_scale, idx), _rows(v_pool, v_scale, idx),
            q_positions[qs:qe].long(), k_pos, spec)
    return o, lse


def merge_states_ref(os: torch.Tensor | list[torch.Tensor],
                     lses: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention of the same queries over disjoint KV shards, exactly.

    ``os[S,T,H,D]`` (or a list of S ``[T,H,D]``), ``lses[S,T,H]`` float32. Returns ``(o, lse)`` with
    o in the inputs' dtype; rows that no shard saw stay ``o = 0``, ``lse = -inf``.
    """
    o_stack = torch.stack(list(os)) if isinstance(os, (list, tuple)) else os
    l_stack = torch.stack(list(lses)) if isinstance(lses, (list, tuple)) else lses
    lse = torch.logsumexp(l_stack, dim=0)  # [T,H]
    w = torch.exp(l_stack - lse[None]).nan_to_num(0.0)  # [S,T,H]
    o = (w[..., None] * o_stack.float()).sum(0)
    return o.to(o_stack.dtype), lse


def merge_rows_ref(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, og: torch.Tensor,
                   lg: torch.Tensor) -> None:
    """In place: rows ``rows[n]`` of ``(o[T,H,D], lse[T,H])`` merged by log-sum-exp with another
    partial state of the same queries, ``(og[n,H,D], lg[n,H])`` (a cascade's prefix pass).
    Every ``lg`` must be finite (each query saw a key of that pass)."""
    l1 = lse[rows]
    m = torch.maximum(l1, lg)
    w1, w2 = torch.exp(l1 - m), torch.exp(lg - m)
    total = w1 + w2
    merged = (o[rows].float() * w1[..., None] + og.float() * w2[..., None]) / total[..., None]
    o[rows] = merged.to(o.dtype)
    lse[rows] = m + torch.log(total)
