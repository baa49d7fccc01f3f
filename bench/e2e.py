"""End-to-end decode throughput and per-token latency on CPU (or GPU), against baselines
measured in the same run:

* ``hf``: Hugging Face on the same model (left-padded batch, greedy, ``DynamicCache``; per step
  what ``generate`` does: one forward over the last tokens, argmax);
* ``lamina-inproc``: Lamina with every role in this process (``placement="inproc"``);
* ``lamina-procs``: Lamina with the compute replica and each memory node a process of its own
  (``placement="procs"``);
* ``lamina-graphs`` (``--cuda-graphs``, CUDA only): the in-process setup with the dense slices
  replayed as CUDA graphs; its ``vs_lamina-inproc`` is the CUDA-graph gain;
* ``lamina-procs-graphs`` (``--cuda-graphs`` too): the processes setup with graphs; its
  ``vs_lamina-graphs`` is processes / in process, both with graphs (issue 41's GPU row);
* ``lamina-polling`` (``--device-polling``, CUDA + cupy): the processes setup with each next
  slice pre-launched behind a device flag; its ``vs_lamina-procs`` is that gain;
* ``lamina-steps`` (``--cuda-graphs --device-polling``): in process, each decode step one CUDA
  graph of every slice with its sends and waits over the step mailbox (memory nodes off the
  GPU: ``--memory-device cpu``); its ``vs_lamina-graphs`` is the gain over per-slice graphs;
* ``lamina-procs-steps`` (the same options): the same with each memory node a process of its
  own serving the replica process's mailbox; its ``vs_hf`` at batch 32 is issue 41's row
  "graphs + polling, memory node in a process, vs HF".

On a CPU ``--device-polling`` runs the CPU stand-in (``device_polling="emulated"``): a smoke
run of those paths, not a measure of them.

Each system prefills the same mixed-length prompts (seeded) once; then single decode steps of
the systems are *interleaved* (round r times one step of each system, in an order that rotates
every round), so that this noisy machine's slow and fast moments hit every system alike.
Per-token latency is a system's median step time, throughput is ``batch / median``, and each
ratio is the median over rounds of the per-round ratio (steps taken seconds apart).
Writes bench/results/e2e_<device>.{json,md,png}.

    python bench/e2e.py                      # batches 1, 8, 32, 64
    python bench/e2e.py --batches 32 --steps 20 --memory 2
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from lamina import LLM  # before torch: lamina sets the OpenMP wait policy (lamina/__init__.py)
from lamina.benchmark.steps import HFStepper, LaminaStepper
from lamina.models import load_model

import torch
from tqdm import tqdm

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("hf", "lamina-inproc", "lamina-procs")
OPTIONAL = ("lamina-graphs", "lamina-procs-graphs", "lamina-polling", "lamina-steps",
            "lamina-procs-steps")  # a failure is reported


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def make_prompts(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def interleaved_steps(steppers: dict, rounds: int, warmup: int,
                      failed: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Seconds of each system's decode steps, ``rounds`` rounds of one step each (after
    ``warmup`` untimed rounds); the order of the systems rotates every round. A system in
    :data:`OPTIONAL` whose step raises is dropped and its error kept in ``failed``."""
    names = list(steppers)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in tqdm(range(warmup + rounds), desc="rounds", leave=False):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = time.perf_counter()
            try:
                steppers[n].step()
            except Exception as e:
                if failed is None or n not in OPTIONAL:
                    raise
                failed[n] = _why(e)
                names.remove(n)
                times.pop(n)
                continue
            if r >= warmup:
                times[n].append(time.perf_counter() - t)
    return times


