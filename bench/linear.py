"""Decode-sized linear layers on CPU: the packed C++ kernel against torch, in one run.

For M rows (a micro-batch's tokens) and the linear layers of SmolLM2-135M (q/o 576x576,
k/v 192x576, gate/up 1536x576, down 576x1536, 30 layers, and the 49152x576 LM head), times
one pass over *all* the weights (as a decode step does: they do not fit in cache) with

* ``F.linear``: what the exported graph calls (MKL/oneDNN);
* ``W @ x^T``: the skinny fallback of :mod:`lamina.computenode.cpu_linear`;
* ``cpp``: ``ext.skinny_linear`` on weights packed by ``ext.pack_linear_weight``;

* ``q8_0`` / ``gguf``: ``ext.quant_linear`` on GGUF blocks (float32 runs only): every weight in
  Q8_0, and the builtin GGUF's mix (Q4_1 layers, a Q8_0 LM head), random blocks of those shapes;
* ``gguf-q8``: ``ext.quant_linear_q8`` on the same mix repacked (8-bit activations, integer dot
  products: the ``gguf-q8`` linear choice);

and a sequential read of the same number of bytes (``tensor.sum``) as the bandwidth baseline;
for the GGUF sets also each layer's tensor read on its own, one after another (``max`` over its
words), which is what a pass streams: short reads that each start cold.
Prints GB/s of weights streamed and GFLOP/s, saves bench/results/linear_cpu.{json,md}.

    python bench/linear.py                 # 1 thread, M = 1 2 4 8 16 32 64
    python bench/linear.py --threads 2 --rows 8 16
    python bench/linear.py --dtype bfloat16  # bfloat16 weights (and F.linear's x); the C++
                                             # kernel takes float32 x, as the replica gives it;
                                             # saves linear_cpu_bfloat16.{json,md}
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lamina.computenode.gguf_linear import BLOCK_BYTES  # noqa: E402
from lamina.kernels import cpp_ext  # noqa: E402

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = ([(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN),
           (INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)])


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernels(threads: int):
    """The C++ extension, with this process's torch threads set (exits where it does not
    build)."""
    torch.set_num_threads(threads)
    ext = cpp_ext.load()
    if ext is None:
        raise SystemExit(f"the C++ kernels are unavailable: {cpp_ext.build_error()}")
    return ext


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="best of this many passes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' dtype")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    ext = kernels(args.threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for n, k in SHAPES]
    packed = [ext.pack_linear_weight(w) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    quant = {}  # method -> [(blocks, ggml type, N)]: random blocks, the speed is the same
    if dtype == torch.float32:
        def blocks(n: int, k: int, kind: int) -> tuple:
            return (torch.randint(0, 256, (n, k // 32 * BLOCK_BYTES[kind]), dtype=torch.uint8,
                                  generator=g), kind, n)
        quant["q8_0"] = [blocks(n, k, 8) for n, k in SHAPES]
        quant["gguf"] = [blocks(n, k, 8 if n == VOCAB else 3) for n, k in SHAPES]
        quant["gguf-q8"] = [(ext.pack_q8_weight(b, kind), kind, n) for b, kind, n in quant["gguf"]]
    flat = torch.randn(nbytes // 4, generator=g)
    copy_s = _time(lambda: flat.sum(), args.reps)
    # the floor of a pass that streams each layer's weights on its own: the same tensors read
    # once each by torch (a max over int32 words), call by call as the pass reads them
    read_gb_s = {name: sum(b.nbytes for b, _, _ in layers) / _time(
        lambda: [b.view(-1)[:b.numel() // 4 * 4].view(torch.int32).max() for b, _, _ in layers],
        args.reps) / 1e9 for name, layers in quant.items()}
    rows = []
    print(f"{len(SHAPES)} weights, {nbytes / 1e6:.0f} MB; sequential read {nbytes / copy_s / 1e9:.1f}"
          f" GB/s; {args.threads} thread(s)")
    print(f"{'M':>3} {'F.linear ms':>12} {'W@x^T ms':>9} {'cpp ms':>7} {'cpp GB/s':>9} "
          f"{'cpp GFLOP/s':>12} {'cpp/F.linear':>13}")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (HIDDEN, INTER)}
        xd = {k: x.to(dtype) for k, x in xs.items()}  # F.linear's x: the weights' dtype
        t = {"linear": _time(lambda: [F.linear(xd[w.shape[1]], w) for w in weights], args.reps),
             "wxt": _time(lambda: [torch.mm(w, xd[w.shape[1]].t()) for w in weights], args.reps),
             "cpp": _time(lambda: [ext.skinny_linear(xs[w.shape[1]], p, w.shape[0], None)
                                   for w, p in zip(weights, packed)], args.reps)}
        for name, layers in quant.items():
            if name == "gguf-q8":
                t[name] = _time(lambda: [ext.quant_linear_q8(xs[k], b, n, kind, None)
                                         for (b, kind, n), (_, k) in zip(layers, SHAPES)],
                                args.reps)
                continue
            t[name] = _time(lambda: [ext.quant_linear(xs[b.shape[1] // BLOCK_BYTES[kind] * 32], b,
                                                      kind, None) for b, kind, _ in layers],
                            args.reps)
        flops = sum(2 * m * n * k for n, k in SHAPES)
        row = {"rows": m, **{f"{k}_ms": 1e3 * v for k, v in t.items()},
               "cpp_gb_s": nbytes / t["cpp"] / 1e9, "cpp_gflop_s": flops / t["cpp"] / 1e9,
               "copy_gb_s": nbytes / copy_s / 1e9, "speedup_vs_linear": t["linear"] / t["cpp"]}
        for name, layers in quant.items():
            row[f"{name}_gb_s"] = sum(b.nbytes for b, _, _ in layers) / t[name] / 1e9
            row[f"{name}_vs_cpp"] = t["cpp"] / t[name]
            row[f"{name}_read_gb_s"] = read_gb_s[name]
        rows.append(row)
        print(f"{m:3d} {row['linear_ms']:12.1f} {row['wxt_ms']:9.1f} {row['cpp_ms']:7.1f} "
              f"{row['cpp_gb_s']:9.1f} {row['cpp_gflop_s']:12.0f} {row['speedup_vs_linear']:12.2f}x"
              + "".join(f"  {n} {row[n + '_ms']:.1f} ms ({row[n + '_gb_s']:.1f} GB/s, "
                        f"{row[n + '_vs_cpp']:.2f}x cpp; read one by one {row[n + '_read_gb_s']:.1f}"
                        f" GB/s)" for n in quant), flush=True)
    meta = {"threads": args.threads, "dtype": args.dtype, "weights_mb": nbytes / 1e6,
            "copy_gb_s": nbytes / copy_s / 1e9,
            "simd": ext.simd_features(), "torch": torch.__version__,
            "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lines = [f"# Decode-sized linear layers (SmolLM2 weights in {args.dtype}, {nbytes / 1e6:.0f} "
             f"MB per pass, {args.threads} thread(s))", "",
             f"Kernels compiled for: {meta['simd']}.", "",
             f"Sequential read of the same bytes: {meta['copy_gb_s']:.1f} GB/s. Best of "
             f"{args.reps} passes.", "",
             "| rows | F.linear ms | W @ x^T ms | cpp ms | cpp GB/s | cpp GFLOP/s | cpp vs F.linear |"
             + "".join(f" {n} ms | {n} GB/s | {n} read one by one GB/s | {n} vs cpp |"
                       for n in quant),
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * 4 * len(quant)]
    lines += [f"| {r['rows']} | {r['linear_ms']:.1f} | {r['wxt_ms']:.1f} | {r['cpp_ms']:.1f} | "
              f"{r['cpp_gb_s']:.1f} | {r['cpp_gflop_s']:.0f} | {r['speedup_vs_linear']:.2f}x |"
              + "".join(f" {r[n + '_ms']:.1f} | {r[n + '_gb_s']:.1f} | {r[n + '_read_gb_s']:.1f} |"
                        f" {r[n + '_vs_cpp']:.2f}x |"
                        for n in quant) for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "linear_cpu" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
