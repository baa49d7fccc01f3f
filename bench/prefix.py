"""Prefix caching, with and without, in the same run: two traces where requests share prefixes.

* **shared**: ``--requests`` requests (default 64) whose prompts are one ``--prefix``-token
  stem (default 2000) plus a ``--suffix``-token tail of their own (default 50), all submitted
  together, ``--max-tokens`` new tokens each (default 32), greedy. Per setup: the positions the
  model computed (prefill, decode and any recompute) and of them the prompt's, end-to-end
  tokens/s (generated tokens over the wall time from submission to the last token) and, for
  the cached setup, the decode window's tokens/s and attention per step (from every request
  having its first token to the last; uncached, the requests run one after another and there
  is no such window). Greedy outputs of the two setups must be equal.
* **attention**: decode attention alone on one memory node, the same shape, three KV layouts
  (:func:`run_attention`): what "the prefix read once per step" saves. The node is on
  ``--attention-device`` (default ``cpu``; ``cuda`` puts it on the GPU, the Triton kernels).
* **chat**: ``--conversations`` conversations (default 8) of ``--turns`` turns (default 6)
  through the OpenAI server (``/v1/chat/completions``, streamed, uvicorn on 127.0.0.1, the
  conversations side by side): a first user message of ~``--first-len`` tokens (default 400),
  then short follow-ups, ``--reply-tokens`` tokens per reply (default 32). Time to first token
  of turn 1 and of turns 2..T (the median over conversations and turns), with a
  ``--chat-kv-cache-gb`` pool (default 1).

Each setup is a fresh ``LLM`` (empty cache) on ``--device`` with one in-process memory node;
``--rounds R`` interleaves the setups R times and reports each one's median round, with the
per-round ratios. Writes ``prefix_cpu.{json,md}`` (``prefix_cuda.*`` where ``--device`` or
``--attention-device`` is a GPU; ``--quick``: ``..._quick.*``) to ``--out`` (default
``bench/results``). Nothing is asserted about speed.

    python bench/prefix.py --quick
    python bench/prefix.py                  # the README's table
"""
from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.costmodel.calibration import cpu_name  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SETUPS = ("uncached", "cached")
WORDS = ("memory nodes hold the cache token by token while compute nodes run the dense "
         "slices with big batches and the scheduler keeps every core busy").split()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return [(7919 * seed + 104729 * j + (j * j) % 977) % (vocab - 200) + 100 for j in range(n)]


def _llm(args, cached: bool, kv_gb: float) -> LLM:
    return LLM(args.model, device=args.device, memory=1, prefix_caching=cached,
               kv_cache_gb=kv_gb, max_num_seqs=max(64, args.requests))


