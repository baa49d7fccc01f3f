"""Linear layers that read the same rows: one call per weight against one call per group.

SmolLM2-135M's layers (30) have q/k/v (576, 192, 192 x 576) on one input and gate/up
(1536, 1536 x 576) on another. A decode step calls each weight on its own (``per weight``: five
calls a layer) or each group at once (``grouped``: two calls a layer, the weights packed back to
back; :mod:`lamina.computenode.linear_groups`). Both compute the same outputs bit for bit. Timed
for float32 panels (``skinny_linear`` / ``skinny_linear_group``) and, with random Q4_1 blocks
(the builtin GGUF's layers), the ``gguf-q8`` kernels (``quant_linear_q8`` /
``quant_linear_q8_group``), over all 30 layers (their weights do not fit in cache), rounds
interleaved; per round the ratio per weight / grouped (> 1: grouping is faster).

    python bench/linear_groups.py                   # 2 threads, rows 1 4 16, 15 rounds
    python bench/linear_groups.py --threads 1 --rows 1

Prints and saves bench/results/linear_groups_cpu.{json,md}. Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.linear import kernels  # noqa: E402

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
GROUPS = [(HIDDEN, KV, KV), (INTER, INTER)]  # output sizes of each group; input HIDDEN
Q4_1, Q4_1_BYTES = 3, 20  # ggml type, bytes per block of 32


def setups(ext, g: torch.Generator) -> dict[str, list]:
    """Per system, the calls of one pass: ``(fn, args)``."""
    f32 = [[torch.randn(n, HIDDEN, generator=g) / HIDDEN ** 0.5 for n in ns]
           for _ in range(LAYERS) for ns in GROUPS]
    blocks = [[torch.randint(0, 256, (n, HIDDEN // 32 * Q4_1_BYTES), dtype=torch.uint8,
                             generator=g) for n in ns] for _ in range(LAYERS) for ns in GROUPS]
    for group in blocks:  # small float16 scales and minimums, as real blocks have
        for b in group:
            v = b.view(-1, Q4_1_BYTES)
            v[:, :4] = (torch.randn(v.shape[0], 2, generator=g) * 0.01).half().view(torch.uint8)
    return {
        "float32 per weight": [(ext.skinny_linear, (ext.pack_linear_weight(w), w.shape[0], None))
                               for group in f32 for w in group],
        "float32 grouped": [(ext.skinny_linear_group,
                             (torch.cat([ext.pack_linear_weight(w) for w in group]),
                              [w.shape[0] for w in group])) for group in f32],
        "gguf-q8 per weight": [(ext.quant_linear_q8, (ext.pack_q8_weight(b, Q4_1), b.shape[0],
                                                      Q4_1, None))
                               for group in blocks for b in group],
        "gguf-q8 grouped": [(ext.quant_linear_q8_group,
                             (ext.pack_q8_weight(torch.cat(group), Q4_1),
                              [b.shape[0] for b in group], Q4_1)) for group in blocks],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    ext = kernels(args.threads)
    g = torch.Generator().manual_seed(0)
    systems = setups(ext, g)
    rows = []
    for m in args.rows:
        x = torch.randn(m, HIDDEN, generator=g)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(args.rounds + 2):  # two warm-up rounds
            for name, calls in systems.items():
                t = time.perf_counter()
                for fn, rest in calls:
                    fn(x, *rest)
                if r >= 2:
                    times[name].append(1e3 * (time.perf_counter() - t))
        for kind in ("float32", "gguf-q8"):
            per, grp = times[f"{kind} per weight"], times[f"{kind} grouped"]
            ratios = sorted(a / b for a, b in zip(per, grp))
            row = {"rows": m, "kernels": kind, "per_weight_ms": statistics.median(per),
                   "grouped_ms": statistics.median(grp), "ratio": statistics.median(ratios),
                   "ratio_min": ratios[0], "ratio_max": ratios[-1]}
            rows.append(row)
            print(f"rows {m:3d} {kind:8s} per weight {row['per_weight_ms']:6.2f} ms  grouped "
                  f"{row['grouped_ms']:6.2f} ms  per weight / grouped {row['ratio']:.2f}x "
                  f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f})", flush=True)
    meta = {"threads": args.threads, "rounds": args.rounds, "simd": ext.simd_features(),
            "torch": torch.__version__, "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lines = [f"# Linear groups: q/k/v and gate/up of SmolLM2's 30 layers, one call per weight "
             f"against one per group ({args.threads} thread(s), {meta['time']})", "",
             f"Kernels compiled for: {meta['simd']}. Medians of {args.rounds} interleaved rounds; "
             "ratio: per round, per weight / grouped (range in brackets).", "",
             "    python bench/linear_groups.py " + " ".join(argv or sys.argv[1:]), "",
             "| rows | kernels | per weight ms | grouped ms | per weight / grouped |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['kernels']} | {r['per_weight_ms']:.2f} | {r['grouped_ms']:.2f} "
              f"| {r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_groups_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                                indent=1))
    (args.out / "linear_groups_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