def stats(times: dict[str, list[float]], batch: int) -> list[dict]:
    rows = []
    for n, ts in times.items():
        med = statistics.median(ts)
        row = {"batch": batch, "system": n, "ms_per_token": 1e3 * med, "tok_per_s": batch / med,
               "step_ms": [round(1e3 * t, 2) for t in ts]}
        for base in ("hf", "lamina-inproc", "lamina-procs", "lamina-graphs", "lamina-steps"):  # paired
            if base != n and base in times:
                row[f"vs_{base}"] = statistics.median(b / t for t, b in zip(ts, times[base]))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per system")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps per system")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    ap.add_argument("--memory", type=int, default=2, help="memory nodes for both Lamina modes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory-device", default=None,
                    help="memory nodes' device (default: --device); e.g. --device cuda:0 "
                         "--memory-device cpu is NEO's layout: dense on the GPU, KV and attention on CPU")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also run lamina in-process with CUDA graphs (--device cuda:N)")
    ap.add_argument("--device-polling", action="store_true",
                    help="also run lamina in processes with device-side polling (--device cuda:N)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device)
    vocab = loaded.model.config.vocab_size
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer else 0
    pad = pad if pad is not None else 0
    # every prompt of a batch prefills in one step, so all requests decode in lockstep
    kw = dict(device=args.device, memory_device=args.memory_device, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(args.batches) * args.prompt_len[1])
    llms = {"lamina-inproc": LLM(args.model, memory=args.memory, placement="inproc", **kw),
            "lamina-procs": LLM(args.model, memory=args.memory, placement="procs", **kw)}
    failed: dict[str, str] = {}  # optional system -> why it was dropped
    polling = "cuda" if args.device.startswith("cuda") else "emulated"
    steps = args.cuda_graphs and args.device_polling
    options = {"lamina-graphs": (args.cuda_graphs, dict(placement="inproc", cuda_graphs=True)),
               "lamina-procs-graphs": (args.cuda_graphs, dict(placement="procs", cuda_graphs=True)),
               "lamina-polling": (args.device_polling, dict(placement="procs", device_polling=polling)),
               "lamina-steps": (steps, dict(placement="inproc", cuda_graphs=True,
                                            device_polling=polling)),
               "lamina-procs-steps": (steps, dict(placement="procs", cuda_graphs=True,
                                                  device_polling=polling))}
    for name, (on, extra_kw) in options.items():
        if on:
            try:
                llms[name] = LLM(args.model, memory=args.memory, **extra_kw, **kw)
            except Exception as e:
                failed[name] = _why(e)
    rows = []
    try:
        for b in tqdm(args.batches, desc="bench e2e"):
            prompts = make_prompts(b, vocab, seed=b, lo=args.prompt_len[0], hi=args.prompt_len[1])
            n = args.warmup + args.steps
            steppers = {"hf": HFStepper(loaded.model, prompts, pad)}
            for k, llm in list(llms.items()):
                try:
                    steppers[k] = LaminaStepper(llm, prompts, n)
                except Exception as e:
                    if k not in OPTIONAL:
                        raise
                    failed[k] = _why(e)
                    llms.pop(k).close()
            got = stats(interleaved_steps(steppers, args.steps, args.warmup, failed), b)
            for k in set(failed) & set(llms):
                llms.pop(k).close()
            rows += got
            for r in got:
                tqdm.write(f"batch {b:3d} {r['system']:14s} {r['tok_per_s']:8.1f} tok/s "
                           f"{r['ms_per_token']:8.1f} ms/token")
    finally:
        for llm in llms.values():
            llm.close()

    by = {(r["batch"], r["system"]): r for r in rows}
    extra = [(name, base, title) for name, base, title in (
        ("lamina-graphs", "lamina-inproc", "graphs / in-process"),
        ("lamina-procs-graphs", "lamina-graphs", "procs / in-process, both with graphs"),
        ("lamina-polling", "lamina-procs", "polling / processes"),
        ("lamina-steps", "lamina-graphs", "whole-step graphs / slice graphs"),
        ("lamina-steps", "hf", "whole-step graphs / HF"),
        ("lamina-procs-steps", "lamina-steps", "whole-step graphs, node processes / in process"),
        ("lamina-procs-steps", "hf", "whole-step graphs, node processes / HF"))
        if all((b, name) in by and (b, base) in by for b in args.batches)]
    lines = ["| batch | HF tok/s | Lamina in-process tok/s | Lamina processes tok/s | "
             "in-process / HF | processes / HF | processes / in-process | "
             "ms/token (HF / in-proc / procs) |" + "".join(f" {t} |" for _, _, t in extra),
             "|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(extra)]
    for b in args.batches:
        h, i, p = (by[(b, s)] for s in SYSTEMS)
        lines.append(f"| {b} | {h['tok_per_s']:.1f} | {i['tok_per_s']:.1f} | {p['tok_per_s']:.1f} | "
                     f"{i['vs_hf']:.2f}x | {p['vs_hf']:.2f}x | {p['vs_lamina-inproc']:.2f}x | "
                     f"{h['ms_per_token']:.0f} / {i['ms_per_token']:.0f} / "
                     f"{p['ms_per_token']:.0f} |"
                     + "".join(f" {by[(b, n)][f'vs_{base}']:.2f}x |" for n, base, _ in extra))
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    meta = {"model": args.model, "steps": args.steps, "warmup": args.warmup,
            "prompt_len": args.prompt_len, "memory_nodes": args.memory, "device": args.device,
            "memory_device": args.memory_device or args.device, "cuda_graphs": args.cuda_graphs,
            "device_polling": args.device_polling, "failed": failed,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"e2e_{device}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = (f"# End-to-end decode ({args.model}, {device}, {args.memory} memory nodes, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, {args.steps} interleaved steps)"
          f"\n\nRatios: median over rounds of the per-round ratio of step times.\n\n"
          + "\n".join(lines) + "\n"
          + "".join(f"\n{k} failed and was dropped: {why}\n" for k, why in failed.items()))
    (out / f"e2e_{device}.md").write_text(md)
    plot(rows, args.batches, out / f"e2e_{device}.png", meta)
    print(md)


def plot(rows: list[dict], batches: list[int], path: Path, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in SYSTEMS:
        ys = [next(r["tok_per_s"] for r in rows if r["batch"] == b and r["system"] == name)
              for b in batches]
        ax.plot(batches, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{meta['model']} on {meta['device']}: decode throughput")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
