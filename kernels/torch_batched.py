"""Vectorised torch paged attention with padded ``bmm``.

On CPU the default path is :mod:`lamina.kernels.torch_sparse`, which hands this module its
prefill chunks and every input it does not take (other devices, non-float32 pools).

Same contract as :func:`lamina.kernels.reference.paged_attention_ref` (``q[T,H,D]``,
``k_pool/v_pool[S,Hkv,D]``, CSR ``qo_indptr/kv_indptr/kv_indices``, ``q_positions[T]``,
``kv_start_pos[R]``; returns ``o[T,H,D]`` in q's dtype and float32 ``lse[T,H]``, ``o = 0,
lse = -inf`` where a query sees no key), but with no Python loop over requests:

* requests are split into two groups, decode (one query) and extend (several), so one long
  prompt chunk does not pad every decode request to its length;
* each group's KV is gathered with ``index_select`` (one per KV head, into a reused workspace)
  as a padded ``[Hkv, R, Nmax, D]`` batch (padding repeats the request's last slot, so unused
  pool slots are never read); the ``G`` query heads sharing a KV head are stacked as the rows of
  one ``[Qmax*G, D]`` matrix per (KV head, request), so scores and ``p @ V`` are one ``bmm`` each
  over ``Hkv * R`` matrices, and masks (causal by absolute position, window, padding), softcap
  and log-sum-exp are elementwise ops over the whole group;
* within a group, requests are sorted by KV length and cut into a few length buckets when
  padding to the longest would waste much (ragged batches; see :func:`_request_chunks`);
* extend groups are processed in query chunks so the float32 scores stay under
  ``max_score_elems`` elements.

The only Python loops are over KV heads (the gather), request chunks and query chunks.
Computation is float32 whatever the input dtype; ``o`` is cast back to q's dtype.
"""
from __future__ import annotations

import threading

import torch

from lamina.types import AttentionSpec

MAX_SCORE_ELEMS = 1 << 24  # float32 scores per (request chunk, query chunk): 64 MiB
MIN_CHUNK_BYTES = 4 << 20  # smallest gathered K+V of a request chunk cut to avoid padding
WORKSPACE_MAX_BYTES = 1 << 30  # larger gathers get a fresh (uncached) buffer
_WORKSPACE = threading.local()


def _request_chunks(kv_lens: list[int], bytes_per_token: int, min_bytes: int
                    ) -> list[tuple[int, int]]:
    """Cut requests sorted by ascending KV length into runs ``[lo, hi)`` that pad little.

    A run is closed before request i when padding everything to i's length would cost more than
    half again the run's real tokens, and the run already gathers at least ``min_bytes``
    (so uniform batches stay one run and ragged ones get a few length buckets).
    """
    chunks, lo, total = [], 0, 0
    for i, n in enumerate(kv_lens):
        if i > lo and (i + 1 - lo) * n > 1.5 * (total + n) and total * bytes_per_token >= min_bytes:
            chunks.append((lo, i))
            lo, total = i, 0
        total += n
    chunks.append((lo, len(kv_lens)))
    return chunks


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """A reused float32 CPU buffer of at least ``numel`` elements (per thread).

    Fresh multi-megabyte CPU allocations are served by ``mmap`` and page-fault on first touch,
    which costs more than the gather itself; reusing one buffer avoids that. The buffer keeps
    the largest size asked for, up to ``WORKSPACE_MAX_BYTES``. Off the CPU the caching allocator
    already does this, so a plain allocation is returned.
    """
    if device.type != "cpu" or numel * 4 > WORKSPACE_MAX_BYTES:
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf = getattr(_WORKSPACE, "buf", None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = torch.empty(numel, dtype=torch.float32)
        _WORKSPACE.buf = buf
    return buf[:numel]


def _gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, R: int,
               n_max: int) -> torch.Tensor:
    """float32 ``[2, Hkv, R, Nmax, D]`` (K then V, one contiguous block per KV head)."""
    _, Hkv, D = k_pool.shape
    kv = _workspace(2 * Hkv * R * n_max * D, k_pool.device).view(2, Hkv, R * n_max, D)
    for i, pool in enumerate((k_pool, v_pool)):
        for h in range(Hkv):
            if pool.dtype == torch.float32:
                torch.index_select(pool[:, h], 0, slots, out=kv[i, h])
            else:
                kv[i, h].copy_(pool[:, h].index_select(0, slots))
    return kv.view(2, Hkv, R, n_max, D)


