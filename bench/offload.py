"""Attention offloading on CPU: decode throughput of three setups at long context, side by side.

Workload: ``--requests`` requests (default 16) whose prompts are ~``--prompt-len`` tokens (default
~1000; built from repeated text, each request with its own prefix, lengths checked after
tokenization and slightly different so the HF batch really is left-padded), greedy, all
submitted together. Decode throughput with the prefill cancelled out::

    tokens/s = requests * (N - 1) / (t(N new tokens) - t(1 new token)),   N = --new-tokens + 1

Setups, each in this invocation (one after the other, not interleaved):

* ``homogeneous`` (a): ``LLM(model, device="cpu:0", memory=1, memory_device="cpu:0",
  placement="inproc")``: dense slices and attention in one process, one after the other;
* ``lamina`` (b): ``LLM(model, device="cpu:0", memory=1, memory_device="cpu:1",
  placement="procs", micro_batches=2, pipeline="rotational")``: the memory node is a process
  of its own and two micro-batches rotate, so attention overlaps the dense slices;
* ``hf`` (c): Hugging Face ``generate`` on the same weights (greedy, one left-padded batch,
  ``torch.set_num_threads(--hf-threads)``).

Ratios printed: lamina / homogeneous (target >= 1.35) and lamina / hf (target >= 1.2). Nothing
is asserted about speed. ``--dtype float32 bfloat16`` runs both dtypes (weights, activations and
KV cache in that dtype).

Per-stage breakdown (of t(N) - t(1), i.e. of the decode steps only), from what each role
measures itself, the same counters ``lamina bench`` uses (:mod:`lamina.benchmark.measure`):

* engine ``execute``: time the engine spent inside its replica worker (submit/wait);
  ``wait``: the part of it blocked (in-process replica: on memory nodes; procs: on the replica
  process, which includes the replica's dense work *and* its waits on the memory node);
* memory node ``attention``: the node's own ATTEND time (STATS ``attend_us``).

Derived columns: ``dense`` = execute - max(wait, attention) for in-process replicas (an
in-process node attends in the engine's thread, so its attention is inside ``execute``); for
procs the replica's dense time is not reported to the engine, so ``dense`` is
``wait - attention`` there: dense work *plus* transfer, *minus* whatever attention overlapped
the dense work (rotational pipelining), so a bound of neither; ``transfer`` then reads
"in dense". In-process: ``transfer`` = wait - attention. ``idle`` =
decode wall time - execute (scheduling, detokenization, Python). With rotational pipelining
attention overlaps dense work, so the columns need not add up to the wall time.

Greedy agreement: the fraction of generated tokens equal to the homogeneous run's at the same
position (per dtype), for lamina and hf.

Writes bench/results/offload_cpu.{json,md} (``--quick``: offload_cpu_quick.{json,md}). Numbers
from a shared or loaded machine are noisy.

    python bench/offload.py --quick                 # 4 requests x ~256 tokens, 8 new tokens
    python bench/offload.py --dtype float32 bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402  (before torch: OpenMP wait policy)
from lamina.benchmark.measure import _attend_s, _times, left_padded  # noqa: E402
from lamina.models import load_model  # noqa: E402

import torch  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TEXT = ("The history of computing is a story of trade-offs between memory and arithmetic. "
        "Engineers have long balanced the cost of moving data against the cost of computing "
        "on it, and every generation of hardware shifts that balance again. ")
SETUPS = ("homogeneous", "lamina", "hf")


def make_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``n`` token-id prompts of ``length - 3*i`` tokens (i = request index), repeated text with
    a per-request prefix; lengths are exact after tokenization."""
    body = tok(TEXT * (length // 20 + 8), add_special_tokens=False)["input_ids"]
    out = []
    for i in range(n):
        head = tok(f"Request {i}: summarize the following text.\n", add_special_tokens=False)[
            "input_ids"]
        ids = (head + body)[:length - 3 * i]
        assert len(ids) == length - 3 * i, "text too short for the prompt length"
        out.append(ids)
    return out


def lamina_kwargs(setup: str) -> dict:
    if setup == "homogeneous":
        return dict(device="cpu:0", memory=1, memory_device="cpu:0", placement="inproc")
    return dict(device="cpu:0", memory=1, memory_device="cpu:1", placement="procs",
                micro_batches=2, pipeline="rotational")


def _counters(llm) -> tuple[float, float, list[float]]:
    ex, wait = _times(llm)
    return ex, wait, _attend_s(llm)


def _timed_generate(llm, prompts, n_new: int):
    """(seconds, counter deltas, tokens, seconds after every request had its first token)."""
    c0 = _counters(llm)
    p = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    toks: list[list[int]] = [[] for _ in prompts]
    t = time.perf_counter()
    t_first = None
    for d in llm.generate_stream(prompts, p):
        toks[d.index] += d.token_ids
        if t_first is None and all(toks):
            t_first = time.perf_counter()
    end = time.perf_counter()
    c1 = _counters(llm)
    delta = (c1[0] - c0[0], c1[1] - c0[1], [b - a for a, b in zip(c0[2], c1[2])])
    return end - t, delta, toks, end - (t_first or end)


def run_lamina(model: str, setup: str, dtype: str, prompts, new_tokens: int, repeats: int) -> dict:
    n = len(prompts)
    longest = max(map(len, prompts)) + new_tokens + 1
    kv_gb = 2 * n * longest * 30 * 3 * 64 * 2 * 4 / 2**30 + 0.25  # generous (smollm2 f32 x2)
    kw = lamina_kwargs(setup)
    # an in-process role pins this process to its cores (lamina/device.py): undo it afterwards
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        return _run_lamina(model, setup, dtype, prompts, new_tokens, repeats, kw, kv_gb)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _run_lamina(model, setup, dtype, prompts, new_tokens, repeats, kw, kv_gb) -> dict:
    n = len(prompts)
    longest = max(map(len, prompts)) + new_tokens + 1
    with LLM(model, dtype=dtype, max_num_seqs=n, max_num_batched_tokens=n * longest,
             kv_cache_gb=kv_gb, **kw) as llm:
        _timed_generate(llm, prompts, 2)  # warm-up (allocations, threads, first long prefill)
        best = None
        for _ in range(repeats):
            t1, d1, _, _ = _timed_generate(llm, prompts, 1)
            tn, dn, toks, after = _timed_generate(llm, prompts, new_tokens + 1)
            if best is None or tn - t1 < best[1] - best[0]:
                best = (t1, tn, d1, dn, toks, after)
    t1, tn, d1, dn, toks, after = best
    # the prefill of ~n*prompt_len tokens can vary by more than the whole decode on a loaded
    # machine: then t(N) - t(1) is meaningless (NaN); stream_tok_per_s (decode steps after
    # every request's first token, same run) is the steadier number
    dec = tn - t1 if tn > t1 else float("nan")
    ex, wait = dn[0] - d1[0], dn[1] - d1[1]
    att_nodes = [b - a for a, b in zip(d1[2], dn[2])]
    parallel = kw["placement"] != "inproc"
    att = max(att_nodes, default=0.0) if parallel else sum(att_nodes)
    if parallel:  # replica is a process: wait = its dense work + its waits on the node
        bd = {"dense_s": max(0.0, wait - att), "attention_s": att, "transfer_s": None,
              "idle_s": max(0.0, dec - ex)}
    else:
        # in-process nodes attend in the engine's thread: their time is inside execute, and
        # wait (blocked on a node) may be ~0, so take attention from the node's own counter
        bd = {"dense_s": max(0.0, ex - max(wait, att)), "attention_s": att,
              "transfer_s": max(0.0, wait - att), "idle_s": max(0.0, dec - ex)}
    return {"setup": setup, "dtype": dtype, "t1_s": t1, "tN_s": tn, "decode_s": dec,
            "tok_per_s": n * new_tokens / dec, "ms_per_step": 1e3 * dec / new_tokens,
            "stream_tok_per_s": n * new_tokens / after if after > 0 else float("nan"),
            "measured": {"engine_execute_s": ex, "engine_wait_s": wait,
                         "node_attention_s": att_nodes},
            "breakdown": bd, "tokens": toks}


def run_hf(model: str, dtype: str, prompts, new_tokens: int, repeats: int, threads: int) -> dict:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loaded = load_model(model, dtype=getattr(torch, dtype))
        m = loaded.model
        pad = loaded.tokenizer.pad_token_id if loaded.tokenizer else None
        pad = pad if pad is not None else 0
        ids, mask = left_padded(prompts, pad)

        def gen(k: int):
            t = time.perf_counter()
            with torch.inference_mode():
                out = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                                 min_new_tokens=k, pad_token_id=pad)
            return time.perf_counter() - t, out[:, ids.shape[1]:].tolist()

        gen(1)  # warm-up
        best = None
        for _ in range(repeats):
            t1, _ = gen(1)
            tn, toks = gen(new_tokens + 1)
            if best is None or tn - t1 < best[1] - best[0]:
                best = (t1, tn, toks)
    finally:
        torch.set_num_threads(old)
    t1, tn, toks = best
    dec = tn - t1 if tn > t1 else float("nan")  # prefill noise larger than the decode
    return {"setup": "hf", "dtype": dtype, "t1_s": t1, "tN_s": tn, "decode_s": dec,
            "tok_per_s": len(prompts) * new_tokens / dec, "ms_per_step": 1e3 * dec / new_tokens,
            "measured": {}, "breakdown": {"dense_s": dec, "attention_s": None,
                                          "transfer_s": None, "idle_s": None},
            "tokens": toks}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where the two greedy outputs agree (over all requests)."""
    same = total = 0
    for x, y in zip(a, b):
        k = min(len(x), len(y))
        same += sum(p == q for p, q in zip(x[:k], y[:k]))
        total += max(len(x), len(y))
    return same / max(total, 1)


def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1000, help="longest prompt, in tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed (N - 1)")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=1, help="best of this many t(N)-t(1) pairs")
    ap.add_argument("--hf-threads", type=int, default=2)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--quick", action="store_true", help="4 requests x ~256 tokens, 8 new tokens")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens = 4, 256, 8

    tok = load_model(args.model).tokenizer
    prompts = make_prompts(tok, args.requests, args.prompt_len)
    lens = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, {min(lens)}-{max(lens)} tokens; {args.new_tokens} decode "
          f"steps timed", flush=True)
    rows = []
    for dtype in args.dtype:
        for setup in args.setups:
            t = time.perf_counter()
            if setup == "hf":
                r = run_hf(args.model, dtype, prompts, args.new_tokens, args.repeats,
                           args.hf_threads)
            else:
                r = run_lamina(args.model, setup, dtype, prompts, args.new_tokens, args.repeats)
            print(f"{dtype:9s} {setup:12s} {r['tok_per_s']:8.1f} tok/s  "
                  f"({r['ms_per_step']:.0f} ms/step, t1 {r['t1_s']:.2f} s, "
                  f"t{args.new_tokens + 1} {r['tN_s']:.2f} s; after-first-token "
                  f"{r.get('stream_tok_per_s', float('nan')):.1f} tok/s; setup+run {time.perf_counter() - t:.0f} s)",
                  flush=True)
            rows.append(r)

    by = {(r["dtype"], r["setup"]): r for r in rows}
    summary = []
    for dtype in args.dtype:
        s = {"dtype": dtype}
        ref = by.get((dtype, "homogeneous"))
        for setup in args.setups:
            s[f"{setup}_tok_per_s"] = by[(dtype, setup)]["tok_per_s"]
            if "stream_tok_per_s" in by[(dtype, setup)]:
                s[f"{setup}_stream_tok_per_s"] = by[(dtype, setup)]["stream_tok_per_s"]
            if ref and setup != "homogeneous":
                s[f"agree_{setup}_vs_homogeneous"] = agreement(ref["tokens"],
                                                               by[(dtype, setup)]["tokens"])
        if (dtype, "lamina") in by:
            lam = by[(dtype, "lamina")]["tok_per_s"]
            if ref:
                s["lamina_over_homogeneous"] = lam / ref["tok_per_s"]
            if (dtype, "hf") in by:
                s["lamina_over_hf"] = lam / by[(dtype, "hf")]["tok_per_s"]
        summary.append(s)

    lines = [f"# Attention offloading on CPU ({args.model}, {len(prompts)} requests x "
             f"{min(lens)}-{max(lens)} prompt tokens, {args.new_tokens} decode steps)", "",
             "tokens/s = requests x steps / (t(steps+1 new tokens) - t(1 new token)). Targets: "
             "lamina/homogeneous >= 1.35, lamina/hf >= 1.2 (not asserted).", "",
             "| dtype | homogeneous tok/s | lamina tok/s | hf tok/s | lamina / homog. | "
             "lamina / hf | greedy agree lamina | greedy agree hf |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(
            f"| {s['dtype']} | {_f(s.get('homogeneous_tok_per_s'), 1)} | "
            f"{_f(s.get('lamina_tok_per_s'), 1)} | {_f(s.get('hf_tok_per_s'), 1)} | "
            f"{_f(s.get('lamina_over_homogeneous'))}x | {_f(s.get('lamina_over_hf'))}x | "
            f"{_f(s.get('agree_lamina_vs_homogeneous'), 3)} | "
            f"{_f(s.get('agree_hf_vs_homogeneous'), 3)} |")
    lines += ["", "Decode tokens/s measured within the t(N) run from the moment every request "
              "had its first token (prefill-free, steadier under load): " + "; ".join(
                  f"{s['dtype']}: homogeneous {_f(s.get('homogeneous_stream_tok_per_s'), 1)}, "
                  f"lamina {_f(s.get('lamina_stream_tok_per_s'), 1)}" for s in summary)]
    lines += ["", "Per-stage breakdown of the decode time (seconds; see the docstring: for "
              "lamina/procs 'dense' includes transfer, for hf everything is 'dense').", "",
              "| dtype | setup | decode s | dense | attention | transfer | idle | "
              "engine execute | engine wait | node attention |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b, m = r["breakdown"], r["measured"]
        node = ", ".join(f"{x:.2f}" for x in m.get("node_attention_s", [])) or "-"
        transfer = b["transfer_s"]
        tr = "in dense" if (transfer is None and r["setup"] == "lamina") else _f(transfer)
        lines.append(f"| {r['dtype']} | {r['setup']} | {r['decode_s']:.2f} | {_f(b['dense_s'])} | "
                     f"{_f(b['attention_s'])} | {tr} | {_f(b['idle_s'])} | "
                     f"{_f(m.get('engine_execute_s'))} | {_f(m.get('engine_wait_s'))} | {node} |")
    md = "\n".join(lines) + "\n"
    meta = {"model": args.model, "requests": len(prompts), "prompt_lens": lens,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "quick": args.quick,
            "hf_threads": args.hf_threads, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "offload_cpu_quick" if args.quick else "offload_cpu"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                  "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
