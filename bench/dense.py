"""One dense pass over the builtin model on CPU: what the slices' op calls cost, in one run.

A compute replica runs every slice of the split model once per decode step (attention
excluded). This times that pass for T tokens on one core with the replica's slices as they
run (packed C++ linear layers) in two forms, interleaved pass by pass:

* ``exported``: every small ATen op called as ``torch.ops.aten.<op>.<overload>`` (what
  ``torch.export`` emits);
* ``bindings``: the same ops through their public bindings (:mod:`lamina.computenode.fast_ops`,
  what a replica runs).

Attention is a fixed stand-in (zeros), so the pass is the dense part alone. Reports each form's
median ms per pass, the difference, and the op calls per pass; checks that both give the same
logits bit for bit. Saves bench/results/dense_cpu.{json,md}.

    python bench/dense.py                   # T = 1 8 32, 9 rounds
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lamina.computenode.fast_ops import FAST, use_fast_ops  # noqa: E402
from lamina.computenode.replica import ComputeReplica  # noqa: E402
from lamina.models import load_model  # noqa: E402
from lamina.splitter import split_model  # noqa: E402


def set_form(split, fast: bool) -> None:
    """Point every FAST node at its binding (``fast``: what a replica runs) or back at its
    overload (what ``torch.export`` emitted)."""
    back = {v: k for k, v in FAST.items()}
    for gm in split.slices:
        if fast:
            use_fast_ops(gm)
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.target = back.get(node.target, node.target)
        gm.recompile()


def one_pass(split, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    ids = torch.randint(100, 1000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    o = torch.zeros(tokens, heads, head_dim)
    with torch.inference_mode():
        return split.forward(ids, torch.arange(64, 64 + tokens), torch.arange(tokens),
                             lambda k, q, key, v: o)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    cfg = loaded.model.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    split = ComputeReplica(split_model(loaded.model), "cpu").split
    calls = sum(1 for gm in split.slices for n in gm.graph.nodes if n.op == "call_function")
    moved = sum(1 for gm in split.slices for n in gm.graph.nodes if n.target in FAST.values())
    rows = []
    for t in args.tokens:
        times: dict[bool, list[float]] = {False: [], True: []}
        out: dict[bool, torch.Tensor] = {}
        for r in range(args.rounds + 1):
            for fast in ((False, True) if r % 2 else (True, False)):
                set_form(split, fast)
                t0 = time.perf_counter()
                out[fast] = one_pass(split, t, heads, head_dim)
                if r:  # round 0 warms both forms up
                    times[fast].append(time.perf_counter() - t0)
        set_form(split, True)
        ex, fa = (1e3 * statistics.median(times[f]) for f in (False, True))
        rows.append({"tokens": t, "exported_ms": ex, "bindings_ms": fa, "saved_ms": ex - fa,
                     "ratio": statistics.median(a / b for a, b in zip(times[False], times[True])),
                     "identical": bool(torch.equal(out[False], out[True]))})
        print(f"T={t:3d}  exported {ex:7.1f} ms  bindings {fa:7.1f} ms  saved {ex - fa:5.1f} ms  "
              f"identical={rows[-1]['identical']}")
    lines = [f"# Dense pass over {args.model} on one core: op call paths ({calls} op calls per "
             f"pass, {moved} through bindings; median of {args.rounds} interleaved rounds)", "",
             "| tokens | exported ms | bindings ms | saved ms | exported / bindings (same round) "
             "| same logits |", "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['tokens']} | {r['exported_ms']:.1f} | {r['bindings_ms']:.1f} | "
              f"{r['saved_ms']:.1f} | {r['ratio']:.3f}x | {'yes' if r['identical'] else 'NO'} |"
              for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "rounds": args.rounds, "op_calls": calls, "via_bindings": moved,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    (args.out / "dense_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "dense_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