def _attend_group(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  kv_indices: torch.Tensor, q_positions: torch.Tensor, q_off: torch.Tensor,
                  q_len: torch.Tensor, kv_off: torch.Tensor, kv_len: torch.Tensor,
                  kv_start: torch.Tensor, spec: AttentionSpec, out_o: torch.Tensor,
                  out_lse: torch.Tensor, max_score_elems: int) -> None:
    """Attend one group of R requests (all with q_len >= 1 and kv_len >= 1); int64 index args
    on q's device. Writes the group's rows of ``out_o[T,H,D]`` and ``out_lse[T,H]``."""
    dev = q.device
    R = q_len.numel()
    G, Hkv, D = spec.group_size, spec.num_kv_heads, spec.head_dim
    q_max, n_max = int(q_len.max()), int(kv_len.max())

    n = torch.arange(n_max, device=dev)
    key_idx = kv_off[:, None] + torch.minimum(n[None, :], kv_len[:, None] - 1)
    slots = kv_indices.index_select(0, key_idx.view(-1)).long()
    k_pos = kv_start[:, None] + n[None, :]  # [R, Nmax]
    k_pad = n[None, :] >= kv_len[:, None]  # [R, Nmax]
    kv = _gather_kv(k_pool, v_pool, slots, R, n_max)

    keys = kv[0].view(Hkv * R, n_max, D).transpose(1, 2)  # [Hkv*R, D, Nmax]
    values = kv[1].view(Hkv * R, n_max, D)
    q_chunk = max(1, min(q_max, max_score_elems // max(1, R * Hkv * G * n_max)))
    for q0 in range(0, q_max, q_chunk):
        qm = min(q_chunk, q_max - q0)
        if q_max == 1:  # decode: one row per request
            q_valid, rows = None, q_off[:, None]
        else:
            qi = q0 + torch.arange(qm, device=dev)
            q_valid = qi[None, :] < q_len[:, None]  # [R, qm]
            rows = q_off[:, None] + torch.minimum(qi[None, :], q_len[:, None] - 1)  # [R, qm]
        q_pos = q_positions.index_select(0, rows.view(-1)).view(R, qm, 1).long()
        hidden = (k_pos[:, None, :] > q_pos) | k_pad[:, None, :]  # [R, qm, Nmax]
        if spec.window is not None:
            hidden |= (q_pos - k_pos[:, None, :]) >= spec.window
        # queries as [Hkv, R, qm, G, D]: the G heads sharing a KV head are rows of one matrix
        qg = q.index_select(0, rows.view(-1)).view(R, qm, Hkv, G, D).permute(2, 0, 1, 3, 4)
        qg = (qg.float() * spec.scale).reshape(Hkv * R, qm * G, D)
        s = torch.bmm(qg, keys)  # [Hkv*R, qm*G, Nmax]
        if spec.softcap:
            s = s.div_(spec.softcap).tanh_().mul_(spec.softcap)
        s.view(Hkv, R, qm, G, n_max).masked_fill_(hidden[None, :, :, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hkv*R, qm*G]; -inf where nothing is visible
        p = s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
        o_chunk = torch.bmm(p, values)  # [Hkv*R, qm*G, D]
        # [Hkv, R, qm, G, ...] -> [R, qm, Hkv, G, ...] = [R, qm, H, ...], valid rows only
        o_rows = o_chunk.view(Hkv, R, qm, G, D).permute(1, 2, 0, 3, 4)
        lse_rows = lse.view(Hkv, R, qm, G).permute(1, 2, 0, 3)
        if q_valid is None:
            out_o.view(-1, Hkv, G, D).index_copy_(0, q_off, o_rows[:, 0].to(out_o.dtype))
            out_lse.view(-1, Hkv, G).index_copy_(0, q_off, lse_rows[:, 0])
        else:
            tok = rows[q_valid]
            out_o.view(-1, Hkv, G, D)[tok] = o_rows[q_valid].to(out_o.dtype)
            out_lse.view(-1, Hkv, G)[tok] = lse_rows[q_valid]


def paged_attention_batched(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                            kv_indices: torch.Tensor, q_positions: torch.Tensor,
                            kv_start_pos: torch.Tensor, spec: AttentionSpec, *,
                            max_score_elems: int = MAX_SCORE_ELEMS,
                            min_chunk_bytes: int = MIN_CHUNK_BYTES
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised paged attention (see the module docstring); works on any device.

    ``max_score_elems`` bounds the float32 score tensor of one (request chunk, query chunk);
    ``min_chunk_bytes`` is the least gathered float32 K+V of a request chunk that is cut off to
    save padding. Both only trade speed for memory; results do not depend on them.
    """
    T, H, D = q.shape
    if H != spec.num_heads or k_pool.shape[1:] != (spec.num_kv_heads, D) or D != spec.head_dim:
        raise ValueError(f"paged_attention: q{tuple(q.shape)} / k_pool{tuple(k_pool.shape)} do not "
                         f"match spec (H={spec.num_heads}, Hkv={spec.num_kv_heads}, "
                         f"D={spec.head_dim})")
    o = torch.zeros((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or qo_indptr.numel() < 2:
        return o, lse
    dev = q.device
    qo = qo_indptr.to(dev, torch.int64)
    kv = kv_indptr.to(dev, torch.int64)
    q_len, kv_len = qo.diff(), kv.diff()
    active = (q_len > 0) & (kv_len > 0)
    starts = kv_start_pos.to(dev, torch.int64)
    bytes_per_token = 2 * spec.num_kv_heads * D * 4  # gathered float32 K and V
    for group in (active & (q_len == 1), active & (q_len > 1)):
        reqs = group.nonzero().flatten()
        if reqs.numel() == 0:
            continue
        reqs = reqs[torch.argsort(kv_len[reqs], stable=True)]  # similar lengths pad less
        for lo, hi in _request_chunks(kv_len[reqs].tolist(), bytes_per_token, min_chunk_bytes):
            r = reqs[lo:hi]
            _attend_group(q, k_pool, v_pool, kv_indices, q_positions, qo[r], q_len[r], kv[r],
                          kv_len[r], starts[r], spec, o, lse, max_score_elems)
    return o, lse
