"""Bandwidth of paged decode attention against a plain copy, measured in the same run.

For each (batch, context) point, every request decodes one query over ``context`` tokens whose
slots are a random permutation of the pool (paged, not contiguous). Reported per method:

* ``GB/s`` = KV bytes read (K and V of every request) / median time;
* ``% copy`` = that over the copy bandwidth, where copy bandwidth = (read + write bytes) / time of
  copying a tensor as large as the KV read into a preallocated one (``dst.copy_(src)``), i.e. the
  memory traffic a plain copy sustains on this device at this size. ``torch.clone`` of the same
  tensor is timed too (``clone_ms`` in the JSON): on CPU, a fresh allocation above ~32 MiB
  page-faults on first touch, which would make the baseline look slower than memory is.

Methods: on CPU the vectorised torch path (``torch_batched``, what the CPU dispatch uses) and the
per-request reference (``reference``); on CUDA the Triton kernel (``triton``), torch SDPA on a
contiguous padded batch (``sdpa_padded``, no paging) and ``torch_batched``. Shapes: CPU uses
SmolLM2-135M (9 q heads, 3 kv heads, head_dim 64, float32); CUDA uses 32/8/128 bfloat16.

    python bench/kernels.py            # batch 1,8,32,64 x context 256,1024,4096 (~30 s on CPU)
    python bench/kernels.py --quick    # batch 1,64 x context 256,1024 (smoke run)

Writes ``bench/results/kernels_<device>.json`` and ``.md``. Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.kernels import paged_attention_batched, paged_attention_ref  # noqa: E402
from lamina.types import AttentionSpec  # noqa: E402

FULL_GRID = [(b, c) for b in (1, 8, 32, 64) for c in (256, 1024, 4096)]
QUICK_GRID = [(b, c) for b in (1, 64) for c in (256, 1024)]
SHAPES = {"cpu": (9, 3, 64, torch.float32), "cuda": (32, 8, 128, torch.bfloat16)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_times(fns: dict, device: str, warmup: int, reps: int) -> dict[str, float]:
    """Median wall time in seconds of each ``fns[name]()``, after ``warmup`` calls each.

    Repetitions are interleaved (one call of every function per round), so that load from other
    processes on a shared machine hits the baseline and the methods alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_decode_batch(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """Arguments of one paged decode call: every request has ``ctx`` keys at shuffled slots."""
    torch.manual_seed(seed)
    slots = batch * ctx
    spec = AttentionSpec(layer=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         scale=1.0 / math.sqrt(head_dim))
    k_pool = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    kv_indices = torch.randperm(slots).to(device, torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_indptr = (torch.arange(batch + 1, dtype=torch.int32) * ctx).to(device)
    q_positions = torch.full((batch,), ctx - 1, dtype=torch.int32, device=device)
    kv_start = torch.zeros(batch, dtype=torch.int32, device=device)
    return q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions, kv_start, spec


def _sdpa_padded(args: tuple):
    """Torch SDPA over a contiguous [B, Hkv, ctx, D] copy of the same KV (unpaged baseline)."""
    q, k_pool, v_pool, _, _, kv_indices, _, _, spec = args
    B = q.shape[0]
    idx = kv_indices.long()
    k = k_pool[idx].view(B, -1, spec.num_kv_heads, spec.head_dim).transpose(1, 2).contiguous()
    v = v_pool[idx].view(B, -1, spec.num_kv_heads, spec.head_dim).transpose(1, 2).contiguous()
    qh = q[:, :, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(qh, k, v, scale=spec.scale, enable_gqa=True)
        return lambda: sdpa(qh, k, v, scale=spec.scale, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch: expand KV heads explicitly
        g = spec.group_size
        k2, v2 = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return lambda: sdpa(qh, k2, v2, scale=spec.scale)


def methods_for(device: str, args: tuple) -> dict:
    if device == "cpu":
        return {"torch_batched": lambda: paged_attention_batched(*args),
                "reference": lambda: paged_attention_ref(*args)}
    from lamina.kernels.triton_attention import paged_attention_triton
    return {"triton": lambda: paged_attention_triton(*args),
            "sdpa_padded": _sdpa_padded(args),
            "torch_batched": lambda: paged_attention_batched(*args)}


def run(device: str, grid: list[tuple[int, int]], warmup: int, reps: int) -> list[dict]:
    heads, kv_heads, head_dim, dtype = SHAPES[device]
    rows = []
    for batch, ctx in tqdm(grid, desc=f"paged decode on {device}", unit="point"):
        args = make_decode_batch(batch, ctx, heads, kv_heads, head_dim, dtype, device)
        kv_bytes = 2 * batch * ctx * kv_heads * head_dim * args[1].element_size()
        src = torch.empty(kv_bytes // 4, dtype=torch.float32, device=device).normal_()
        dst = torch.empty_like(src)
        fns = {"copy": lambda: dst.copy_(src), "clone": src.clone, **methods_for(device, args)}
        if device == "cpu" and batch * ctx > 64 * 1024:  # the per-request loop is slow: fewer reps
            fns.pop("reference")
            ref_t = median_times({"reference": lambda: paged_attention_ref(*args)}, device, 1,
                                 max(3, reps // 3))
        else:
            ref_t = {}
        times = {**median_times(fns, device, warmup, reps), **ref_t}
        copy_bw = 2 * kv_bytes / times["copy"]  # read + write
        for name, t in times.items():
            if name in ("copy", "clone"):
                continue
            bw = kv_bytes / t
            rows.append(dict(batch=batch, ctx=ctx, method=name, kv_mib=kv_bytes / 2**20,
                             time_ms=t * 1e3, gbps=bw / 1e9, copy_gbps=copy_bw / 1e9,
                             copy_ms=times["copy"] * 1e3, clone_ms=times["clone"] * 1e3,
                             frac_copy=bw / copy_bw))
        del args, src, dst, fns
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Paged decode attention bandwidth ({meta['device_name']})", "",
             f"shape: {meta['shape']}, dtype {meta['dtype']}, torch {meta['torch']}, "
             f"threads {meta['threads']}, median of {meta['reps']} after {meta['warmup']} warmup; "
             "copy GB/s counts read + write bytes of `dst.copy_(src)` of the KV's size, "
             "timed in the same rounds as the methods.", "",
             "| batch | ctx | KV MiB | method | ms | GB/s | copy GB/s | % of copy |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['kv_mib']:.1f} | {r['method']} | "
                     f"{r['time_ms']:.3f} | {r['gbps']:.1f} | {r['copy_gbps']:.1f} | "
                     f"{100 * r['frac_copy']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--quick", action="store_true", help="small grid (smoke run)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    grid = QUICK_GRID if a.quick else FULL_GRID
    heads, kv_heads, head_dim, dtype = SHAPES[device]
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu")
    meta = dict(device=device, device_name=name, torch=torch.__version__,
                shape=f"{heads} q heads / {kv_heads} kv heads / head_dim {head_dim}",
                dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                warmup=a.warmup, reps=a.reps, grid="quick" if a.quick else "full")
    if device == "cuda":
        import triton
        meta["triton"] = triton.__version__
    rows = run(device, grid, a.warmup, a.reps)
    md = markdown(rows, meta)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"meta": meta, "rows": rows}, indent=1)
    (a.out / f"kernels_{device}.json").write_text(payload)
    (a.out / f"kernels_{device}.md").write_text(md)
    print(f"wrote {a.out / f'kernels_{device}.json'} and .md")


if __name__ == "__main__":
    main()
