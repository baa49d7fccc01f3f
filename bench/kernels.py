"""Paged decode attention: old vs new CPU path vs reference (and GPU kernels), in the same run.

CPU (SmolLM2-135M shape: 9 q heads, 3 kv heads, head_dim 64, float32). Each point is a decode
*step* as the memory node runs it: 30 calls (one per layer) over a ``[L, S, Hkv, D]`` pool of at
least the serving default size (``kv_cache_gb=1``: ~23k slots), cycling through its ``L`` layers
(30, fewer when the pool would pass ~1.5 GiB) so the KV read is cache-cold, with the same index
tensors for every call of the step. The plan cache of the new path is cleared before every
step, so its per-step index work (done at the first layer) is in the timings. Reported:
milliseconds per call (= per layer) and speedups measured in the same interleaved rounds (one
step of every method per round, median over rounds).

* ``steps``: 16/32/64 requests, ragged contexts ("~100" = uniform 16..184 tokens, "~300" =
  100..500), slots laid out by the real allocator after churn (prompts in contiguous runs,
  decode tokens of all requests interleaved), plus a ``chunk`` step (16 decode requests and one
  128-token prompt) and a ``prompts`` step (16 whole prompts of 16..160 tokens: a prefill); at
  torch's thread count and at 1 thread (shm memory nodes run single-threaded).
* ``grid``: uniform contexts (batch 1..64 x 256..4096 tokens), slots a random subset of the
  pool; ``GB/s`` = KV bytes read / time and ``% copy`` = that over a plain ``dst.copy_(src)`` of
  the KV's size (read + write bytes), timed in the same rounds.

Methods: ``torch_batched`` (old default: padded gather + bmm), ``torch_cpu`` (new default:
sparse ops, :mod:`lamina.kernels.torch_sparse`), ``reference`` (per-request loop; fewer rounds).
On CUDA (32/8/128 bfloat16, same call repeated): ``triton``, ``sdpa_padded`` (contiguous, no
paging) and ``torch_batched``.

    python bench/kernels.py            # steps + grid (~10 minutes on 2 CPU cores)
    python bench/kernels.py --quick    # smoke run

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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.kernels import (paged_attention_batched, paged_attention_cpu,  # noqa: E402
                            paged_attention_ref, plan_cache)
from lamina.memnode.allocator import SlabAllocator  # noqa: E402
from lamina.types import AttentionSpec  # noqa: E402

STEPS = [(r, lo, hi) for r in (16, 32, 64) for lo, hi in ((16, 184), (100, 500))]
FULL_GRID = [(b, c) for b in (1, 8, 32, 64) for c in (256, 1024, 4096)]
QUICK_STEPS, QUICK_GRID = [(16, 16, 184), (64, 100, 500)], [(8, 1024)]
SHAPES = {"cpu": (9, 3, 64, torch.float32), "cuda": (32, 8, 128, torch.bfloat16)}
POOL_BUDGET = 3 << 29  # bytes of K+V over all cycled layers
SERVING_SLOTS = (1 << 30) // (30 * 2 * 3 * 64 * 4)  # pool of the default kv_cache_gb=1 (SmolLM2)
CALLS_PER_STEP = 30  # SmolLM2-135M has 30 attention layers
CHUNK = 128  # prompt tokens of the prefill chunk in the mixed step
CPU_METHODS = {"torch_batched": paged_attention_batched, "torch_cpu": paged_attention_cpu,
               "reference": paged_attention_ref}


def _spec(heads: int, kv_heads: int, head_dim: int) -> AttentionSpec:
    return AttentionSpec(layer=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         scale=1.0 / math.sqrt(head_dim))


def allocator_slots(ctx: np.ndarray, rng: np.random.Generator, cap: int, prefill: int = 0,
                    decoded: float = 0.6) -> list[np.ndarray]:
    """Slots of each request as the LIFO allocator hands them out in a server that has run a
    while: a prompt (contiguous runs) then decode tokens allocated one per request per step,
    interleaved. Churn first: the whole pool allocated in random pieces, freed in random order."""
    dec = np.minimum((ctx * rng.uniform(0, decoded, ctx.size)).astype(int), ctx - 1)
    alloc = SlabAllocator(cap, 256)
    cuts = np.sort(rng.choice(np.arange(1, cap), size=cap // 128, replace=False))
    pieces = np.split(alloc.alloc(cap), cuts)
    for j in rng.permutation(len(pieces)):
        alloc.free(pieces[j])
    slots = [list(alloc.alloc(int(p))) for p in ctx - dec]
    for step in range(int(dec.max(initial=0))):
        for r in np.flatnonzero(dec > step):
            slots[r].append(int(alloc.alloc(1)[0]))
    if prefill:
        slots.append(list(alloc.alloc(prefill)))
    return [np.asarray(s, dtype=np.int64) for s in slots]


def cpu_case(ctx: np.ndarray, layout: str, kind: str = "decode", seed: int = 0) -> dict:
    """Pool, per-layer queries and index tensors of one step: ``decode`` (one query per
    request), ``chunk`` (and one more request: a ``CHUNK``-token prompt) or ``prompts`` (every
    request a whole prompt of ``ctx`` tokens)."""
    heads, kv_heads, head_dim, dtype = SHAPES["cpu"]
    rng = np.random.default_rng(seed)
    prefill = CHUNK if kind == "chunk" else 0
    S = max(int(ctx.sum()) + prefill + 4096, SERVING_SLOTS)
    if layout == "alloc":
        slots = allocator_slots(ctx, rng, S, prefill, 0.0 if kind == "prompts" else 0.6)
    else:
        slots = np.split(rng.permutation(S)[: int(ctx.sum())], np.cumsum(ctx)[:-1])
    lens = np.array([s.size for s in slots])
    q_lens = lens if kind == "prompts" else np.array([1] * ctx.size + [prefill] * bool(prefill))
    q_pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens)])
    layer_bytes = 2 * S * kv_heads * head_dim * 4
    L = int(min(30, max(2, POOL_BUDGET // layer_bytes)))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, S, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(L, S, kv_heads, head_dim, generator=g, dtype=dtype)
    T = int(q_lens.sum())
    qs = [torch.randn(T, heads, head_dim, generator=g, dtype=dtype) for _ in range(L)]
    idx = (torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])),
           torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])),
           torch.from_numpy(np.concatenate(slots)), torch.from_numpy(q_pos),
           torch.zeros(lens.size, dtype=torch.int64))
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * 4
    return dict(k=k, v=v, qs=qs, idx=idx, spec=_spec(heads, kv_heads, head_dim), L=L,
                kv_bytes=kv_bytes)


def time_steps(case: dict, methods: dict, reps: int, warmup: int, ref_every: int
               ) -> dict[str, float]:
    """Median seconds per call of each method, one full step (all layers) per method per
    round, rounds interleaved; ``reference`` runs every ``ref_every``-th round only."""
    k, v, qs, idx, spec, L = (case[n] for n in ("k", "v", "qs", "idx", "spec", "L"))
    copy_src = torch.empty(case["kv_bytes"] // 4).normal_()
    copy_dst = torch.empty_like(copy_src)

    def step(fn):
        plan_cache.clear()  # every step builds its plan at its first layer, as in serving
        t0 = time.perf_counter()
        for layer in range(CALLS_PER_STEP):
            fn(qs[layer % L], k[layer % L], v[layer % L], *idx, spec)
        return (time.perf_counter() - t0) / CALLS_PER_STEP

    def copy():
        t0 = time.perf_counter()
        copy_dst.copy_(copy_src)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"copy": [], **{m: [] for m in methods}}
    for rnd in range(warmup + reps):
        for name, fn in methods.items():
            if name == "reference" and rnd % ref_every and rnd != warmup:
                continue
            t = step(fn)
            if rnd >= warmup:
                times[name].append(t)
        c = copy()
        if rnd >= warmup:
            times["copy"].append(c)
    return {n: statistics.median(ts) for n, ts in times.items() if ts}


def run_cpu(steps: list, grid: list, warmup: int, reps: int, with_ref: bool,
            threads: list[int]) -> list[dict]:
    """Steps at every thread count in ``threads``, the grid at the first one."""
    methods = dict(CPU_METHODS) if with_ref else {n: f for n, f in CPU_METHODS.items()
                                                  if n != "reference"}
    points = [("steps", r, lo, hi, "alloc", "decode") for r, lo, hi in steps]
    if steps:
        points += [("steps", 16, 16, 184, "alloc", "chunk"),
                   ("steps", 16, 16, 160, "alloc", "prompts")]
    points += [("grid", b, c, c, "perm", "decode") for b, c in grid]
    rows, default_threads = [], torch.get_num_threads()
    for i, (table, R, lo, hi, layout, kind) in enumerate(points):
        ctx = np.random.default_rng(100 + i).integers(lo, hi + 1, R)
        case = cpu_case(ctx, layout, kind, seed=i)
        label = f"{lo}..{hi}" if lo != hi else str(lo)
        for nt in threads if table == "steps" else threads[:1]:
            torch.set_num_threads(nt)
            t = time_steps(case, methods, reps, warmup, ref_every=3)
            copy_bw = 2 * case["kv_bytes"] / t["copy"]
            for name in methods:
                rows.append(dict(table=table, threads=nt, batch=R, ctx=label,
                                 mean_ctx=float(ctx.mean()), kind=kind, layers=case["L"],
                                 method=name, kv_mib=case["kv_bytes"] / 2**20,
                                 time_ms=t[name] * 1e3, gbps=case["kv_bytes"] / t[name] / 1e9,
                                 copy_gbps=copy_bw / 1e9,
                                 frac_copy=case["kv_bytes"] / t[name] / copy_bw,
                                 vs_batched=t["torch_batched"] / t[name]))
            print(f"{table} threads={nt} R={R} ctx={label} {kind}: "
                  + ", ".join(f"{n} {t[n] * 1e3:.3f} ms" for n in methods), flush=True)
        torch.set_num_threads(default_threads)
        del case
    return rows


def _sdpa_padded(q, kc, vc, spec):
    """Torch SDPA over a contiguous [B, Hkv, ctx, D] copy of the KV (unpaged baseline)."""
    qh, sdpa = q[:, :, None, :], torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(qh, kc, vc, scale=spec.scale, enable_gqa=True)
        return lambda: sdpa(qh, kc, vc, scale=spec.scale, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch: expand KV heads explicitly
        k2, v2 = kc.repeat_interleave(spec.group_size, 1), vc.repeat_interleave(spec.group_size, 1)
        return lambda: sdpa(qh, k2, v2, scale=spec.scale)


def run_cuda(grid: list[tuple[int, int]], warmup: int, reps: int) -> list[dict]:
    """Triton vs SDPA on a contiguous copy vs torch_batched; the same call repeated."""
    from lamina.kernels.triton_attention import paged_attention_triton
    heads, kv_heads, head_dim, dtype = SHAPES["cuda"]
    rows = []
    for batch, ctx in grid:
        torch.manual_seed(0)
        spec, S = _spec(heads, kv_heads, head_dim), batch * ctx
        kp = torch.randn(S, kv_heads, head_dim, device="cuda", dtype=dtype)
        vp = torch.randn(S, kv_heads, head_dim, device="cuda", dtype=dtype)
        idx = torch.randperm(S).cuda().int()
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
        args = (q, kp, vp, torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                (torch.arange(batch + 1, dtype=torch.int32) * ctx).cuda(), idx,
                torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda"),
                torch.zeros(batch, dtype=torch.int32, device="cuda"), spec)
        kc = kp[idx.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        vc = vp[idx.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        kv_bytes = 2 * S * kv_heads * head_dim * kp.element_size()
        src = torch.empty(kv_bytes // 4, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty_like(src)
        fns = {"copy": lambda: dst.copy_(src),
               "triton": lambda: paged_attention_triton(*args),
               "sdpa_padded": _sdpa_padded(q, kc, vc, spec),
               "torch_batched": lambda: paged_attention_batched(*args)}
        times: dict[str, list[float]] = {n: [] for n in fns}
        for rnd in range(warmup + reps):
            for name, fn in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                if rnd >= warmup:
                    times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        copy_bw = 2 * kv_bytes / med["copy"]
        for name, t in med.items():
            if name != "copy":
                rows.append(dict(table="grid", threads=0, batch=batch, ctx=str(ctx),
                                 mean_ctx=float(ctx), kind="decode", layers=1, method=name,
                                 kv_mib=kv_bytes / 2**20,
                                 time_ms=t * 1e3, gbps=kv_bytes / t / 1e9,
                                 copy_gbps=copy_bw / 1e9, frac_copy=kv_bytes / t / copy_bw,
                                 vs_batched=med["torch_batched"] / t))
        del kp, vp, kc, vc, src, dst, fns, args
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Paged decode attention ({meta['device_name']})", "",
             f"shape: {meta['shape']}, dtype {meta['dtype']}, torch {meta['torch']}, "
             f"threads {meta['threads']} (steps: per row); median of {meta['reps']} interleaved "
             f"rounds after {meta['warmup']} warmup (reference: every 3rd round). Times are per "
             "call (one layer); ratios (`batched / cpu`, `x batched`: torch_batched time over "
             "this method's) come from the same rounds. See the docstring of bench/kernels.py."]
    steps = [r for r in rows if r["table"] == "steps"]
    if steps:
        lines += ["", "## Decode steps (allocator slot layout, plan built at each step's "
                  "first layer)", "",
                  "| threads | requests | ctx | step | pool layers | torch_batched ms | "
                  "torch_cpu ms | reference ms | batched / cpu | reference / cpu |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        order = {"decode": 0, "chunk": 1, "prompts": 2}
        keys = sorted({(r["threads"], r["batch"], r["ctx"], r["kind"]) for r in steps},
                      key=lambda k: (-k[0], order[k[3]], k[1], int(k[2].split("..")[0])))
        for key in keys:
            by = {r["method"]: r for r in steps
                  if (r["threads"], r["batch"], r["ctx"], r["kind"]) == key}
            ms = {m: by[m]["time_ms"] if m in by else float("nan") for m in CPU_METHODS}
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
                         f"{by['torch_cpu']['layers']} | "
                         f"{ms['torch_batched']:.3f} | {ms['torch_cpu']:.3f} | "
                         f"{ms['reference']:.3f} | {ms['torch_batched'] / ms['torch_cpu']:.2f}x | "
                         f"{ms['reference'] / ms['torch_cpu']:.2f}x |")
    grid = [r for r in rows if r["table"] == "grid"]
    if grid:
        lines += ["", "## Uniform contexts, random slot permutation", "",
                  "| batch | ctx | KV MiB | method | ms | GB/s | copy GB/s | % of copy | "
                  "x batched |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in grid:
            lines.append(f"| {r['batch']} | {r['ctx']} | {r['kv_mib']:.1f} | {r['method']} | "
                         f"{r['time_ms']:.3f} | {r['gbps']:.1f} | {r['copy_gbps']:.1f} | "
                         f"{100 * r['frac_copy']:.0f}% | {r['vs_batched']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--quick", action="store_true", help="small grid (smoke run)")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) reference on CPU")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="CPU thread counts for the decode steps (default: torch's, then 1)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    heads, kv_heads, head_dim, dtype = SHAPES[device]
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu")
    meta = dict(device=device, device_name=name, torch=torch.__version__,
                shape=f"{heads} q heads / {kv_heads} kv heads / head_dim {head_dim}",
                dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                warmup=a.warmup, reps=a.reps, grid="quick" if a.quick else "full")
    if device == "cuda":
        import triton
        meta["triton"] = triton.__version__
        rows = run_cuda(QUICK_GRID if a.quick else FULL_GRID, a.warmup, a.reps)
    else:
        threads = a.threads or list(dict.fromkeys([torch.get_num_threads(), 1]))
        meta["step_threads"] = threads
        rows = run_cpu(QUICK_STEPS if a.quick else STEPS, QUICK_GRID if a.quick else FULL_GRID,
                       a.warmup, a.reps, not a.no_ref, threads)
    md = markdown(rows, meta)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"meta": meta, "rows": rows}, indent=1)
    (a.out / f"kernels_{device}.json").write_text(payload)
    (a.out / f"kernels_{device}.md").write_text(md)
    print(f"wrote {a.out / f'kernels_{device}.json'} and .md")


if __name__ == "__main__":
    main()
