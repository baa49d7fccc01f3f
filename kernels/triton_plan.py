"""Host-side launch plans of the Triton paged decode kernel (:mod:`lamina.kernels.triton_attention`).

From the two host indptr arrays alone: the block sizes, the KV chunk of split-KV (sized to the
device's streaming multiprocessors), and the work list (request, query block, KV chunk) with
the per-token indices the merge reads. :func:`host_plan` is the numpy half (also used, padded,
by :mod:`lamina.kernels.triton_graphs`); :func:`_launch_plan` uploads it for one call shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

DEFAULT_KV_CHUNK = 256  # tokens per split-KV program where the device's size is unknown (CPU)
MIN_KV_CHUNK = 128  # never split finer: each part costs a float32 partial write and a merge read
PROGRAMS_PER_SM = 4  # split until about this many programs per streaming multiprocessor
PARTIAL_BUDGET_BYTES = 256 << 20  # cap on float32 split-KV scratch; chunks grow to respect it


def default_block_n(head_dim: int) -> int:
    """Keys per inner step: 128 up to head_dim 128 (fastest for every KV format at batch 32 x
    8k on an H200, ``bench/triton_sweep.py``), 32 above (register pressure)."""
    return 128 if triton.next_power_of_2(head_dim) <= 128 else 32


def _plan(qo: np.ndarray, kv: np.ndarray, T: int, block_q: int, chunk: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Host-side work list for chunk size ``chunk`` (int64 host indptrs in; numpy, because a
    decode step plans once per layer and torch's per-op cost on small CPU tensors is ~10x).

    Returns ``work[3,W]`` (request, query block, kv chunk; ordered by request, block, chunk),
    per-token ``tok_wbase[T]`` (first work item of the token's block), ``tok_row0[T]``
    (its query index in the block, times GP later), ``tok_nchunks[T]``, and ``max chunks``.
    """
    R = len(qo) - 1
    q_len, kv_len = np.diff(qo), np.diff(kv)
    active = (q_len > 0) & (kv_len > 0)
    n_qb = np.where(active, -(-q_len // block_q), 0)
    n_ch = np.where(active, -(-kv_len // chunk), 0)
    items = n_qb * n_ch
    w_start = np.cumsum(items) - items
    reqs = np.arange(R)
    w_req = np.repeat(reqs, items)
    local = np.arange(len(w_req)) - w_start[w_req]
    ch = np.maximum(n_ch[w_req], 1)
    work = np.stack([w_req, local // ch, local % ch])

    tok_req = np.repeat(reqs, q_len)
    tq = np.arange(len(tok_req)) - qo[:-1][tok_req]
    tok_wbase, tok_row0, tok_nch = (np.zeros(T, dtype=np.int64) for _ in range(3))
    n = len(tok_req)
    tok_wbase[:n] = w_start[tok_req] + (tq // block_q) * n_ch[tok_req]
    tok_row0[:n] = tq % block_q
    tok_nch[:n] = n_ch[tok_req]
    return work, tok_wbase, tok_row0, tok_nch, int(n_ch.max()) if R else 0


_SMS: dict[str, int] = {}


def _sm_count(dev: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached), None elsewhere."""
    if dev.type != "cuda":
        return None
    key = str(dev)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[key]


def _kv_chunk(kv_chunk: int | None, max_kv: int, base_programs: int, block_n: int,
              dev: torch.device) -> int:
    """Tokens per split-KV program. Given: that. On a GPU: split just enough that the grid has
    about :data:`PROGRAMS_PER_SM` programs per SM (a few requests' long contexts spread over
    the device; a large batch is not split at all), never below :data:`MIN_KV_CHUNK`."""
    if kv_chunk:
        return max(kv_chunk, 1)
    sms = _sm_count(dev)
    if sms is None:
        return DEFAULT_KV_CHUNK
    splits = max(1, -(-PROGRAMS_PER_SM * sms // max(base_programs, 1)))
    chunk = max(MIN_KV_CHUNK, -(-max_kv // splits))
    return -(-chunk // block_n) * block_n


@dataclass
class _LaunchPlan:
    """What a call derives from the indptrs alone, made once per step and reused by its layers:
    block sizes, the KV chunk, and on the device (int32): the work list ``work[3, W]``, the
    per-token merge indices (``tok_wbase``, ``tok_row0 * GP``, ``tok_nchunks``, each ``[T]``)
    and the two indptrs. ``cover``: every output row is written by the kernels (no zero fill).
    ``o_part``/``lse_part``: the split-KV scratch, owned by the plan and reused by every call
    that uses it (calls of one thread run in stream order, so they never overlap)."""

    R: int
    W: int
    max_ch: int
    chunk: int
    GP: int
    block_q: int
    block_m: int
    block_n: int
    cover: bool = False
    work: torch.Tensor | None = None
    tok: tuple = ()
    qo: torch.Tensor | None = None
    kv: torch.Tensor | None = None
    o_part: torch.Tensor | None = None
    lse_part: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        ts = [self.work, self.o_part, self.lse_part]
        return sum(t.untyped_storage().nbytes() for t in ts if t is not None)


@dataclass
class HostPlan:
    """The host half of a plan: block sizes, the KV chunk and the numpy work list of
    :func:`_plan` (``work[3,W]``, ``tok_wbase/tok_row0/tok_nch[T]``, ``max_ch``)."""

    GP: int
    block_q: int
    block_m: int
    block_n: int
    chunk: int
    work: np.ndarray
    tok: tuple[np.ndarray, np.ndarray, np.ndarray]
    max_ch: int


def host_plan(qo: np.ndarray, kv: np.ndarray, T: int, Hkv: int, G: int, D: int,
              kv_chunk: int | None, block_n: int | None, dev: torch.device,
              pow2_chunk: bool = False) -> HostPlan | None:
    """Plan int64 host indptrs ``qo``/``kv`` (None: no work). ``pow2_chunk`` rounds the chosen
    chunk up to a power of two, so that consecutive decode steps share it (CUDA graphs)."""
    R = len(qo) - 1
    GP = triton.next_power_of_2(G)
    block_n = block_n or default_block_n(D)
    if T == 0 or R < 1 or int(kv[-1]) == 0:
        return None
    if int(kv[-1]) >= 2 ** 31:
        raise ValueError(f"kv_indptr ends at {int(kv[-1])}: more than 2**31 - 1 keys in one call")
    if int(qo[-1]) > T:
        raise ValueError(f"qo_indptr ends at {int(qo[-1])} but q has {T} rows")
    q_len, kv_len = np.diff(qo), np.diff(kv)
    block_q = max(1, min(triton.next_power_of_2(int(q_len.max())), 64 // GP))
    block_m = max(16, block_q * GP)
    block_q = block_m // GP

    base_programs = int((-(-q_len // block_q)).sum()) * Hkv
    chunk = _kv_chunk(kv_chunk, int(kv_len.max()), base_programs, block_n, dev)
    if pow2_chunk:
        chunk = triton.next_power_of_2(chunk)
    while True:
        work, tok_wbase, tok_row0, tok_nch, max_ch = _plan(qo, kv, T, block_q, chunk)
        scratch = work.shape[1] * Hkv * block_m * (D + 1) * 4
        if max_ch <= 1 or scratch <= PARTIAL_BUDGET_BYTES:
            break
        chunk *= 2
    return HostPlan(GP, block_q, block_m, block_n, chunk, work, (tok_wbase, tok_row0, tok_nch),
                    max_ch)


def _launch_plan(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, T: int, Hkv: int, G: int,
                 D: int, kv_chunk: int | None, block_n: int | None,
                 dev: torch.device) -> _LaunchPlan:
    qo = qo_indptr.detach().to("cpu", torch.int64).numpy()
    kv = kv_indptr.detach().to("cpu", torch.int64).numpy()
    R = len(qo) - 1
    hp = host_plan(qo, kv, T, Hkv, G, D, kv_chunk, block_n, dev)
    if hp is None:
        bn = block_n or default_block_n(D)
        return _LaunchPlan(max(R, 0), 0, 0, 0, triton.next_power_of_2(G), 1, 16, bn)
    tok_wbase, tok_row0, tok_nch = hp.tok
    # one host-to-device copy for the whole plan (and the indptrs), asynchronous from pinned
    # memory on CUDA: with host indptrs in, a call never waits for the device
    meta = torch.from_numpy(np.concatenate(
        [hp.work.reshape(-1), tok_wbase, tok_row0 * hp.GP, tok_nch, qo, kv]).astype(np.int32))
    if dev.type == "cuda":
        meta = meta.pin_memory().to(dev, non_blocking=True)
    W = hp.work.shape[1]
    split = hp.max_ch > 1
    # the split path's merge writes every row; otherwise rows of requests with no keys (and
    # rows past qo_indptr's end) are written by nobody and start as zeros / -inf
    q_len, kv_len = np.diff(qo), np.diff(kv)
    cover = split or int(q_len[kv_len > 0].sum()) == T
    lp = _LaunchPlan(R, W, hp.max_ch, hp.chunk, hp.GP, hp.block_q, hp.block_m, hp.block_n, cover,
                     work=meta[:3 * W], tok=tuple(meta[3 * W + i * T: 3 * W + (i + 1) * T]
                                                 for i in range(3)),
                     qo=meta[3 * W + 3 * T: 3 * W + 3 * T + R + 1],
                     kv=meta[3 * W + 3 * T + R + 1:])
    if split:
        lp.o_part = torch.empty((W * Hkv * hp.block_m, D), dtype=torch.float32, device=dev)
        lp.lse_part = torch.empty((W * Hkv * hp.block_m,), dtype=torch.float32, device=dev)
    return lp
