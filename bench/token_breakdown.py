"""Where a batch-1 decode token goes, in process on CPU: the weight stream and the rest, one run.

Issue 42's floor row compares lamina's batch-1 time per token with the time it takes only to
stream its float32 weights once. This splits the token, round by round, into what the run's
timeline (:mod:`lamina.timeline`) records:

* ``slices``: the dense slices of the step (the packed linear layers and every small op between
  them: norms, RoPE, SiLU, residual adds, views; and the LM head with sampling);
* ``attention``: the memory node's ATTEND kernels (in process the node attends inside the
  step's C++ call, between two slices);
* ``hand-off``: the step's send and receive spans around each attention;
* ``engine``: the rest of the token's wall time (Python between steps: scheduling, the
  step's inputs, the stream's outputs);

and measures in the same round, on the same threads, what bounds them:

* ``linear pass``: the packed linear kernel alone over SmolLM2's 211 weight matrices at one row
  (``bench/linear.py``'s ``cpp`` column, best of ``--reps``), random weights of the same shapes;
* the machine's copy and read bandwidth (``bench/bandwidth.py``) and the weights' bytes over
  them: the floor the issue's row divides by.

    python bench/token_breakdown.py                # 3 rounds of 1 x 200 -> 64 on every core
    python bench/token_breakdown.py --rounds 5 --new-tokens 128

Prints a table, writes bench/results/token_breakdown_cpu.{json,md} (``--out``). Never asserts
speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from lamina import LLM, SamplingParams  # noqa: E402  (before torch: lamina sets OpenMP's policy)

import torch  # noqa: E402

from bandwidth import copy_bandwidth, read_bandwidth  # noqa: E402
from linear import SHAPES, _time, kernels  # noqa: E402
from lamina.costmodel.calibration import cpu_name  # noqa: E402
from lamina.device import wait_populated  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PARTS = ("slices", "attention", "hand-off", "engine")


def decode_split(llm: LLM, prompt: list[int], new_tokens: int) -> dict:
    """ms per token of one request decoding ``new_tokens``, whole and by part, from the
    timeline's stages (:meth:`Timeline.stage_seconds`) between its second token and its last:
    the one replica's ``dense`` (slices) and ``transfer`` (hand-off), the one node's
    ``attention``; the engine is the rest."""
    llm.timeline.spans.clear()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    stamps = [time.perf_counter_ns() for _ in llm.generate_stream([prompt], params)]
    t0, t1, n = stamps[1], stamps[-1], len(stamps) - 2
    stages = {row["role"]: row for row in llm.timeline.stage_seconds(t0, t1)}
    llm.timeline.spans.clear()
    per_token = 1e3 / n
    ms = {"wall": (t1 - t0) / 1e6 / n,
          "slices": stages.get("compute 0", {}).get("dense", 0.0) * per_token,
          "attention": stages.get("memory 0", {}).get("attention", 0.0) * per_token,
          "hand-off": stages.get("compute 0", {}).get("transfer", 0.0) * per_token}
    ms["engine"] = max(0.0, ms["wall"] - ms["slices"] - ms["attention"] - ms["hand-off"])
    return ms


def linear_pass_ms(ext, packed: list, reps: int) -> float:
    """ms of the packed linear kernel over every weight once, one row (best of ``reps``)."""
    xs = {k: torch.randn(1, k) for k in {k for _, k in SHAPES}}
    return 1e3 * _time(lambda: [ext.skinny_linear(xs[k], p, n, None)
                                for (n, k), p in zip(SHAPES, packed)], reps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default=None, help="default: cpu:<first>-<last> of this process's cores")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="linear pass: best of this many")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    device = args.device or (f"cpu:{cores[0]}-{cores[-1]}" if len(cores) > 1 else f"cpu:{cores[0]}")
    rng = random.Random(42)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    with LLM(args.model, placement="inproc", device=device, trace=os.devnull) as llm:
        threads = torch.get_num_threads()  # the replica's (the process is pinned to its cores)
        ext = kernels(threads)
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in SHAPES]
        packed = [ext.pack_linear_weight(w) for w in weights]
        wbytes = sum(w.nbytes for w in weights)
        del weights
        wait_populated()  # steady state: the KV pool committed (bench/prefix.py does the same)
        decode_split(llm, prompt, 4)  # warm-up
        rounds = []
        for r in range(args.rounds):
            row = decode_split(llm, prompt, args.new_tokens)
            row["linear"] = linear_pass_ms(ext, packed, args.reps)
            row["copy_GBps"] = copy_bandwidth(threads) / 1e9
            row["read_GBps"] = read_bandwidth(threads) / 1e9
            row["copy_floor"] = wbytes / row["copy_GBps"] / 1e6
            row["read_floor"] = wbytes / row["read_GBps"] / 1e6
            rounds.append(row)
            print(f"round {r}: {row['wall']:.1f} ms/token = slices {row['slices']:.1f} + attention "
                  f"{row['attention']:.2f} + hand-off {row['hand-off']:.2f} + engine "
                  f"{row['engine']:.2f}; linear pass alone {row['linear']:.1f} ms; floor "
                  f"{row['copy_floor']:.1f} ms at {row['copy_GBps']:.1f} GB/s copy, "
                  f"{row['read_floor']:.1f} at {row['read_GBps']:.1f} GB/s read", flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    meta = {"machine": cpu_name(), "cores": len(cores), "threads": threads, "device": device,
            "weights_MB": wbytes / 1e6, "prompt": args.prompt_len, "new_tokens": args.new_tokens,
            "torch": torch.__version__, "python": platform.python_version(),
            "simd": ext.simd_features(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_breakdown_cpu.json").write_text(
        json.dumps({"meta": meta, "rounds": rounds, "median": med}, indent=1))
    md = markdown(meta, rounds, med, argv if argv is not None else sys.argv[1:])
    (args.out / "token_breakdown_cpu.md").write_text(md)
    print(md)


def markdown(meta: dict, rounds: list[dict], med: dict, argv: list[str]) -> str:
    cmd = " ".join(["python bench/token_breakdown.py", *argv])
    lines = [f"# Where a batch-1 decode token goes ({meta['machine']})", "",
             f"SmolLM2-135M float32 in process on {meta['device']} ({meta['threads']} threads), "
             f"1 x {meta['prompt']} -> {meta['new_tokens']}, greedy; {len(rounds)} round(s), "
             f"each: the decode (timeline spans), then the packed linear kernel alone over the "
             f"same weight shapes ({meta['weights_MB']:.0f} MB), then the machine's copy and "
             f"read bandwidth. Kernels: {meta['simd']}.", "", "    " + cmd, "",
             "| round | ms/token | slices | attention | hand-off | engine | linear pass alone | "
             "copy floor | read floor | token / copy floor | linear / copy floor | "
             "slices - linear |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate([*rounds, med]):
        name = "median" if i == len(rounds) else str(i)
        lines.append(
            f"| {name} | {r['wall']:.1f} | {r['slices']:.1f} | {r['attention']:.2f} | "
            f"{r['hand-off']:.2f} | {r['engine']:.2f} | {r['linear']:.1f} | "
            f"{r['copy_floor']:.1f} ({r['copy_GBps']:.1f} GB/s) | "
            f"{r['read_floor']:.1f} ({r['read_GBps']:.1f} GB/s) | "
            f"{r['wall'] / r['copy_floor']:.2f}x | {r['linear'] / r['copy_floor']:.2f}x | "
            f"{r['slices'] - r['linear']:.1f} |")
    lines += ["", "slices: the step's dense slices (linear layers and the small ops between them, "
              "the LM head and sampling); attention: the memory node's kernels; hand-off: the "
              "send and receive spans around them; engine: the rest of the wall time (Python "
              "between steps). `slices - linear` is what the slices spend beyond the linear "
              "kernel's own pass (its calls start cold between the small ops).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