def run_shared(args, cached: bool) -> dict:
    kv_gb = args.kv_cache_gb
    with _llm(args, cached, kv_gb) as llm:
        vocab = llm.deployment.instances[0].engine.vocab_size
        stem = _ids(1, args.prefix, vocab)
        prompts = [stem + _ids(100 + i, args.suffix, vocab) for i in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engine = llm.deployment.instances[0].engine
        nodes = llm.deployment.instances[0].nodes
        first: set[int] = set()
        window: dict = {}
        t0 = time.perf_counter()
        for delta in llm.generate_stream(prompts, params):
            if delta.token_ids and delta.index not in first:
                first.add(delta.index)
                if len(first) == len(prompts):
                    window = dict(t=time.perf_counter(), steps=engine.worker.times().steps,
                                  attend_us=sum(n.stats().attend_us for n in nodes))
        t1 = time.perf_counter()
        outs = [list(req.output_ids) for req, _, _ in llm._last]
        steps = engine.worker.times().steps - window["steps"]
        attend_us = sum(n.stats().attend_us for n in nodes) - window["attend_us"]
        computed = engine.scheduler.computed_tokens
        decoded = args.requests * (args.max_tokens - 1)
        return {"outputs": outs, "computed_tokens": computed,
                "prompt_tokens_computed": computed - decoded,
                "cached_tokens": sum(r.num_cached_tokens or 0 for r, _, _ in llm._last),
                "preemptions": sum(r.num_preemptions for r, _, _ in llm._last),
                "wall_s": t1 - t0, "e2e_tok_s": args.requests * args.max_tokens / (t1 - t0),
                "decode_tok_s": args.requests * (args.max_tokens - 1) / (t1 - window["t"]),
                "attend_ms_per_step": attend_us / 1000 / max(1, steps), "decode_steps": steps}


def run_attention(args) -> dict:
    """Decode attention alone, on one memory node in this process on ``--attention-device``
    (SmolLM2's shapes, float32, ``torch`` threads = ``--threads``): ``--requests`` requests at
    ``--prefix + --suffix`` positions, each with its own slots (``uncached``) or sharing the
    prefix's slots as the prefix cache leaves them (``cached``: the step's cascade reads the
    prefix once; ``shared, per request``: the same slots with the cascade off). Each node
    attends as an in-process instance's does: through its native plane where it has one. Times
    PREPARE plus one ATTEND per layer of a decode step (the step's q, k, v made before the clock
    starts), ``--reps`` steps per layout, layouts interleaved, once both nodes' pools are
    committed."""
    import torch

    from lamina.device import wait_populated
    from lamina.memnode import MemoryNode
    from lamina.memnode import cascade
    from lamina.memnode.native import plane_for
    from lamina.types import AttendMsg, AttentionSpec, KVChunk, PrepareMsg, ShardWork

    dev = torch.device(args.attention_device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--attention-device {dev}: torch sees no CUDA device")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)
    L, H, HKV, D = 30, 9, 3, 64
    specs = [AttentionSpec(layer=i, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
             for i in range(L)]
    R, P, S = args.requests, args.prefix, args.suffix
    g = torch.Generator().manual_seed(0)

    def kv(n: int) -> torch.Tensor:
        return torch.randn(L, n, HKV, D, generator=g)

    nodes = {}
    for layout in ("uncached", "cached"):
        node = MemoryNode(specs, R * (P + S + args.reps + 1) + P, dtype=torch.float32,
                          device=dev)
        node.plane = plane_for(node)
        if layout == "cached":
            node.import_kv(KVChunk(-1, 0, kv(P), kv(P)))
        for r in range(R):
            if layout == "cached":
                node.share(r, [(-1, 0, P)])
                node.import_kv(KVChunk(r, P, kv(S), kv(S)))
            else:
                node.import_kv(KVChunk(r, 0, kv(P + S), kv(P + S)))
        nodes[layout] = node
    wait_populated()  # steady state: a young pool's first writes fault its pages in
    times: dict[str, list[float]] = {"uncached": [], "shared, per request": [], "cached": []}
    step = 0
    for _ in range(args.reps):
        for name in times:
            node = nodes["uncached" if name == "uncached" else "cached"]
            pos = node.shard(0)[1]
            step += 1
            msgs = [AttendMsg(step, spec.layer, *(torch.randn(R, n, D, generator=g).to(dev)
                                                  for n in (H, HKV, HKV))) for spec in specs]
            saved = cascade.MIN_SAVED
            if name == "shared, per request":  # no group is worth a cascade: none is planned
                cascade.MIN_SAVED = float("inf")
            sync()
            t0 = time.perf_counter()
            try:
                node.prepare(PrepareMsg(step, [ShardWork(r, pos, 1, pos, 1) for r in range(R)]))
            finally:
                cascade.MIN_SAVED = saved
            for msg in msgs:
                node.attend(msg)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()} | {
        "spread_ms": {name: [min(t) * 1000, max(t) * 1000] for name, t in times.items()},
        "plane_served": {layout: n.plane.served if n.plane is not None else None
                         for layout, n in nodes.items()}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_chat(args, cached: bool) -> dict:
    import httpx
    import uvicorn

    from lamina.server.app import build_app
    from lamina.server.async_engine import AsyncEngine

    with _llm(args, cached, args.chat_kv_cache_gb) as llm:
        engine = llm.deployment.instances[0].engine
        aengine = AsyncEngine(llm.deployment, engine.tokenizer)
        app = build_app(aengine, engine.tokenizer, "m",
                        max_model_len=engine.scheduler.config.max_model_len)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
        cached_tokens: dict[int, list[int]] = {t: [] for t in range(args.turns)}

        def words(seed: int, n: int) -> str:
            return " ".join(WORDS[(seed * 31 + i * 7) % len(WORDS)] for i in range(n))

        def conversation(c: int) -> None:
            messages = [{"role": "user", "content": f"Document {c}: " + words(c, args.first_len)
                         + " Summarise it."}]
            with httpx.Client(timeout=600) as client:
                for t in range(args.turns):
                    start, first, text, usage = time.perf_counter(), None, "", {}
                    body = {"model": "m", "messages": messages, "max_tokens": args.reply_tokens,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
                    with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                       json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for ch in chunk.get("choices", []):
                                piece = ch.get("delta", {}).get("content") or ""
                                if piece and first is None:
                                    first = time.perf_counter() - start
                                text += piece
                    ttft[t].append(first)
                    cached_tokens[t].append(usage.get("prompt_tokens_details", {})
                                            .get("cached_tokens", 0))
                    messages += [{"role": "assistant", "content": text},
                                 {"role": "user", "content": f"Now point {t + 1}: "
                                  + words(100 * c + t, 20)}]

        threads = [threading.Thread(target=conversation, args=(c,))
                   for c in range(args.conversations)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        server.should_exit = True
        thread.join(timeout=10)
        aengine.shutdown()
    later = [x for t in range(1, args.turns) for x in ttft[t]]
    return {"ttft_turn1_s": statistics.median(ttft[0]), "ttft_later_s": statistics.median(later),
            "ttft_by_turn_s": [statistics.median(ttft[t]) for t in range(args.turns)],
            "cached_tokens_by_turn": [sum(cached_tokens[t]) for t in range(args.turns)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu:0-1")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--suffix", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-gb", type=float, default=7.0,
                   help="KV pool: room for every request uncached (so both setups run them all)")
    p.add_argument("--chat-kv-cache-gb", type=float, default=1.0,
                   help="the chat trace's KV pool (ample: with 7 GB, the cached setup's first "
                        "turn ran ~1 s slower, which a 1 GB pool did not show)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=400)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--attention-device", default="cpu",
                   help="attention: the memory node's device (cuda: the Triton kernels)")
    p.add_argument("--threads", type=int, default=2, help="attention: the node's torch threads")
    p.add_argument("--reps", type=int, default=5, help="attention: decode steps per layout")
    p.add_argument("--traces", nargs="+", default=["attention", "shared", "chat"],
                   choices=["attention", "shared", "chat"])
    p.add_argument("--quick", action="store_true",
                   help="8 requests x (200 + 20), 8 new tokens; 2 conversations x 3 turns")
    p.add_argument("--out", default=str(RESULTS), help="the folder for the results")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.command = " ".join(["python bench/prefix.py", *argv])
    if args.quick:
        args.requests, args.prefix, args.suffix, args.max_tokens = 8, 200, 20, 8
        args.conversations, args.turns, args.first_len, args.reply_tokens = 2, 3, 60, 8
        args.kv_cache_gb = args.chat_kv_cache_gb = 0.5
    runs = {"shared": run_shared, "chat": run_chat}
    rounds: dict = {t: {s: [] for s in SETUPS} for t in args.traces if t != "attention"}
    if "attention" in args.traces:
        rounds["attention"] = run_attention(args)
        print(f"attention: {rounds['attention']}", flush=True)
    for r in range(args.rounds):
        for trace in [t for t in args.traces if t != "attention"]:
            for setup in SETUPS:
                res = runs[trace](args, setup == "cached")
                rounds[trace][setup].append(res)
                shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()
                         if k != "outputs"}
                print(f"round {r + 1} {trace} {setup}: {shown}", flush=True)
    summary = summarise(args, rounds)
    write(args, summary)


def _median_round(results: list[dict], key: str) -> dict:
    return sorted(results, key=lambda x: x[key])[len(results) // 2]


def summarise(args, rounds) -> dict:
    out: dict = {"machine": cpu_name(), "platform": platform.platform(), "args": vars(args)}
    if "attention" in rounds:
        out["attention"] = rounds["attention"]
    if "shared" in rounds:
        u, c = rounds["shared"]["uncached"], rounds["shared"]["cached"]
        mu, mc = _median_round(u, "e2e_tok_s"), _median_round(c, "e2e_tok_s")
        out["shared"] = {
            "uncached": {k: v for k, v in mu.items() if k != "outputs"},
            "cached": {k: v for k, v in mc.items() if k != "outputs"},
            "identical": all(a["outputs"] == b["outputs"] for a, b in zip(u, c)),
            "prompt_tokens_computed_ratio": mu["prompt_tokens_computed"]
            / max(1, mc["prompt_tokens_computed"]),
            "e2e_ratio_by_round": [b["e2e_tok_s"] / a["e2e_tok_s"] for a, b in zip(u, c)],
        }
    if "chat" in rounds:
        u, c = rounds["chat"]["uncached"], rounds["chat"]["cached"]
        out["chat"] = {"uncached": _median_round(u, "ttft_later_s"),
                       "cached": _median_round(c, "ttft_later_s"),
                       "ttft_later_ratio_by_round": [a["ttft_later_s"] / b["ttft_later_s"]
                                                     for a, b in zip(u, c)]}
    return out


def write(args, s: dict) -> None:
    lines = [f"# Prefix caching, with and without ({s['machine']})", "",
             f"`{args.command}`, device {args.device}, one in-process memory node; "
             f"{args.rounds} round(s), median round shown.", ""]
    if "attention" in s:
        a = s["attention"]
        where = (f"{args.threads} threads" if args.attention_device == "cpu"
                 else args.attention_device)
        lines += [f"## Decode attention, {args.requests} requests x ({args.prefix} shared + "
                  f"{args.suffix} own positions), one node, {where}", "",
                  "| KV layout | ms per decode step (30 layers), median | min-max | vs uncached |",
                  "|---|---:|---:|---:|"]
        for name in ("uncached", "shared, per request", "cached"):
            lo, hi = a["spread_ms"][name]
            lines.append(f"| {name} | {a[name]:.1f} | {lo:.1f}-{hi:.1f} | "
                         f"{a['uncached'] / a[name]:.2f}x less |")
        lines += ["", "uncached: each request its own slots; shared, per request: the prefix's "
                  "slots shared, the cascade off; cached: shared and read once per step "
                  f"(cascade). {args.reps} steps per layout, interleaved. ATTENDs served by "
                  "the nodes' native planes (None: no plane): "
                  + ", ".join(f"{k} {v}" for k, v in a.get("plane_served", {}).items()) + ".", ""]
    if "shared" in s:
        sh, u, c = s["shared"], s["shared"]["uncached"], s["shared"]["cached"]
        lines += [f"## {args.requests} requests x ({args.prefix} shared + {args.suffix} own "
                  f"tokens) -> {args.max_tokens}", "",
                  "| measure | uncached | cached | ratio |", "|---|---:|---:|---:|",
                  f"| prompt tokens computed | {u['prompt_tokens_computed']} | "
                  f"{c['prompt_tokens_computed']} | {sh['prompt_tokens_computed_ratio']:.1f}x fewer |",
                  f"| end-to-end tokens/s | {u['e2e_tok_s']:.1f} | {c['e2e_tok_s']:.1f} | "
                  f"{c['e2e_tok_s'] / u['e2e_tok_s']:.2f}x |",
                  f"| wall s | {u['wall_s']:.1f} | {c['wall_s']:.1f} | |",
                  f"| preemptions | {u['preemptions']} | {c['preemptions']} | |", "",
                  f"Greedy outputs identical: {sh['identical']}. Per-round end-to-end ratios: "
                  + ", ".join(f"{x:.2f}" for x in sh["e2e_ratio_by_round"]) + ". Cached run, "
                  f"from every request's first token to the last: {c['decode_tok_s']:.1f} "
                  f"decode tokens/s, {c['attend_ms_per_step']:.1f} ms of attention per step "
                  "(uncached, requests admitted one after another finish before the last one "
                  "starts: no such window).", ""]
    if "chat" in s:
        ch, u, c = s["chat"], s["chat"]["uncached"], s["chat"]["cached"]
        lines += [f"## {args.conversations} conversations x {args.turns} turns through the "
                  f"OpenAI server (first message ~{args.first_len} words, replies of "
                  f"{args.reply_tokens} tokens)", "",
                  "| measure | uncached | cached | ratio |", "|---|---:|---:|---:|",
                  f"| time to first token, turn 1 (median) | {u['ttft_turn1_s']:.2f} s | "
                  f"{c['ttft_turn1_s']:.2f} s | |",
                  f"| time to first token, turns 2-{args.turns} (median) | "
                  f"{u['ttft_later_s']:.2f} s | {c['ttft_later_s']:.2f} s | "
                  f"{u['ttft_later_s'] / c['ttft_later_s']:.2f}x shorter |", "",
                  "Median TTFT by turn (s), uncached: "
                  + ", ".join(f"{x:.2f}" for x in u["ttft_by_turn_s"]) + "; cached: "
                  + ", ".join(f"{x:.2f}" for x in c["ttft_by_turn_s"])
                  + ". Cached prompt tokens by turn (usage.prompt_tokens_details): "
                  + ", ".join(str(x) for x in c["cached_tokens_by_turn"]) + ".", ""]
    gpu = any(d.startswith("cuda") for d in (args.device, args.attention_device))
    name = f"prefix_{'cuda' if gpu else 'cpu'}{'_quick' if args.quick else ''}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines))
    (out / f"{name}.json").write_text(json.dumps(s, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
