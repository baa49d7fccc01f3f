"""Triton log-sum-exp merge of partial attention states.

One kernel, :func:`_merge_kernel`, serves two callers:

* :func:`merge_states_triton` — the public merge of S partial states ``os[S,T,H,D]``,
  ``lses[S,T,H]`` over disjoint KV shards (contract of
  :func:`lamina.kernels.reference.merge_states_ref`);
* the split-KV pass of :mod:`lamina.kernels.triton_attention`, whose partials live in a scratch
  buffer addressed per output row (``PAGED=True``).

Both are an online merge over the parts of each output row: running max ``m``, rescaled sums;
a row whose parts are all ``-inf`` (or that has no part) ends with ``o = 0``, ``lse = -inf``.
Accumulation is float32; ``o`` is stored in the output tensor's dtype. Only plain masked
``tl.load``/``tl.store`` are used, so it runs under ``TRITON_INTERPRET=1`` and on Triton >= 3.0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(o_part_ptr, lse_part_ptr, out_o_ptr, out_lse_ptr,
                  tok_wbase_ptr, tok_row0_ptr, tok_nparts_ptr,
                  num_rows, num_parts, part_stride,
                  H: tl.constexpr, G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PAGED: tl.constexpr):
    """Merge the parts of ``BLOCK_R`` output rows (row = token * H + head), ``BLOCK_P`` parts
    per step (one ``[BLOCK_R, BLOCK_P, BLOCK_D]`` tile: the loads of a step are independent).

    Dense (``PAGED=False``): part ``c`` of row ``i`` is row ``i + c * part_stride`` of
    ``o_part[*, D]`` / ``lse_part[*]``, for ``c < num_parts``.
    Paged (``PAGED=True``): token t, head h = kvh * G + g has ``tok_nparts[t]`` parts at rows
    ``((tok_wbase[t] + c) * NUM_KV_HEADS + kvh) * BLOCK_M + tok_row0[t] + g``.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if PAGED:
        t = rows64 // H
        h = rows64 % H
        wbase = tl.load(tok_wbase_ptr + t, mask=row_ok, other=0).to(tl.int64)
        row0 = tl.load(tok_row0_ptr + t, mask=row_ok, other=0).to(tl.int64)
        nparts = tl.load(tok_nparts_ptr + t, mask=row_ok, other=0)
        base = (wbase * NUM_KV_HEADS + h // G) * BLOCK_M + row0 + h % G
    else:
        base = rows64
        nparts = tl.zeros([BLOCK_R], dtype=tl.int32) + num_parts

    p = tl.arange(0, BLOCK_P)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for c0 in range(0, num_parts, BLOCK_P):
        c = c0 + p
        ok = row_ok[:, None] & (c[None, :] < nparts[:, None])
        idx = base[:, None] + c[None, :].to(tl.int64) * part_stride
        lse_c = tl.load(lse_part_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
        o_c = tl.load(o_part_ptr + idx[:, :, None] * D + d[None, None, :],
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse_c, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # exp(-inf) = 0 for an empty running state
        beta = tl.exp(lse_c - m_safe[:, None])  # 0 for an empty part
        s = s * alpha + tl.sum(beta, axis=1)
        acc = acc * alpha[:, None] + tl.sum(beta[:, :, None] * o_c, axis=1)
        m = m_new
    seen = s > 0.0
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
    o = tl.where(seen[:, None], acc / tl.where(seen, s, 1.0)[:, None], 0.0)
    tl.store(out_lse_ptr + rows64, lse, mask=row_ok)
    tl.store(out_o_ptr + rows64[:, None] * D + d[None, :],
             o.to(out_o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


TILE_ELEMS = 8192  # float32 elements of one step's o tile (BLOCK_R x BLOCK_P x BLOCK_D)
ROWS_PER_PROGRAM_FROM = 1024  # fewer rows than twice this: one row per program (parallelism)


def merge_blocks(num_rows: int, num_parts: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_D, BLOCK_R, BLOCK_P)``: up to 16 parts a step; one row per program until there
    are thousands of rows (a decode step's few rows then spread over the GPU), more beyond."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_p = min(16, triton.next_power_of_2(max(num_parts, 1)))
    cap = max(1, TILE_ELEMS // (block_p * block_d))
    want = max(1, num_rows // ROWS_PER_PROGRAM_FROM)
    block_r = min(cap, 1 << (want.bit_length() - 1))
    return block_d, block_r, block_p


def launch_merge(o_part: torch.Tensor, lse_part: torch.Tensor, out_o: torch.Tensor,
                 out_lse: torch.Tensor, num_rows: int, num_parts: int, part_stride: int,
                 head_dim: int, paged: tuple | None = None) -> None:
    """Launch :func:`_merge_kernel`. ``out_o`` must be contiguous ``[num_rows, head_dim]`` rows,
    ``out_lse`` contiguous float32 ``[num_rows]``. ``paged`` is
    ``(tok_wbase, tok_row0, tok_nparts, H, G, num_kv_heads, BLOCK_M)`` for the split-KV pass;
    ``num_parts`` is then the most parts any row has."""
    if num_rows == 0:
        return
    block_d, block_r, block_p = merge_blocks(num_rows, num_parts, head_dim)
    if paged is None:
        dummy = out_lse  # never read when PAGED is False
        args = (dummy, dummy, dummy, 1, 1, 1, 1)
    else:
        args = paged
    grid = (triton.cdiv(num_rows, block_r),)
    _merge_kernel[grid](o_part, lse_part, out_o, out_lse, args[0], args[1], args[2],
                        num_rows, num_parts, part_stride,
                        H=args[3], G=args[4], NUM_KV_HEADS=args[5], BLOCK_M=args[6],
                        D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_P=block_p,
                        PAGED=paged is not None, num_warps=4)


def merge_states_triton(os: torch.Tensor | list[torch.Tensor],
                        lses: torch.Tensor | list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of S partial states of the same queries over disjoint KV shards.

    ``os[S,T,H,D]`` (or a list of S ``[T,H,D]``) in float32/bfloat16/float16, ``lses[S,T,H]``
    (or a list) float32 natural-log. Returns ``o[T,H,D]`` in the inputs' dtype and ``lse[T,H]``
    float32; rows that no shard saw are ``o = 0``, ``lse = -inf``.
    """
    o_stack = torch.stack(list(os)) if isinstance(os, (list, tuple)) else os
    l_stack = torch.stack(list(lses)) if isinstance(lses, (list, tuple)) else lses
    if o_stack.dim() != 4 or l_stack.shape != o_stack.shape[:3]:
        raise ValueError(f"merge_states: expected os[S,T,H,D] and lses[S,T,H], got "
                         f"{tuple(o_stack.shape)} and {tuple(l_stack.shape)}")
    S, T, H, D = o_stack.shape
    o_stack = o_stack.contiguous()
    l_stack = l_stack.float().contiguous()
    out_o = torch.empty((T, H, D), dtype=o_stack.dtype, device=o_stack.device)
    out_lse = torch.empty((T, H), dtype=torch.float32, device=o_stack.device)
    if S == 0:
        out_o.zero_()
        out_lse.fill_(float("-inf"))
        return out_o, out_lse
    launch_merge(o_stack, l_stack, out_o, out_lse, num_rows=T * H, num_parts=S,
                 part_stride=T * H, head_dim=D)
    return out_o, out_lse
