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
* ``grid``: uniform contexts (batch 1..64 x 256..4096 tokens), each request's slots shuffled
  16-token slabs of the pool, float32 and bfloat16 pools, at 1 thread and at torch's thread
  count; one call per pool layer per round (at least 2 layers, cache-cold). ``GB/s`` = KV bytes
  read / time and ``% copy`` = that over a plain ``dst.copy_(src)`` of the KV's size (read +
  write bytes), timed in the same rounds. Pools and the copy's tensors are allocated like a
  memory node's pool (:func:`~lamina.device.huge_page_zeros`: transparent huge pages
  where the host allows), so both sides of the ratio get the same pages.

Methods: ``cpp`` (the C++ kernel, :mod:`lamina.kernels.cpp_ext`; the CPU default),
``torch_cpu`` (the torch path: sparse ops, :mod:`lamina.kernels.torch_sparse`),
``torch_batched`` (padded gather + bmm), ``reference`` (per-request loop; steps only, fewer
rounds), and in the grid ``read``: one thread reading the same K/V rows in the same order with
the kernel's prefetching and no arithmetic, the ceiling of this access pattern on one core.
``torch_cpu / cpp`` and ``batched / cpp``: the other method's time over cpp's.
On CUDA (32/8/128 bfloat16, same call repeated): ``triton``, ``sdpa_padded`` (contiguous, no
paging) and ``torch_batched``.

    python bench/kernels.py            # steps + grid (~8 minutes on 2 idle CPU cores)
    python bench/kernels.py --quick    # smoke run (under a minute; pools of 256 MiB)

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

from lamina.kernels import (cpp_ext, paged_attention_batched,  # noqa: E402
                            paged_attention_cpu, paged_attention_ref, plan_cache)
from lamina.memnode.allocator import SlabAllocator  # noqa: E402
from lamina.device import huge_page_zeros  # noqa: E402
from lamina.types import AttentionSpec  # noqa: E402

# (requests, context lo, hi, kind): see cpu_case
STEPS = [(r, lo, hi, "decode") for r in (16, 32, 64) for lo, hi in ((16, 184), (100, 500))] \
    + [(16, 16, 184, "chunk"), (16, 16, 160, "prompts")]
FULL_GRID = [(b, c) for b in (1, 8, 32, 64) for c in (256, 1024, 4096)]
# GPU: batch 1..256 x context 512..32k (cells whose KV and its copies do not fit are skipped)
QUICK_STEPS, QUICK_GRID = [(16, 16, 184, "decode"), (16, 16, 184, "chunk")], [(32, 1024)]
SLAB = 16  # tokens per slab of the grid's slot layout
GRID_DTYPES = (torch.float32, torch.bfloat16)
SHAPES = {"cpu": (9, 3, 64, torch.float32), "cuda": (32, 8, 128, torch.bfloat16)}
POOL_BUDGET = 3 << 29  # bytes of K+V over all cycled layers
QUICK_POOL_BUDGET = 1 << 28  # --quick: fewer cycled layers (still far beyond the caches)
REF_CALLS = 3  # the reference times this many calls per step (it is ~10-100x slower)
SERVING_SLOTS = (1 << 30) // (30 * 2 * 3 * 64 * 4)  # pool of the default kv_cache_gb=1 (SmolLM2)
CALLS_PER_STEP = 30  # SmolLM2-135M has 30 attention layers
CHUNK = 128  # prompt tokens of the prefill chunk in the mixed step
CPU_METHODS = {"cpp": cpp_ext.paged_attention_cpp, "torch_batched": paged_attention_batched,
               "torch_cpu": paged_attention_cpu, "reference": paged_attention_ref}


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


