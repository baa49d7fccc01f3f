"""Cluster borrowing on a mixed trace: the same seeded Poisson trace (mostly short requests, a
few very long ones) on the same instances, without and with borrowing, in one run.

    python bench/borrowing.py [--model smollm2] [--instances 2] [--memory 1]
                              [--kv-cache-tokens 192] [--requests 24] [--rate 4] [--scale 0.05]
    python bench/borrowing.py --placement ray    # what `lamina launch --instances` runs

``--placement local`` (default) runs the instances in this process (shared weights, in-process
memory nodes); ``--placement ray`` places every compute replica and memory node in a Ray actor
of its own (:func:`lamina.cluster.start_deployment`), so borrowed KV is attended over shm.

Each instance's pool holds ``memory x kv_cache_tokens`` slots, so a long request can outgrow
any single pool. Prints and saves ``bench/results/borrowing_cpu.{json,md,png}``: cluster
throughput (tokens of completed requests / wall time), completed and failed requests, and the
longest context (prompt + output) served, with the with/without ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from lamina.benchmark.workloads import synthetic_trace
from lamina.config import deployment_config
from lamina.deployment import Deployment, start_deployment
from lamina.deployment.profiling import profile_perf
from lamina.instance import load_model_info
from lamina.types import SamplingParams

RESULTS = Path(__file__).parent / "results"


def run_trace(d: Deployment, trace, desc: str) -> dict:
    """Replay ``trace`` in real time on ``d``; returns the run's numbers."""
    pending = list(trace)
    reqs, rejected = [], 0
    bar = tqdm(total=len(trace), desc=desc, unit="req")
    start = time.perf_counter()
    while pending or d.has_work():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            t = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=t.output_len, ignore_eos=True)
            try:
                reqs.append(d.add_request(list(t.prompt_ids), params))
            except ValueError:
                rejected += 1
                bar.update(1)
        if d.has_work():
            for r in d.step().finished:
                bar.update(1)
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    bar.close()
    ok = [r for r in reqs if r.error is None]
    tokens = sum(len(r.output_ids) for r in ok)
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "completed": len(ok),
            "failed": len(reqs) - len(ok) + rejected,
            "longest_context": max((r.num_tokens for r in ok), default=0),
            "moves": d.moves, "loans": len(d.loans)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--memory", type=int, default=1)
    ap.add_argument("--kv-cache-tokens", type=int, default=192)
    ap.add_argument("--slab-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--plan-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--placement", choices=["inproc", "procs", "ray"], default="inproc")
    ap.add_argument("--out", help="output stem (default: bench/results/borrowing_cpu, "
                                  "borrowing_ray_cpu with --placement ray)")
    args = ap.parse_args(argv)
    args.out = args.out or str(RESULTS / ("borrowing_cpu" if args.placement == "inproc"
                                          else f"borrowing_{args.placement}_cpu"))

    info = load_model_info(_config(args, True))
    vocab = info.vocab_size
    trace = synthetic_trace("mixed", args.requests, args.rate, vocab, seed=args.seed,
                            scale=args.scale)
    pool = args.memory * args.kv_cache_tokens
    longs = [t.prompt_len + t.output_len for t in trace if t.kind == "long"]
    print(f"trace: {len(trace)} requests, {len(longs)} long (contexts {longs}), pool "
          f"{pool} slots per instance, {args.instances} instances", file=sys.stderr)
    perf = profile_perf(info.split)
    runs = {}
    for borrowing in (False, True):
        with start_deployment(_config(args, borrowing), info, perf=perf) as d:
            runs["with" if borrowing else "without"] = run_trace(
                d, trace, "borrowing" if borrowing else "no borrowing")
    cmd = "python bench/borrowing.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": cmd.strip(), "args": vars(args), "pool_slots": pool,
              "long_contexts": longs, "runs": runs,
              "ratio_tok_s": runs["with"]["tok_s"] / runs["without"]["tok_s"],
              "perf": perf.__dict__}
    _save(result, Path(args.out))
    return result


def _config(args: argparse.Namespace, borrowing: bool):
    return deployment_config(args.model, instances=args.instances, memory=args.memory,
                             placement=args.placement, kv_cache_tokens=args.kv_cache_tokens,
                             slab_size=args.slab_size, borrowing=borrowing,
                             plan_every=args.plan_every)


def _save(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    r, a = result["runs"], result["args"]
    lines = [f"# Cluster borrowing on a mixed trace ({a['model']}, {a['instances']} instances, "
             f"{result['pool_slots']} KV slots each, placement {a.get('placement', 'inproc')})", "", f"`{result['command']}`", "",
             f"{a['requests']} requests, Poisson {a['rate']}/s; long requests' contexts: "
             f"{result['long_contexts']}", "",
             "| borrowing | tok/s | completed | failed | longest context served | KV moves | loans |",
             "|---|---|---|---|---|---|---|"]
    for name in ("without", "with"):
        x = r[name]
        lines.append(f"| {name} | {x['tok_s']:.1f} | {x['completed']} | {x['failed']} | "
                     f"{x['longest_context']} | {x['moves']} | {x['loans']} |")
    lines += ["", f"throughput with / without: {result['ratio_tok_s']:.2f}x "
              f"(tokens of completed requests per second of the whole run)"]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    names = ["without", "with"]
    for ax, key, label in zip(axes, ("tok_s", "longest_context"),
                              ("throughput (tok/s)", "longest context served (tokens)")):
        ax.bar(names, [r[n][key] for n in names], color=["#999", "#1f77b4"])
        ax.set_title(label, fontsize=9)
    axes[1].axhline(result["pool_slots"], ls="--", c="k", lw=0.8, label="one pool")
    axes[1].legend(fontsize=8)
    fig.suptitle("cluster borrowing", fontsize=10)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
