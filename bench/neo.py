"""NEO's layout where it pays: a workload whose KV does not fit the compute device's pool.

Two setups serve the same requests, each in this run, rounds interleaved:

* ``alone``: the compute device alone, ``LLM(model, device=D, memory=1, memory_device=D,
  kv_cache_tokens=--alone-kv-tokens)``: a pool too small for the whole batch, so the scheduler
  admits what fits and preempts (recompute) as contexts grow, as a user of a GPU whose memory
  the weights fill gets;
* ``offload``: NEO's layout, ``LLM(model, device=D, memory=--memory, memory_device=M,
  kv_cache_gb=--offload-kv-gb, placement=--placement, micro_batches=--micro-batches)``: dense
  slices on ``D``, KV and attention on ``M`` (the host's cores by default), every request
  admitted at once.

Workload: ``--requests`` prompts of ``--prompt-len`` random token ids (seeded), ``--new-tokens``
each, greedy with ``ignore_eos`` (so every request generates the same number of tokens, whatever
the weights). Measure per setup and round: the wall time of one ``LLM.generate`` over all of
them, as generated tokens / second (prefill, decode, preemption and recompute included), and
preemptions. The ratio is the median over rounds of offload / alone; greedy agreement is the
fraction of tokens equal between the two setups (a float model on two devices' kernels may
drift after a near tie; bfloat16 more so).

    python bench/neo.py                                   # cuda:0 + host cores, smollm2
    python bench/neo.py --model lamina.models:smollm2_shaped --cuda-graphs
    python bench/neo.py --device cpu:0 --memory-device cpu:1 --quick   # the mechanics on a CPU

Writes bench/results/neo_<device>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from lamina import LLM, SamplingParams  # before torch: lamina sets the OpenMP wait policy

import torch

RESULTS = Path(__file__).parent / "results"
SETUPS = ("alone", "offload")


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_once(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """One ``generate`` over every prompt: wall seconds, tokens, preemptions, the token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(t) for t in ids)
    preempted = sum(o.num_preemptions for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "preemptions": preempted, "ids": ids}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda:0", help="compute device of both setups")
    ap.add_argument("--memory-device", default="cpu", help="the offload setup's memory nodes")
    ap.add_argument("--memory", type=int, default=2, help="memory nodes of the offload setup")
    ap.add_argument("--placement", default="procs", help="the offload setup's placement")
    ap.add_argument("--micro-batches", type=int, default=2, help="the offload setup's micro-batches")
    ap.add_argument("--dtype", default=None, help="weights, activations and KV (default: the model's)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=448)
    ap.add_argument("--alone-kv-tokens", type=int, default=None,
                    help="the alone setup's pool (default: a quarter of the workload's KV tokens)")
    ap.add_argument("--offload-kv-gb", type=float, default=4.0, help="per memory node")
    ap.add_argument("--cuda-graphs", action="store_true", help="both setups replay slices as graphs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 requests x 16 -> 24 tokens, one round")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens, args.rounds = 8, 16, 24, 1

    need = args.requests * (args.prompt_len + args.new_tokens)  # KV tokens, all at once
    alone_kv = args.alone_kv_tokens or max(args.prompt_len + args.new_tokens, need // 4)
    common = dict(device=args.device, max_num_seqs=args.requests,
                  max_num_batched_tokens=max(2048, args.prompt_len * 8))
    if args.dtype:
        common["dtype"] = args.dtype
    if args.cuda_graphs:
        common["cuda_graphs"] = True
    settings = {
        "alone": dict(memory=1, memory_device=args.device, kv_cache_tokens=alone_kv,
                      placement="inproc", **common),
        "offload": dict(memory=args.memory, memory_device=args.memory_device,
                        kv_cache_gb=args.offload_kv_gb, placement=args.placement,
                        micro_batches=args.micro_batches, **common)}
    llms: dict[str, LLM] = {}
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    started: dict[str, float] = {}
    try:
        for s in SETUPS[::-1]:  # offload first: an in-process setup pins this process's cores
            t0 = time.perf_counter()
            llms[s] = LLM(args.model, **settings[s])
            started[s] = time.perf_counter() - t0
        vocab = llms["alone"].deployment.instances[0].engine.vocab_size or 30000
        prompts = make_prompts(args.requests, args.prompt_len, min(vocab, 30000))
        for s in SETUPS:  # warm-up: graphs, kernels, first-call costs
            run_once(llms[s], prompts[:2], 4)
        for r in range(args.rounds):
            order = SETUPS if r % 2 == 0 else SETUPS[::-1]
            for s in order:
                got = run_once(llms[s], prompts, args.new_tokens)
                runs[s].append(got)
                print(f"round {r} {s:8s} {got['tok_per_s']:9.1f} tok/s  {got['wall_s']:7.2f} s  "
                      f"preemptions {got['preemptions']}", flush=True)
    finally:
        for llm in llms.values():
            llm.close()

    ratios = [o["tok_per_s"] / a["tok_per_s"] for a, o in zip(runs["alone"], runs["offload"])]
    agree = agreement(runs["alone"][0]["ids"], runs["offload"][0]["ids"])
    rows = [{"setup": s, "tok_per_s": statistics.median(x["tok_per_s"] for x in runs[s]),
             "wall_s": [round(x["wall_s"], 3) for x in runs[s]],
             "preemptions": [x["preemptions"] for x in runs[s]], "start_s": round(started[s], 1)}
            for s in SETUPS]
    meta = {**{k: v for k, v in vars(args).items() if k != "out"}, "alone_kv_tokens": alone_kv,
            "kv_tokens_needed": need, "fits_alone": alone_kv / need,
            "torch": torch.__version__, "machine": platform.machine(),
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else
            platform.processor()}
    summary = {"offload_vs_alone": statistics.median(ratios), "ratios": ratios,
               "greedy_agreement": agree}
    lines = [f"# NEO's layout where KV does not fit ({args.model}, {args.device} + memory on "
             f"{args.memory_device})", "",
             f"{args.requests} requests x {args.prompt_len} prompt tokens -> {args.new_tokens} new "
             f"(greedy, ignore_eos); KV needed at once {need} tokens, the alone setup's pool "
             f"{alone_kv} ({100 * alone_kv / need:.0f} %); offload: {args.memory} memory nodes on "
             f"{args.memory_device}, {args.placement}, {args.micro_batches} micro-batches; "
             f"graphs {'on' if args.cuda_graphs else 'off'}; {args.rounds} rounds interleaved.", "",
             "| setup | tok/s (median) | wall s per round | preemptions | start-up s |",
             "|---|---:|---|---|---:|"]
    lines += [f"| {r['setup']} | {r['tok_per_s']:.1f} | {', '.join(map(str, r['wall_s']))} | "
              f"{', '.join(map(str, r['preemptions']))} | {r['start_s']} |" for r in rows]
    lines += ["", f"offload / alone: **{summary['offload_vs_alone']:.2f}x** (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); greedy agreement "
              f"{100 * agree:.1f} %", ""]
    md = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    (out / f"neo_{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, **summary},
                                                     indent=1))
    (out / f"neo_{tag}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
