"""End-to-end decode throughput and per-token latency on CPU (or GPU), against baselines
measured in the same run:

* ``hf``: Hugging Face ``generate`` on the same model (padded batch, greedy, KV cache);
* ``lamina-inproc``: Lamina with memory nodes in this process (``transport="local"``);
* ``lamina-procs``: Lamina with memory nodes as separate processes (``transport="shm"``).

Decode time is isolated by difference: time(prompt + N new tokens) - time(prompt + 1 token),
so throughput = batch * (N - 1) / decode_time and per-token latency = decode_time / (N - 1).
Prompts have mixed lengths (seeded). Writes bench/results/e2e_<device>.{json,md,png}.

    python bench/e2e.py                      # batches 1, 8, 32, 64
    python bench/e2e.py --batches 1 8 --new-tokens 16 --memory 2
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lamina import LLM, SamplingParams
from lamina.bench import hf_generate_time
from lamina.models import load_model

RESULTS = Path(__file__).parent / "results"


def make_prompts(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def lamina_time(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    p = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return dt


def decode_stats(run, prompts, n: int, reps: int) -> dict:
    """Median over ``reps`` of the (N tokens - 1 token) difference."""
    diffs = []
    for _ in range(reps):
        diffs.append(run(prompts, n) - run(prompts, 1))
    d = sorted(diffs)[len(diffs) // 2]
    b = len(prompts)
    return {"decode_s": d, "tok_per_s": b * (n - 1) / d, "ms_per_token": 1e3 * d / (n - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    ap.add_argument("--memory", type=int, default=2, help="memory nodes for both Lamina modes")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device)
    vocab = loaded.model.config.vocab_size
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer else 0
    pad = pad if pad is not None else 0
    kw = dict(device=args.device, max_num_seqs=max(args.batches),
              max_num_batched_tokens=4096)
    systems = {
        "hf": lambda ps, n: hf_generate_time(loaded.model, ps, n, pad),
    }
    inproc = LLM(args.model, memory=args.memory, transport="local", **kw)
    procs = LLM(args.model, memory=args.memory, transport="shm", **kw)
    systems["lamina-inproc"] = lambda ps, n: lamina_time(inproc, ps, n)
    systems["lamina-procs"] = lambda ps, n: lamina_time(procs, ps, n)

    rows = []
    try:
        for name, run in systems.items():  # warm up every system once
            run(make_prompts(2, vocab, 0, 8, 8), 2)
        work = [(b, name) for b in args.batches for name in systems]
        for b, name in tqdm(work, desc="bench e2e"):
            prompts = make_prompts(b, vocab, seed=b, lo=args.prompt_len[0], hi=args.prompt_len[1])
            stats = decode_stats(systems[name], prompts, args.new_tokens, args.reps)
            rows.append({"batch": b, "system": name, **stats})
            tqdm.write(f"batch {b:3d} {name:14s} {stats['tok_per_s']:8.1f} tok/s "
                       f"{stats['ms_per_token']:8.1f} ms/token")
    finally:
        inproc.close()
        procs.close()

    by = {(r["batch"], r["system"]): r for r in rows}
    lines = ["| batch | HF tok/s | Lamina in-process tok/s | Lamina processes tok/s | "
             "in-process / HF | processes / HF | processes / in-process | ms/token (HF / in-proc / procs) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in args.batches:
        h, i, p = by[(b, "hf")], by[(b, "lamina-inproc")], by[(b, "lamina-procs")]
        lines.append(f"| {b} | {h['tok_per_s']:.1f} | {i['tok_per_s']:.1f} | {p['tok_per_s']:.1f} | "
                     f"{i['tok_per_s'] / h['tok_per_s']:.2f}x | {p['tok_per_s'] / h['tok_per_s']:.2f}x | "
                     f"{p['tok_per_s'] / i['tok_per_s']:.2f}x | {h['ms_per_token']:.0f} / "
                     f"{i['ms_per_token']:.0f} / {p['ms_per_token']:.0f} |")
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    meta = {"model": args.model, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
            "memory_nodes": args.memory, "device": args.device, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"e2e_{device}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = (f"# End-to-end decode ({args.model}, {device}, {args.memory} memory nodes, "
          f"{args.new_tokens} new tokens, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"tokens)\n\n" + "\n".join(lines) + "\n")
    (out / f"e2e_{device}.md").write_text(md)
    plot(rows, args.batches, out / f"e2e_{device}.png", meta)
    print(md)


def plot(rows: list[dict], batches: list[int], path: Path, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("hf", "lamina-inproc", "lamina-procs"):
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