def slab_slots(ctx: np.ndarray, rng: np.random.Generator, cap: int) -> list[np.ndarray]:
    """Each request's slots: shuffled ``SLAB``-token slabs of a ``cap``-slot pool."""
    slabs = rng.permutation(cap // SLAB)
    out, used = [], 0
    for n in ctx:
        k = -(-int(n) // SLAB)
        out.append((slabs[used:used + k, None] * SLAB + np.arange(SLAB)).reshape(-1)[:n])
        used += k
    return out


def cpu_case(ctx: np.ndarray, layout: str, kind: str = "decode", seed: int = 0,
             dtype: torch.dtype | None = None, budget: int = POOL_BUDGET) -> dict:
    """Pool, per-layer queries and index tensors of one step: ``decode`` (one query per
    request), ``chunk`` (and one more request: a ``CHUNK``-token prompt) or ``prompts`` (every
    request a whole prompt of ``ctx`` tokens). ``layout``: ``alloc`` (the allocator after
    churn), ``slabs`` (shuffled 16-token slabs) or ``perm`` (a random subset of slots).
    ``budget``: bytes of K+V over the cycled layers."""
    heads, kv_heads, head_dim, default = SHAPES["cpu"]
    dtype = dtype or default
    esize = torch.empty(0, dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    prefill = CHUNK if kind == "chunk" else 0
    S = max(int(ctx.sum()) + prefill + 4096, SERVING_SLOTS)
    S += -S % SLAB
    if layout == "alloc":
        slots = allocator_slots(ctx, rng, S, prefill, 0.0 if kind == "prompts" else 0.6)
    elif layout == "slabs":
        slots = slab_slots(ctx, rng, S)
    else:
        slots = np.split(rng.permutation(S)[: int(ctx.sum())], np.cumsum(ctx)[:-1])
    lens = np.array([s.size for s in slots])
    q_lens = lens if kind == "prompts" else np.array([1] * ctx.size + [prefill] * bool(prefill))
    q_pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens)])
    layer_bytes = 2 * S * kv_heads * head_dim * esize
    L = int(min(30, max(2, budget // layer_bytes)))
    g = torch.Generator().manual_seed(seed)
    k = huge_page_zeros((L, S, kv_heads, head_dim), dtype)  # as a memory node's pool
    v = huge_page_zeros((L, S, kv_heads, head_dim), dtype)
    k.copy_(torch.randn(L, S, kv_heads, head_dim, generator=g))
    v.copy_(torch.randn(L, S, kv_heads, head_dim, generator=g))
    T = int(q_lens.sum())
    qs = [torch.randn(T, heads, head_dim, generator=g).to(dtype) for _ in range(L)]
    idx = (torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])),
           torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])),
           torch.from_numpy(np.concatenate(slots)), torch.from_numpy(q_pos),
           torch.zeros(lens.size, dtype=torch.int64))
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * esize
    return dict(k=k, v=v, qs=qs, idx=idx, spec=_spec(heads, kv_heads, head_dim), L=L,
                kv_bytes=kv_bytes, dtype=dtype)


