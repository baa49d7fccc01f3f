"""Discrete-event simulator of staggered pipelining (none, fixed, rotational) for any n, N and
number of memory nodes: predicted throughput, per-token latency and device utilisation.

Stage times come either from measurements (``--slice-ms``, ``--attn-ms``, ...: e.g. read off a
``--trace`` timeline, as bench/pipeline.py does) or from the analytical model
(``--model/--compute-device/--memory-device/--batch/--context``:
:func:`lamina.costmodel.model.layer_times`, for hardware we do not have). ``--fig12`` sweeps batch
sizes for Lamina Fig. 12's comparison.

    python bench/pipeline_sim.py --slice-ms 2 --attn-ms 3 --send-ms 0.2 --recv-ms 0.2 \\
        --layers 30 --tokens 16 --memory-nodes 2 -N 1 -n 2
    python bench/pipeline_sim.py --model llama-13b --compute-device H100 \\
        --memory-device Arc-A770 --memory-nodes 4 --batch 256 --context 4096 -N 2
    python bench/pipeline_sim.py --fig12       # writes bench/results/pipeline_fig12.{json,md,png}
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lamina.costmodel.model import PRESETS, layer_times
from lamina.costmodel.hardware import load_catalog
from lamina.costmodel.simulator import SCHEDULES, SimConfig, SimResult, StageTimes, simulate

RESULTS = Path(__file__).parent / "results"


def analytical_times(model_name: str, compute: str, memory: str, micro_batch: float,
                     context: float) -> tuple[StageTimes, int]:
    """Stage times of one micro-batch of ``micro_batch`` requests from the cost model, and the
    model's layer count. Transfers use the compute device's NIC, half each way."""
    cat = load_catalog()
    model, cdev, mdev = PRESETS[model_name], cat[compute], cat[memory]
    t_m, t_a = layer_times(model, cdev, mdev, micro_batch, context)
    xfer = micro_batch * model.transfer_bytes_per_token / model.layers / cdev.nic_bw
    return StageTimes(slice_s=t_m, attn_s=t_a, send_s=xfer / 2, recv_s=xfer / 2,
                      tokens=max(int(micro_batch), 1)), model.layers


def default_micro_batches(schedule: str, replicas: int) -> int:
    return {"none": 1, "fixed": replicas}.get(schedule, replicas + 1)


def balanced_pool(model_name: str, compute: str, memory: str, batch: float,
                  context: float) -> int:
    """Memory devices whose attention keeps pace with one replica's slices (t_a/M ~ t_m) for
    micro-batches of ``batch / 2``: how Lamina sizes the pool for its largest batch."""
    t, _ = analytical_times(model_name, compute, memory, batch / 2, context)
    return max(1, math.ceil(t.attn_s / t.slice_s))


def fig12(model_name: str = "llama-13b", compute: str = "H100", memory: str = "Arc-A770",
          memory_nodes: int | None = None, context: int = 4096,
          batches: tuple[int, ...] = (8, 32, 128, 256, 512, 1024)) -> list[dict]:
    """Per batch size B: rotational against its baseline with the same replicas, B requests
    split evenly over the micro-batches. ``N1``: rotational n=2 vs none on one replica; ``N2``:
    rotational n=3 vs fixed n=2 on two. The pool defaults to :func:`balanced_pool` at the
    largest batch (fixed across the sweep)."""
    if memory_nodes is None:
        memory_nodes = balanced_pool(model_name, compute, memory, max(batches), context)
    rows = []
    for B in batches:
        row: dict = {"batch": B, "memory_nodes": memory_nodes}
        for label, (base, nb, N, rot_n) in {"N1": ("none", 1, 1, 2),
                                           "N2": ("fixed", 2, 2, 3)}.items():
            res = {}
            for sched, n in ((base, nb), ("rotational", rot_n)):
                times, layers = analytical_times(model_name, compute, memory, B / n, context)
                res[sched] = simulate(SimConfig(sched, n, N, memory_nodes, layers, times, 20))
            row[f"{label}_throughput_gain"] = res["rotational"].throughput / res[base].throughput
            row[f"{label}_latency_ratio"] = (res["rotational"].token_latency_s
                                             / res[base].token_latency_s)
        t, _ = analytical_times(model_name, compute, memory, B / 2, context)
        row["t_a/t_m"] = t.attn_s / memory_nodes / t.slice_s
        rows.append(row)
    return rows


def fig12_markdown(rows: list[dict], title: str) -> list[str]:
    md = [f"## {title}\n",
          "| batch | t_a/t_m (B/2) | N=1: rotational/none tok/s | latency | "
          "N=2: rotational/fixed tok/s | latency |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['batch']} | {r['t_a/t_m']:.2f} | {r['N1_throughput_gain']:.2f}x | "
                  f"{r['N1_latency_ratio']:.2f}x | {r['N2_throughput_gain']:.2f}x | "
                  f"{r['N2_latency_ratio']:.2f}x |")
    return md


def plot_fig12(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["batch"] for r in rows]
    for key, label in (("N1", "N=1: rotational n=2 / none"),
                       ("N2", "N=2: rotational n=3 / fixed n=2")):
        a.plot(xs, [r[f"{key}_throughput_gain"] for r in rows], marker="o", label=label)
        b.plot(xs, [r[f"{key}_latency_ratio"] for r in rows], marker="o", label=label)
    for ax, name in ((a, "throughput gain"), (b, "per-token latency ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(r: SimResult) -> str:
    c = r.config
    return (f"{c.schedule:<10} n={c.micro_batches} N={c.replicas} M={c.memory_nodes} "
            f"parts={c.attn_parts}: {r.throughput:10.1f} tok/s, token latency "
            f"{r.token_latency_s * 1e3:8.2f} ms, compute util {r.compute_util:4.0%}, "
            f"memory util {r.memory_util:4.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", choices=SCHEDULES, default=None,
                    help="one schedule (default: all three)")
    ap.add_argument("-n", "--micro-batches", type=int, default=None,
                    help="default: 1 for none, N for fixed, N+1 for rotational")
    ap.add_argument("-N", "--replicas", type=int, default=1)
    ap.add_argument("--memory-nodes", type=int, default=1)
    ap.add_argument("--attn-parts", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=20)
    m = ap.add_argument_group("measured stage times (one micro-batch)")
    m.add_argument("--slice-ms", type=float)
    m.add_argument("--attn-ms", type=float, help="one layer on ONE memory node")
    m.add_argument("--send-ms", type=float, default=0.0)
    m.add_argument("--recv-ms", type=float, default=0.0)
    m.add_argument("--context-ms", type=float, default=0.0)
    m.add_argument("--head-ms", type=float, default=0.0)
    m.add_argument("--layers", type=int)
    m.add_argument("--tokens", type=int, default=1, help="tokens one iteration produces")
    h = ap.add_argument_group("analytical stage times (lamina.costmodel.model)")
    h.add_argument("--model", help=f"one of {', '.join(PRESETS)}")
    h.add_argument("--compute-device", default="H100")
    h.add_argument("--memory-device", default="Arc-A770")
    h.add_argument("--batch", type=int, default=256, help="requests over all micro-batches")
    h.add_argument("--context", type=int, default=4096)
    ap.add_argument("--fig12", action="store_true",
                    help="Lamina Fig. 12 sweep (LLaMA-13B, H100 + Arc-A770 pool balanced at "
                         "batch 1024, ctx 4096)")
    args = ap.parse_args()
    if args.fig12:
        rows = fig12()
        title = (f"Simulated rotational pipelining: LLaMA-13B, H100 + "
                 f"{rows[0]['memory_nodes']} x Arc-A770, ctx 4096")
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "pipeline_fig12.json").write_text(json.dumps(rows, indent=1))
        md = fig12_markdown(rows, title)
        (RESULTS / "pipeline_fig12.md").write_text("\n".join(md) + "\n")
        plot_fig12(rows, RESULTS / "pipeline_fig12.png", title)
        print("\n".join(md))
        return
    if args.model is None and (args.slice_ms is None or args.attn_ms is None
                               or args.layers is None):
        ap.error("give --slice-ms, --attn-ms and --layers (measured), or --model (analytical)")
    for sched in [args.schedule] if args.schedule else SCHEDULES:
        if sched == "none" and args.replicas > 1:
            continue
        n = args.micro_batches if args.micro_batches and sched != "none" \
            else default_micro_batches(sched, args.replicas)
        if args.model is not None:
            times, layers = analytical_times(args.model, args.compute_device,
                                             args.memory_device, args.batch / n, args.context)
        else:
            times = StageTimes(args.slice_ms / 1e3, args.attn_ms / 1e3, args.send_ms / 1e3,
                               args.recv_ms / 1e3, args.context_ms / 1e3, args.head_ms / 1e3,
                               args.tokens)
            layers = args.layers
        cfg = SimConfig(sched, n, args.replicas, args.memory_nodes, layers, times,
                        args.iterations, args.attn_parts)
        print(describe(simulate(cfg)))


if __name__ == "__main__":
    main()
