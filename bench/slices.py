"""Decode with the slices' generated Python code against their C++ programs, in one run.

A CPU replica runs each slice as a program of ``kernels/csrc/slice_program.cpp`` unless
``KernelConfig(slices="fx")`` keeps the generated code (:mod:`lamina.computenode.native_slice`).
This decodes with both, in process on ``--device`` (default both cores), for each linear
choice (``--linear``: ``auto`` = the packed float32 kernel, ``gguf-q8`` = the GGUF's blocks with
8-bit activations) and batch size (``--batches``): ``--batch``-many random 200-token prompts,
greedy, EOS ignored. Decode tok/s = tokens of the last ``--tokens`` steps over their time (a
generate of ``--tokens + 2`` new tokens minus one of 2, so prefill and the first step drop
out). The two runners' LLMs live side by side in this process and alternate round by round;
reported: the median round and the median of the per-round ratios, and whether the greedy
tokens are equal (they must be: the same kernels in the same order).

    python bench/slices.py                       # auto and gguf-q8, batch 1 and 8, 5 rounds

Writes ``bench/results/slices_cpu.{json,md}``. Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.config import KernelConfig  # noqa: E402
from lamina.costmodel.calibration import cpu_name  # noqa: E402

RUNNERS = ("fx", "native")


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """Decode tok/s of the last ``tokens`` steps, and the generated token ids."""
    def run(n: int):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]
    short, _ = run(2)
    full, ids = run(tokens + 2)
    return len(prompts) * tokens / (full - short), ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu:0-1")
    ap.add_argument("--linear", nargs="+", default=["auto", "gguf-q8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for linear in args.linear:
        llms = {r: LLM(args.model, device=args.device,
                       kernels=KernelConfig(linear=linear, slices=r)) for r in RUNNERS}
        try:
            for batch in args.batches:
                prompts = [[rng.randrange(100, 20000) for _ in range(200)] for _ in range(batch)]
                rates: dict[str, list[float]] = {r: [] for r in RUNNERS}
                ids = {}
                for i in range(args.rounds):
                    for r in (RUNNERS if i % 2 == 0 else RUNNERS[::-1]):
                        rate, ids[r] = decode_rate(llms[r], prompts, args.tokens)
                        rates[r].append(rate)
                ratios = [n / f for f, n in zip(rates["fx"], rates["native"])]
                rows.append({"linear": linear, "batch": batch,
                             **{f"{r}_tok_s": statistics.median(rates[r]) for r in RUNNERS},
                             "native_over_fx": statistics.median(ratios),
                             "ratio_range": [min(ratios), max(ratios)],
                             "identical": ids["fx"] == ids["native"]})
                print(rows[-1], flush=True)
        finally:
            for llm in llms.values():
                llm.close()
    when = time.strftime("%Y-%m-%d %H:%M")
    lines = [f"# Decode: slices as generated Python vs C++ programs ({args.model}, {cpu_name()}, "
             f"{args.device}, {when})", "",
             f"`python bench/slices.py` ({args.rounds} rounds, runners alternating; "
             f"{args.tokens} decode steps of 200-token prompts, greedy).", "",
             "| linear | batch | fx tok/s | native tok/s | native / fx (median, range) | "
             "greedy identical |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['linear']} | {r['batch']} | {r['fx_tok_s']:.1f} | {r['native_tok_s']:.1f} | "
              f"{r['native_over_fx']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) "
              f"| {'yes' if r['identical'] else 'NO'} |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "device": args.device, "cpu": cpu_name(), "when": when,
            "rounds": args.rounds, "tokens": args.tokens}
    (args.out / "slices_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "slices_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
