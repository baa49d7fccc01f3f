"""Staggered pipelining: measured on this machine and predicted by the simulator, side by side;
then Lamina Fig. 12's shape from the simulator on analytical H100 + memory-device times.

1. Calibrate: run ``none`` with one micro-batch's worth of requests (B/n) and read the stage
   times off its timeline (medians): a slice (+ its send and merge work on the replica), the
   LM-head extra, one layer's attention per node, the send and receive latencies.
2. Measure each configuration with B requests (SmolLM2, memory nodes as processes over shm):
   throughput and busy fractions of the replica and the memory nodes, from its timeline.
3. Predict the same configuration with :func:`lamina.costmodel.simulator.simulate` from step 1's times,
   and report the relative error.
4. Fig. 12 (bench/pipeline_sim.py): for batch sizes 8..1024, ``none`` (n=1) against
   ``rotational`` (n=2) on one H100, and ``fixed`` (n=2) against ``rotational`` (n=3) on two,
   with t_m and t_a from :func:`lamina.costmodel.model.layer_times`.

Configurations measured: none; rotational n=2; rotational n=2 with each node's share of a layer
sent as 2 mini-batches (communication-attention overlap), all on one replica in the engine's
process (two micro-batches alternate on it, as in Lamina with N = 1); and rotational n=3 on
N=2 compute replicas, each in its own process (nodes reply to the next replica, contexts move
between the processes). On this CPU all processes share the same cores.

    python bench/pipeline.py                         # B = 16, 32 new tokens, 2 memory nodes
    python bench/pipeline.py --batch 8 --new-tokens 16

Writes bench/results/pipeline_cpu.{json,md}, pipeline_fig12.png and the rotational runs'
timelines (timeline_rotational*.json, rendered by bench/plot_timeline.py to .png).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from lamina import LLM, SamplingParams
from lamina.models import load_model
from lamina.costmodel.simulator import SimConfig, StageTimes, simulate
from lamina.timeline import Timeline
from pipeline_sim import RESULTS, fig12, fig12_markdown, plot_fig12


def stage_times(tl: Timeline, memory: int, tokens: int) -> StageTimes:
    """Medians over a run's timeline (see the module docstring). A node's mini-batches of one
    layer count as one attention (their durations summed) that started with the first part."""
    comp = [s for s in tl.spans if s.role == "compute"]
    med = lambda xs: statistics.median(xs) / 1e9 if xs else 0.0  # noqa: E731
    dur = lambda name: [s.end_ns - s.start_ns for s in comp if s.name == name]  # noqa: E731
    slices = [s.end_ns - s.start_ns for s in comp
              if s.name.startswith("slice") and "sample" not in s.name]
    last = [s.end_ns - s.start_ns for s in comp if "sample" in s.name]
    groups: dict[tuple, list] = {}
    for s in tl.spans:
        if s.role == "memory":
            groups.setdefault((s.track, s.args["step"], s.name.split(".")[0]), []).append(s)
    attn = [sum(s.end_ns - s.start_ns for s in g) for g in groups.values()]
    work = med(slices) + med(dur("send")) + med(dur("recv"))  # the replica's share per layer
    # sent_ns marks the end of the replica's send span (part of ``work``); a node may start
    # before the last node's message is out, which counts as no latency
    return StageTimes(
        slice_s=work, head_s=max(med(last) - med(slices), 0.0), attn_s=med(attn) * memory,
        send_s=max(med([min(s.start_ns for s in g) - g[0].args["sent_ns"]
                        for g in groups.values()]), 0.0),
        recv_s=max(med([g[0].args["received_ns"] - max(s.end_ns for s in g)
                        for g in groups.values()]), 0.0), tokens=tokens)


def busy(tl: Timeline, memory: int, replicas: int = 1) -> tuple[float, float]:
    """(mean replica busy fraction in slices/send/recv, mean memory-node busy fraction)."""
    work = ("slice", "send", "recv")
    comp = sum(tl.busy_fraction("compute", r, work) for r in range(replicas)) / replicas
    mem = sum(tl.busy_fraction("memory", m) for m in range(memory)) / memory
    return comp, mem


def measure(model: str, pipeline: str, n: int, prompts: list[list[int]], new_tokens: int,
            memory: int, trace: Path | None = None, attn_parts: int = 1,
            replicas: int = 1) -> dict:
    """Generate for ``prompts`` (after a short warm-up) with a timeline; ``trace`` keeps it.
    Every compute replica and memory node runs in a process of its own (``placement="procs"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or Path(tmp) / "timeline.json"
        with LLM(model, memory=memory, placement="procs", compute=replicas, micro_batches=n,
                 pipeline=pipeline, attn_parts=attn_parts, trace=str(path)) as llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            tl = llm.timeline
            tl.spans.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                        ignore_eos=True), use_tqdm=False)
            wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    comp, mem = busy(tl, memory, replicas)
    return {"pipeline": pipeline, "micro_batches": n, "attn_parts": attn_parts,
            "replicas": replicas, "batch": len(prompts),
            "throughput": tokens / wall, "wall_s": wall, "compute_util": comp,
            "memory_util": mem, "timeline": tl, "outputs": [o.outputs[0].token_ids for o in outs]}


