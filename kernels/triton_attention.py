"""Triton paged attention with split-KV (flash-decoding).

Contract: exactly :func:`lamina.kernels.reference.paged_attention_ref` — ``q[T,H,D]``,
``k_pool/v_pool[S,Hkv,D]``, CSR ``qo_indptr[R+1]``, ``kv_indptr[R+1]``, ``kv_indices[N]``,
``q_positions[T]``, ``kv_start_pos[R]`` (int32 or int64, on q's device; the two indptrs may
also be host tensors); returns ``o[T,H,D]`` in
q's dtype and ``lse[T,H]`` float32 natural log, ``o = 0, lse = -inf`` for a query that sees no key.
Inputs may be float32, bfloat16 or float16; scores, softmax and accumulation are float32.

Work decomposition (planned on the host from the two indptr arrays, one small copy each way):

* a *work item* is (request r, query block b, KV chunk c); the grid is ``(work items, Hkv)``;
* one program holds the ``BLOCK_Q`` queries of block b times the ``G = H / Hkv`` query heads that
  share KV head ``kvh`` as the rows of one tile, so each K/V tile is read once per group (GQA);
* it walks chunk c of the request's slots in ``BLOCK_N`` steps with an online softmax, skipping
  keys that causality or the sliding window hide from every row of the tile;
* with one chunk per request the result is written directly; otherwise each program writes a
  partial ``(o, lse)`` to float32 scratch and :mod:`lamina.kernels.triton_merge` merges the
  chunks of each row by log-sum-exp.

Only masked ``tl.load``/``tl.store``, ``tl.dot`` and elementwise math are used (Triton >= 3.0,
runs under ``TRITON_INTERPRET=1`` on CPU tensors).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels import plan_cache
from lamina.kernels.triton_merge import launch_merge
from lamina.kernels.triton_plan import _LaunchPlan, _launch_plan
from lamina.types import AttentionSpec


@triton.jit
def _widen16(x):
    """8-bit codes (int8 or float8 e4m3) as float16, exactly, without the int-to-float
    conversion unit (its throughput, not memory, bounded the 8-bit kernel on an H200): an int8
    v becomes the float16 whose bits are 0x6400 | (v + 128), i.e. 1024 + v + 128, minus 1152;
    e4m3 takes the hardware's packed e4m3-to-f16 conversion."""
    if x.dtype == tl.int8:
        b = (x.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16)
        return ((b | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(tl.float16)
    else:
        return x.to(tl.float16)


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv_indices_ptr, q_pos_ptr,
                       work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_start_ptr,
                       out_o_ptr, out_lse_ptr,
                       num_work, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                       scale, softcap, window, chunk_size,
                       H: tl.constexpr, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                       SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
                       K_SCALED: tl.constexpr, V_SCALED: tl.constexpr):
    """One (work item, kv head): tile rows are m = query * GP + g (g < G real, rest padding).

    F32_DOT: both dots take float32 operands with IEEE precision (float32 inputs, where TF32
    would lose accuracy, and the CPU interpreter, whose bfloat16 ``tl.dot`` is wrong); otherwise
    the dots run on the native 16-bit type with float32 accumulation.

    K_SCALED / V_SCALED: an 8-bit pool (int8 or float8 e4m3) whose float32 scales
    ``[S, NUM_KV_HEADS]`` multiply a key's scores / a value's row; its codes are widened
    exactly to the dot's operand type: float32 under F32_DOT, else float16 (:func:`_widen16`;
    the queries and softmax weights meet them in float16, values scaled in float16).

    ``work_ptr`` holds int32 ``[3, num_work]``: request, query block, kv chunk.
    SPLIT: write float32 partials to ``out_o[(w*Hkv+kvh)*BLOCK_M + m, D]``, ``out_lse[...]``;
    otherwise write ``out_o[T,H,D]`` (q's dtype, contiguous) and ``out_lse[T,H]`` directly.
    """
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.load(work_ptr + w)
    qb = tl.load(work_ptr + num_work + w)
    c = tl.load(work_ptr + 2 * num_work + w)
    q_start = tl.load(qo_indptr_ptr + r).to(tl.int32)
    q_end = tl.load(qo_indptr_ptr + r + 1).to(tl.int32)
    kv_off = tl.load(kv_indptr_ptr + r).to(tl.int64)
    kv_len = (tl.load(kv_indptr_ptr + r + 1) - kv_off).to(tl.int32)
    pos0 = tl.load(kv_start_ptr + r).to(tl.int32)

    m_idx = tl.arange(0, BLOCK_M)
    g = m_idx % GP
    tok = q_start + qb * BLOCK_Q + m_idx // GP
    row_ok = (g < G) & (tok < q_end)
    tok64 = tok.to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(q_pos_ptr + tok64, mask=row_ok, other=0).to(tl.int32)

    # Keys of this chunk that at least one row may see: [n_lo, n_hi) in shard-local indices.
    chunk_lo = c * chunk_size
    chunk_hi = tl.minimum(chunk_lo + chunk_size, kv_len)
    # A tile with no row (a padded work item, kernels/triton_graphs.py) must get an empty
    # range whose bounds' difference fits int32 (a GPU loop computes its trip count from it):
    # sentinels of +-2**30 (positions are below that), and n_hi clamped to n_lo.
    pos_max = tl.max(tl.where(row_ok, q_pos, -(1 << 30)), axis=0)
    n_hi = tl.minimum(chunk_hi, pos_max - pos0 + 1)
    n_lo = chunk_lo
    if HAS_WINDOW:
        pos_min = tl.min(tl.where(row_ok, q_pos, 1 << 30), axis=0)
        n_lo = tl.maximum(chunk_lo, pos_min - pos0 - window + 1)
    n_hi = tl.maximum(n_hi, n_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_hi
        slot = tl.load(kv_indices_ptr + kv_off + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # issued early: both tiles in flight together
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif K_SCALED:
            s = tl.dot(q.to(tl.float16), tl.trans(_widen16(k)))
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if K_SCALED:
            ks = tl.load(k_scale_ptr + slot * NUM_KV_HEADS + kvh, mask=n_ok, other=0.0)
            s = s * ks[None, :]
        s = s * scale
        if HAS_SOFTCAP:
            # softcap * tanh(s / softcap) with tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|)
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -th, th)
        k_pos = pos0 + n
        vis = (k_pos[None, :] <= q_pos[:, None]) & n_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            vis = vis & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_SCALED:
            vsc = tl.load(v_scale_ptr + slot * NUM_KV_HEADS + kvh, mask=n_ok, other=0.0)
        if F32_DOT:
            if V_SCALED:  # after the sum: only the weighted values take the scales
                p = p * vsc[None, :]
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif V_SCALED:  # the values scaled in float16 (p * scale could underflow float16)
            pv = tl.dot(p.to(tl.float16), _widen16(v) * vsc.to(tl.float16)[:, None])
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    if SPLIT:
        prow = (w.to(tl.int64) * NUM_KV_HEADS + kvh) * BLOCK_M + m_idx
        tl.store(out_lse_ptr + prow, lse, mask=row_ok)
        tl.store(out_o_ptr + prow[:, None] * D + d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        orow = tok64 * H + head
        tl.store(out_lse_ptr + orow, lse, mask=row_ok)
        tl.store(out_o_ptr + orow[:, None] * D + d[None, :], o.to(out_o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def check_pools(q_dtype: torch.dtype, k_pool: torch.Tensor, v_pool: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Raises ValueError unless the kernel reads both pools as they are: a pool in q's dtype
    (or bfloat16 for float32 queries) with no scale, or an 8-bit pool (int8, float8 e4m3)
    with contiguous float32 scales ``[S, Hkv]``."""
    S, Hkv = k_pool.shape[:2]
    for pool, sc, name in ((k_pool, k_scale, "k"), (v_pool, v_scale, "v")):
        eight = pool.dtype in (torch.int8, torch.float8_e4m3fn)
        if eight != (sc is not None) or not (eight or pool.dtype == q_dtype or (
                pool.dtype == torch.bfloat16 and q_dtype == torch.float32)):
            raise ValueError(f"paged_attention: a {pool.dtype} {name}_pool with "
                             f"{'no' if sc is None else 'a'} {name}_scale for {q_dtype} queries "
                             "(8-bit pools need scales, float pools q's dtype or bfloat16)")
        if sc is not None and (sc.dtype != torch.float32 or tuple(sc.shape) != (S, Hkv)
                               or not sc.is_contiguous()):
            raise ValueError(f"paged_attention: {name}_scale must be contiguous float32 "
                             f"[S, Hkv] = {(S, Hkv)}")


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, q_positions: torch.Tensor,
                           kv_start_pos: torch.Tensor, spec: AttentionSpec,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, *,
                           kv_chunk: int | None = None, block_n: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention in Triton; see the module docstring for the contract.

    ``kv_chunk`` (tokens per split-KV program; by default chosen per plan from the device's
    size, and grown to bound scratch memory) and ``block_n`` (keys per inner step, a power of
    two >= 16) are tuning knobs; tests use small values under the interpreter to exercise
    splitting. Planning reads ``qo_indptr`` and ``kv_indptr`` on the host: they may be host
    tensors (then a CUDA call never waits for the device, and the plan is reused by later
    calls with equal indptrs: a step's other layers), else they are copied back (a wait).
    Not CUDA-graph capturable as a whole (it plans and allocates); :func:`launch` is, and
    :mod:`lamina.kernels.triton_graphs` captures it per padded shape. 8-bit pools (int8 or
    float8_e4m3fn, :mod:`lamina.kernels.kv_format`) come with ``k_scale``/``v_scale[S, Hkv]``
    float32; a pool in q's dtype or, for float32 q, bfloat16 needs none.
    """
    T, H, D = q.shape
    S, Hkv, Dk = k_pool.shape
    if H != spec.num_heads or Hkv != spec.num_kv_heads or D != spec.head_dim or Dk != D:
        raise ValueError(f"paged_attention: q{tuple(q.shape)} / k_pool{tuple(k_pool.shape)} do not "
                         f"match spec (H={spec.num_heads}, Hkv={spec.num_kv_heads}, "
                         f"D={spec.head_dim})")
    if v_pool.shape != k_pool.shape:
        raise ValueError("paged_attention: k_pool and v_pool differ in shape")
    check_pools(q.dtype, k_pool, v_pool, k_scale, v_scale)
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"paged_attention: unsupported dtype {q.dtype}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    dev = q.device
    host = qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
    G = spec.group_size
    key = ("triton", T, Hkv, G, D, kv_chunk, block_n, str(dev))
    lp = plan_cache.lookup(key, (qo_indptr, kv_indptr)) if host else None
    if lp is None:
        lp = _launch_plan(qo_indptr, kv_indptr, T, Hkv, G, D, kv_chunk, block_n, dev)
        if host:  # a step's layers share their indptrs: plan once per step
            plan_cache.store(key, (qo_indptr, kv_indptr), lp, lp.nbytes)
    if lp.cover:
        o = torch.empty((T, H, D), dtype=q.dtype, device=dev)
        lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    else:
        o = torch.zeros((T, H, D), dtype=q.dtype, device=dev)
        lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=dev)
    if lp.W == 0:
        return o, lse

    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(-1) == 1 else v_pool.contiguous()
    kv_indices, q_positions, kv_start_pos = (t if t.device == dev else t.to(dev) for t in
                                             (kv_indices, q_positions, kv_start_pos))
    launch(q, k_pool, v_pool, kv_indices.contiguous(), q_positions.contiguous(),
           kv_start_pos.contiguous(), lp, o, lse, spec, k_scale, v_scale)
    return o, lse


def _f32_dot(q: torch.Tensor) -> bool:
    """The kernel's F32_DOT for queries ``q``: float32 queries, or the CPU interpreter."""
    return q.dtype == torch.float32 or not q.is_cuda


def launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
           q_positions: torch.Tensor, kv_start_pos: torch.Tensor, lp: _LaunchPlan,
           o: torch.Tensor, lse: torch.Tensor, spec: AttentionSpec,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           **tune: int) -> None:
    """Queue the attention kernel (and, for a split plan, the merge) of plan ``lp`` on the
    current stream: no allocation, no host sync, so a CUDA graph can capture it. Inputs
    contiguous in their last dim and on q's device; ``o[T,H,D]``/``lse[T,H]`` contiguous
    outputs (rows the plan does not cover are left as they are). ``tune``: Triton launch
    options (``num_warps``, ``num_stages``) over the defaults, for tuning sweeps."""
    T, H, D = o.shape
    Hkv, G = k_pool.shape[1], spec.group_size
    split = lp.o_part is not None
    block_d = max(16, triton.next_power_of_2(D))
    _paged_attn_kernel[(lp.W, Hkv)](
        q, k_pool, v_pool, q if k_scale is None else k_scale, q if v_scale is None else v_scale,
        kv_indices, q_positions, lp.work, lp.qo, lp.kv, kv_start_pos,
        lp.o_part if split else o, lp.lse_part if split else lse,
        lp.W, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1),
        float(spec.scale), float(spec.softcap or 1.0), int(spec.window or 0), lp.chunk,
        H=H, NUM_KV_HEADS=Hkv, G=G, GP=lp.GP, BLOCK_Q=lp.block_q, BLOCK_M=lp.block_m,
        BLOCK_N=lp.block_n, D=D, BLOCK_D=block_d, HAS_WINDOW=spec.window is not None,
        HAS_SOFTCAP=bool(spec.softcap), SPLIT=split,
        F32_DOT=_f32_dot(q),
        K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
        **({"num_warps": 8 if block_d > 128 else 4} | tune))  # bench/triton_sweep.py (H200)
    if split:
        launch_merge(lp.o_part, lp.lse_part, o, lse, num_rows=T * H, num_parts=lp.max_ch,
                     part_stride=Hkv * lp.block_m, head_dim=D,
                     paged=(*lp.tok, H, G, Hkv, lp.block_m))
