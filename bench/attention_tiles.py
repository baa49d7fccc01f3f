"""The C++ CPU attention kernel's tile path against its per-query path, same run.

An item whose KV head serves many query vectors (a prefill chunk, a cascade's shared prefix
read for a group of requests) runs as two small matrix products per block of keys
(``kernels/csrc/attention_tile.h``); below ``kTileMin`` query vectors per KV head (a decode
step: one row per request) it runs the per-query kernels. The baseline is the same source built
with the tile threshold above any item (``-DLAMINA_TILE_MIN=1000000``: every item per query), so
the two differ only in that path. SmolLM2's attention shape (9 q heads, 3 KV heads, head_dim 64),
float32; each shape cycles over enough layers (slots shuffled in 16-token slabs, pools in huge
pages as a node's are) that its KV is read from memory, as in a model; rounds interleave the
two builds.

Shapes: a cascade group (64 decode rows, one per request, over a 2,000-token shared prefix),
a prefill chunk (512 rows at the end of 2,048 keys, causal), extends (16 requests x 4 rows over
1,024 keys) and, as a control both builds run per query, a decode batch (32 x 1,024).

    python bench/attention_tiles.py                 # 2 threads
    python bench/attention_tiles.py --threads 1 --reps 9

Reports ms per call (one layer), GFLOP/s (2 FLOPs per multiply-add, q.k and p.v over the visible
keys) and per-query / tile per round (median and range), and, as the arithmetic's ceiling on
this machine, the GFLOP/s of ``torch.bmm`` (its BLAS) doing the call's two products on dense
in-cache tensors of the same shapes, without softmax or paging. Writes
``bench/results/attention_tiles_cpu.{json,md}`` (``--out``). Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.costmodel.calibration import cpu_name  # noqa: E402
from lamina.device import huge_page_zeros  # noqa: E402
from lamina.kernels import cpp_ext  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
SLAB = 16
PER_QUERY = ("-DLAMINA_TILE_MIN=1000000",)
# name: (requests, rows per request, keys per request, causal: rows end the keys)
SHAPES = {
    "cascade group: 64 rows x 2000-key prefix": (1, 64, 2000, False),
    "prefill chunk: 512 rows x 2048 keys": (1, 512, 2048, True),
    "extend: 16 x 4 rows x 1024 keys": (16, 4, 1024, True),
    "decode (control): 32 x 1 row x 1024 keys": (32, 1, 1024, True),
}


def shape_calls(requests: int, rows: int, keys: int, causal: bool, budget: int,
                seed: int) -> tuple[list[tuple], float]:
    """Arguments of one call per layer, and the call's FLOPs."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    layer_bytes = requests * keys * KV_HEADS * DIM * 4 * 2
    layers = max(2, min(64, budget // layer_bytes))
    slots = requests * keys
    # in huge pages, as KVPool allocates a node's pools (4 KB pages would add a TLB miss to
    # nearly every slab)
    k = huge_page_zeros((layers, slots, KV_HEADS, DIM), torch.float32).normal_(generator=gen)
    v = huge_page_zeros((layers, slots, KV_HEADS, DIM), torch.float32).normal_(generator=gen)
    q = torch.randn(requests * rows, HEADS, DIM, generator=gen)
    qo = torch.arange(requests + 1) * rows
    kvp = torch.arange(requests + 1) * keys
    pos = (torch.arange(keys - rows, keys) if causal else torch.full((rows,), keys + 50))
    pos = pos.repeat(requests)
    start = torch.zeros(requests, dtype=torch.long)
    calls = []
    for layer in range(layers):
        slabs = rng.permutation(slots // SLAB)
        idx = torch.from_numpy((slabs[:, None] * SLAB + np.arange(SLAB)).reshape(-1)).int()
        calls.append((q, k[layer], v[layer], qo, kvp, idx, pos, start))
    seen = sum(min(keys, int(p) + 1) for p in pos[:rows]) * requests
    return calls, 4.0 * seen * HEADS * DIM


def pass_time(ext, calls: list[tuple]) -> float:
    """Seconds per call over one pass of the layers."""
    t0 = time.perf_counter()
    for c in calls:
        ext.paged_attention(*c, DIM ** -0.5, 0, 0.0)
    return (time.perf_counter() - t0) / len(calls)


def gemm_gflops(requests: int, rows: int, keys: int, reps: int) -> float:
    """GFLOP/s of ``torch.bmm`` computing q.k and p.v of every KV head's queries over all
    ``keys`` (dense, contiguous, in cache; no softmax, no mask): the BLAS's rate, best of
    ``reps`` timings of at least 0.1 s each."""
    g, b = HEADS // KV_HEADS, requests * KV_HEADS
    q, k = torch.randn(b, g * rows, DIM), torch.randn(b, DIM, keys)
    v = torch.randn(b, keys, DIM)
    best = float("inf")
    for _ in range(reps + 1):
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < 0.1 or n == 0:
            torch.bmm(torch.bmm(q, k), v)
            n += 1
        best = min(best, dt / n)
    return 4.0 * b * g * rows * keys * DIM / best / 1e9


def run(threads: int, reps: int, budget: int) -> list[dict]:
    torch.set_num_threads(threads)
    tile, per_query = cpp_ext.load(), cpp_ext.load(extra=PER_QUERY)
    if tile is None or per_query is None:
        sys.exit(f"the C++ kernel is unavailable: {cpp_ext.build_error()}")
    rows = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        calls, flops = shape_calls(*shape, budget, seed=i)
        o1, _ = tile.paged_attention(*calls[0], DIM ** -0.5, 0, 0.0)
        o0, _ = per_query.paged_attention(*calls[0], DIM ** -0.5, 0, 0.0)
        diff = (o1 - o0).abs().max().item()
        t_tile, t_pq = [], []
        for rnd in range(reps + 1):  # round 0 warms up
            a, b = pass_time(per_query, calls), pass_time(tile, calls)
            if rnd:
                t_pq.append(a)
                t_tile.append(b)
        ratio = [a / b for a, b in zip(t_pq, t_tile)]
        r = dict(shape=name, threads=threads, layers=len(calls), flops=flops,
                 ms_per_query=statistics.median(t_pq) * 1e3, ms_tile=statistics.median(t_tile) * 1e3,
                 ratio=statistics.median(ratio), ratio_min=min(ratio), ratio_max=max(ratio),
                 max_abs_diff=diff)
        r["gflops_per_query"] = flops / r["ms_per_query"] / 1e6
        r["gflops_tile"] = flops / r["ms_tile"] / 1e6
        r["gflops_gemm"] = gemm_gflops(*shape[:3], reps)
        rows.append(r)
        print(f"{name}: per query {r['ms_per_query']:.3f} ms ({r['gflops_per_query']:.1f} GFLOP/s), "
              f"tile {r['ms_tile']:.3f} ms ({r['gflops_tile']:.1f} GFLOP/s): "
              f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}), "
              f"outputs within {diff:.1e}; torch.bmm {r['gflops_gemm']:.1f} GFLOP/s", flush=True)
        del calls
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Attention tiles on the C++ CPU kernel ({meta['cpu']})", "",
           f"SmolLM2's attention shape (9/3 heads, D 64), float32 pools, {meta['threads']} "
           f"thread(s), kernel {meta['simd']}, torch {meta['torch']}; median of {meta['reps']} "
           "interleaved rounds; per query: the same source built with `-DLAMINA_TILE_MIN=1000000`; "
           "`x`: per-query time / tile time per round (range in brackets); `bmm`: the GFLOP/s of "
           "torch.bmm doing the call's two products dense and in cache (no softmax, no paging): "
           "the machine's BLAS on the same shapes.", "",
           "    " + meta["command"], "",
           "| shape | ms per call, per query | tile | GFLOP/s, per query | tile | bmm | x |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['ms_per_query']:.3f} | {r['ms_tile']:.3f} | "
                   f"{r['gflops_per_query']:.1f} | {r['gflops_tile']:.1f} | {r['gflops_gemm']:.1f} | "
                   f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget-mib", type=int, default=192,
                    help="KV bytes each shape's layers add up to (cache-cold reads)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    rows = run(a.threads, a.reps, a.budget_mib << 20)
    meta = dict(cpu=cpu_name(), threads=a.threads, reps=a.reps,
                simd=cpp_ext.load().simd_features(), torch=torch.__version__,
                command="python bench/attention_tiles.py " + " ".join(argv or sys.argv[1:]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "attention_tiles_cpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (a.out / "attention_tiles_cpu.md").write_text(markdown(rows, meta))
    print(f"wrote {a.out / 'attention_tiles_cpu'}.json and .md")


if __name__ == "__main__":
    main()