def predict(times: StageTimes, pipeline: str, n: int, layers: int, memory: int,
            iterations: int, attn_parts: int = 1, replicas: int = 1) -> dict:
    r = simulate(SimConfig(pipeline, n, replicas, memory, layers, times, iterations, attn_parts))
    return {"throughput": r.throughput, "compute_util": r.compute_util,
            "memory_util": r.memory_util, "token_latency_s": r.token_latency_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--memory", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 16))]
               for _ in range(args.batch)]
    layers = load_model(args.model).model.config.num_hidden_layers
    measured, predicted, own, calib = [], [], [], {}
    # (pipeline, micro-batches, attention parts, compute replicas: > 1 in processes)
    configs = [("none", 1, 1, 1), ("rotational", 2, 1, 1), ("rotational", 2, 2, 1),
               ("rotational", 3, 1, 2)]
    for pipeline, n, parts, N in tqdm(configs, desc="pipeline runs", unit="config"):
        sub = prompts[:args.batch // n]
        if n not in calib:  # a `none` run on one micro-batch's worth of requests
            cal = measure(args.model, "none", 1, sub, args.new_tokens, args.memory)
            calib[n] = stage_times(cal["timeline"], args.memory, len(sub))
        name = "timeline_rotational" + ("" if parts == 1 else f"_parts{parts}") + \
            ("" if N == 1 else f"_procs{N}")
        trace = RESULTS / f"{name}.json" if pipeline == "rotational" else None
        m = measure(args.model, pipeline, n, prompts, args.new_tokens, args.memory, trace, parts,
                    N)
        measured.append(m)
        predicted.append(predict(calib[n], pipeline, n, layers, args.memory, args.new_tokens,
                                 parts, N))
        # the same run's own stage times: checks the schedule model apart from contention
        # (replica processes do not record send/receive latencies: no such check for them)
        own.append(predict(stage_times(m["timeline"], args.memory, len(sub)), pipeline, n,
                           layers, args.memory, args.new_tokens, parts) if N == 1 else None)
    assert all(m["outputs"] == measured[0]["outputs"] for m in measured), \
        "pipelining changed greedy outputs"
    f12 = fig12()
    rows = []
    for m, p, o in zip(measured, predicted, own):
        rows.append({k: m[k] for k in ("pipeline", "micro_batches", "attn_parts", "replicas",
                                       "batch", "throughput", "compute_util", "memory_util")}
                    | {f"sim_{k}": p[k] for k in ("throughput", "compute_util", "memory_util")}
                    | {"throughput_rel_err": p["throughput"] / m["throughput"] - 1,
                       "sim_own_throughput": o["throughput"] if o else None,
                       "sim_own_rel_err": o["throughput"] / m["throughput"] - 1 if o else None})
    out = {"command": "python bench/pipeline.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "measured_vs_simulated": rows,
        "calibration": {f"none-b{args.batch // n}": t.__dict__ for n, t in calib.items()},
        "fig12": f12,
        "rotational_speedup_measured": measured[1]["throughput"] / measured[0]["throughput"],
        "rotational_parts2_speedup_measured": measured[2]["throughput"] / measured[0]["throughput"],
        "rotational_procs2_speedup_measured": measured[3]["throughput"] / measured[0]["throughput"]}
    (RESULTS / "pipeline_cpu.json").write_text(json.dumps(out, indent=1))
    md = [f"# Staggered pipelining\n\n`{out['command']}`\n",
          "## Measured vs simulated (SmolLM2, memory nodes over shm)\n",
          "Every replica and memory node runs in a process of its own (`placement=\"procs\"`); "
          "with N = 2, on this 2-core machine the replicas share the cores "
          "with the node processes, which the simulator (one device per replica) does not "
          "model. Sim: stage times from a `none` run with one micro-batch's requests (a "
          "prediction). Sim (own): from the measured run's own timeline (checks the schedule "
          "model alone; N = 1 only).\n",
          "| pipeline | N | n | attn parts | batch | tok/s | sim tok/s | rel err | sim (own) tok/s | "
          "rel err | compute util | sim | memory util | sim |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own_cells = (f"{r['sim_own_throughput']:.1f} | {r['sim_own_rel_err']:+.0%}"
                     if r["sim_own_throughput"] is not None else "- | -")
        md.append(f"| {r['pipeline']} | {r['replicas']} | {r['micro_batches']} | "
                  f"{r['attn_parts']} | {r['batch']} | "
                  f"{r['throughput']:.1f} | {r['sim_throughput']:.1f} | "
                  f"{r['throughput_rel_err']:+.0%} | {own_cells} | {r['compute_util']:.0%} | "
                  f"{r['sim_compute_util']:.0%} | {r['memory_util']:.0%} | "
                  f"{r['sim_memory_util']:.0%} |")
    md.append(f"\nmeasured speed-up over none: rotational n=2 "
              f"{out['rotational_speedup_measured']:.2f}x, with 2 attention mini-batches "
              f"{out['rotational_parts2_speedup_measured']:.2f}x, N=2 replica processes n=3 "
              f"{out['rotational_procs2_speedup_measured']:.2f}x\n")
    title = (f"Simulator: Lamina Fig. 12 (LLaMA-13B, H100 + {f12[0]['memory_nodes']} x "
             f"Arc-A770, context 4096)")
    md += fig12_markdown(f12, title)
    (RESULTS / "pipeline_cpu.md").write_text("\n".join(md) + "\n")
    plot_fig12(f12, RESULTS / "pipeline_fig12.png", title)
    print("\n".join(md))


if __name__ == "__main__":
    main()