def time_steps(case: dict, methods: dict, reps: int, warmup: int, ref_every: int,
               calls: int = CALLS_PER_STEP) -> dict[str, float]:
    """Median seconds per call of each method, ``calls`` calls (one step: every layer) per
    method per round, rounds interleaved; ``reference`` runs every ``ref_every``-th round, and
    only ``REF_CALLS`` calls."""
    k, v, qs, idx, spec, L = (case[n] for n in ("k", "v", "qs", "idx", "spec", "L"))
    copy_src = huge_page_zeros((case["kv_bytes"] // 4,), torch.float32).normal_()  # pool pages
    copy_dst = huge_page_zeros((case["kv_bytes"] // 4,), torch.float32)

    def step(fn, n):
        plan_cache.clear()  # every step builds its plan at its first layer, as in serving
        t0 = time.perf_counter()
        for layer in range(n):
            fn(qs[layer % L], k[layer % L], v[layer % L], *idx, spec)
        return (time.perf_counter() - t0) / n

    def copy():
        t0 = time.perf_counter()
        copy_dst.copy_(copy_src)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"copy": [], **{m: [] for m in methods}}
    for rnd in range(warmup + reps):
        for name, fn in methods.items():
            if name == "reference" and rnd % ref_every and rnd != warmup:
                continue
            t = step(fn, min(calls, REF_CALLS) if name == "reference" else calls)
            if rnd >= warmup:
                times[name].append(t)
        c = copy()
        if rnd >= warmup:
            times["copy"].append(c)
    return {n: statistics.median(ts) for n, ts in times.items() if ts}


def _cpu_rows(case: dict, t: dict, methods: dict, **key) -> list[dict]:
    copy_bw = 2 * case["kv_bytes"] / t["copy"]
    return [dict(**key, dtype=str(case["dtype"]).removeprefix("torch."), layers=case["L"],
                 method=name, kv_mib=case["kv_bytes"] / 2**20, time_ms=t[name] * 1e3,
                 gbps=case["kv_bytes"] / t[name] / 1e9, copy_gbps=copy_bw / 1e9,
                 frac_copy=case["kv_bytes"] / t[name] / copy_bw,
                 vs_batched=t["torch_batched"] / t[name], vs_torch_cpu=t["torch_cpu"] / t[name])
            for name in methods]


def read_kv_rows(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, *rest) -> float:
    """The grid's ceiling: one thread reads the same K and V rows in the same order, with the
    kernel's software prefetch, and does no arithmetic (``read_kv_rows`` in the extension)."""
    return cpp_ext.load().read_kv_rows(k_pool, v_pool, kv_indices)


def run_cpu(steps: list, grid: list, warmup: int, reps: int, with_ref: bool,
            threads: list[int], grid_reps: int, budget: int = POOL_BUDGET) -> list[dict]:
    """Steps (allocator layout, float32) at every thread count in ``threads``; the grid
    (shuffled slabs) for float32 and bfloat16 at each of ``threads``; pools of ``budget``
    bytes of K+V (see :func:`cpu_case`)."""
    methods = dict(CPU_METHODS) if with_ref else {n: f for n, f in CPU_METHODS.items()
                                                  if n != "reference"}
    grid_methods = {n: f for n, f in methods.items() if n != "reference"}
    grid_methods["read"] = read_kv_rows
    points = [("steps", r, lo, hi, "alloc", kind) for r, lo, hi, kind in steps]
    rows, default_threads = [], torch.get_num_threads()
    for i, (table, R, lo, hi, layout, kind) in enumerate(points):
        ctx = np.random.default_rng(100 + i).integers(lo, hi + 1, R)
        case = cpu_case(ctx, layout, kind, seed=i, budget=budget)
        label = f"{lo}..{hi}" if lo != hi else str(lo)
        for nt in threads:
            torch.set_num_threads(nt)
            t = time_steps(case, methods, reps, warmup, ref_every=3)
            rows += _cpu_rows(case, t, methods, table=table, threads=nt, batch=R, ctx=label,
                              mean_ctx=float(ctx.mean()), kind=kind)
            print(f"{table} threads={nt} R={R} ctx={label} {kind}: "
                  + ", ".join(f"{n} {t[n] * 1e3:.3f} ms" for n in methods), flush=True)
        torch.set_num_threads(default_threads)
        del case
    for dtype in GRID_DTYPES:
        for j, (R, c) in enumerate(grid):
            case = cpu_case(np.full(R, c), "slabs", "decode", seed=1000 + j, dtype=dtype,
                            budget=budget)
            for nt in threads:
                torch.set_num_threads(nt)
                t = time_steps(case, grid_methods, grid_reps, warmup, ref_every=1,
                               calls=max(2, case["L"]))
                rows += _cpu_rows(case, t, grid_methods, table="grid", threads=nt, batch=R,
                                  ctx=str(c), mean_ctx=float(c), kind="decode")
                cpp = rows[-len(grid_methods)]
                print(f"grid {cpp['dtype']} threads={nt} R={R} ctx={c}: cpp "
                      f"{cpp['gbps']:.1f} GB/s = {100 * cpp['frac_copy']:.0f}% of copy, "
                      f"{cpp['vs_torch_cpu']:.2f}x torch_cpu; read {rows[-1]['gbps']:.1f} GB/s",
                      flush=True)
            torch.set_num_threads(default_threads)
            del case
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Paged decode attention ({meta['device_name']})", "",
             f"shape: {meta['shape']}, torch {meta['torch']}; median of interleaved rounds "
             f"({meta['reps']} for steps, {meta.get('grid_reps', meta['reps'])} for the grid) "
             f"after {meta['warmup']} warmup (reference: every 3rd round, {REF_CALLS} calls). "
             "Times are per call "
             "(one layer); every ratio compares methods timed in the same rounds. See the "
             "docstring of bench/kernels.py."]
    steps = [r for r in rows if r["table"] == "steps"]
    if steps:
        names = [m for m in CPU_METHODS if any(r["method"] == m for r in steps)]
        lines += ["", "## Decode steps (float32, allocator slot layout, the torch path's plan "
                  "built at each step's first layer)", "",
                  "| threads | requests | ctx | step | " + " | ".join(f"{m} ms" for m in names)
                  + " | torch_cpu / cpp | batched / cpp |",
                  "|---:|---:|---:|---|" + "---:|" * (len(names) + 2)]
        order = {"decode": 0, "chunk": 1, "prompts": 2}
        keys = sorted({(r["threads"], r["batch"], r["ctx"], r["kind"]) for r in steps},
                      key=lambda k: (-k[0], order[k[3]], k[1], int(k[2].split("..")[0])))
        for key in keys:
            by = {r["method"]: r for r in steps
                  if (r["threads"], r["batch"], r["ctx"], r["kind"]) == key}
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
                         + " | ".join(f"{by[m]['time_ms']:.3f}" for m in names)
                         + f" | {by['cpp']['vs_torch_cpu']:.2f}x | {by['cpp']['vs_batched']:.2f}x |")
    grid = [r for r in rows if r["table"] == "grid"]
    if grid and meta["device"] == "cpu":
        lines += ["", "## Uniform contexts, shuffled 16-token slabs: KV bytes/s vs copy bandwidth",
                  "", "`read`: one thread reading the same rows in the same order with no "
                  "arithmetic (the ceiling of this access pattern on one core).", "",
                  "| dtype | threads | batch | ctx | KV MiB | copy GB/s | read GB/s | cpp GB/s | "
                  "cpp % of copy | cpp % of read | torch_cpu % of copy | batched % of copy | "
                  "cpp / torch_cpu | cpp / batched |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        keys = list(dict.fromkeys((r["dtype"], r["threads"], r["batch"], r["ctx"]) for r in grid))
        for key in keys:
            by = {r["method"]: r for r in grid
                  if (r["dtype"], r["threads"], r["batch"], r["ctx"]) == key}
            c = by["cpp"]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {c['kv_mib']:.1f} | "
                         f"{c['copy_gbps']:.1f} | {by['read']['gbps']:.1f} | {c['gbps']:.1f} | "
                         f"{100 * c['frac_copy']:.0f}% | "
                         f"{100 * c['gbps'] / by['read']['gbps']:.0f}% | "
                         f"{100 * by['torch_cpu']['frac_copy']:.0f}% | "
                         f"{100 * by['torch_batched']['frac_copy']:.0f}% | "
                         f"{c['vs_torch_cpu']:.2f}x | {c['vs_batched']:.2f}x |")
    elif grid:
        lines += ["", "## Uniform contexts, random slot permutation", "",
                  "`ms`, `GB/s`, `MBU`: per call, host included (calls back to back); "
                  "`device us`, `MBU on device`: the kernels alone (the host queued ahead, "
                  "`*` where it could not keep ahead); `x bf16`: tokens/s over bfloat16 "
                  "`triton` (wall, device). KV MiB: the bytes a call reads.", "",
                  "| batch | ctx | KV MiB | method | ms | host us | GB/s | copy GB/s | % of copy | "
                  "MBU (% of spec) | device us | MBU on device | x bf16 | x batched |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        pct = lambda x: "n/a" if x != x else f"{100 * x:.0f}%"  # noqa: E731
        for r in grid:
            dev = r.get("dev_us", float("nan"))
            devs = "n/a" if dev != dev else f"{dev:.1f}{'' if r.get('host_ahead') else '*'}"
            xb = (f"{r['vs_bf16']:.2f}x / {r['vs_bf16_dev']:.2f}x"
                  if r["method"].startswith("triton_") and "vs_bf16" in r else "")
            lines.append(f"| {r['batch']} | {r['ctx']} | {r['kv_mib']:.1f} | {r['method']} | "
                         f"{r['time_ms']:.3f} | {r.get('host_us', float('nan')):.1f} | "
                         f"{r['gbps']:.1f} | {r['copy_gbps']:.1f} | "
                         f"{100 * r['frac_copy']:.0f}% | {pct(r.get('mbu', float('nan')))} | "
                         f"{devs} | {pct(r.get('dev_mbu', float('nan')))} | {xb} | "
                         f"{r['vs_batched']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--quick", action="store_true",
                    help="one step, one grid point, fewer rounds, smaller pools (under a minute)")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) reference on CPU")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="CPU thread counts for the decode steps (default: torch's, then 1)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="rounds per step (10; --quick 5)")
    ap.add_argument("--grid-reps", type=int, default=None,
                    help="rounds per grid point (5; --quick 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="CUDA: only these batch sizes of the grid")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="CUDA: only these context lengths of the grid")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    a.reps = a.reps or (5 if a.quick else 10)
    a.grid_reps = a.grid_reps or (3 if a.quick else 5)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    heads, kv_heads, head_dim, dtype = SHAPES[device]
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu")
    meta = dict(device=device, device_name=name, torch=torch.__version__,
                shape=f"{heads} q heads / {kv_heads} kv heads / head_dim {head_dim}",
                dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                warmup=a.warmup, reps=a.reps, grid_reps=a.grid_reps,
                grid="quick" if a.quick else "full")
    if device == "cuda":
        import triton
        meta["triton"] = triton.__version__
        from kernels_cuda import CUDA_GRID, run_cuda  # this script's folder
        grid = [(b, c) for b, c in (QUICK_GRID if a.quick else CUDA_GRID)
                if (a.batches is None or b in a.batches) and (a.contexts is None or c in a.contexts)]
        rows = run_cuda(grid, a.warmup, a.reps)
    else:
        threads = a.threads or list(dict.fromkeys([torch.get_num_threads(), 1]))
        meta["step_threads"] = threads
        if cpp_ext.load() is None:
            raise SystemExit(f"the C++ kernel did not build: {cpp_ext.build_error()}")
        rows = run_cpu(QUICK_STEPS if a.quick else STEPS, QUICK_GRID if a.quick else FULL_GRID,
                       a.warmup, a.reps, not a.no_ref, threads, a.grid_reps,
                       QUICK_POOL_BUDGET if a.quick else POOL_BUDGET)
    md = markdown(rows, meta)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"meta": meta, "rows": rows}, indent=1)
    (a.out / f"kernels_{device}.json").write_text(payload)
    (a.out / f"kernels_{device}.md").write_text(md)
    print(f"wrote {a.out / f'kernels_{device}.json'} and .md")


if __name__ == "__main__":
    main()
