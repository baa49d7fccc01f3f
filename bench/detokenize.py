"""The text of a growing output: decoded whole at every step against decoded incrementally.

What a running request's text costs the engine (stop strings) and each stream (``generate_stream``,
the OpenAI server) per step, at output lengths ``--lengths``: ``tokenizer.decode`` of the whole
output (what both did until 2026-11-29) against :class:`lamina.engine.detokenize.IncrementalText`
taking in the step's one new token. The same random ids (seed 0) for both, the builtin model's
tokenizer (or ``--model``), best of ``--rounds`` rounds, rounds interleaved. Also checks that the
incremental text equals the whole decode at every length.

    python bench/detokenize.py                # lengths 100 500 1000 2000 4000, 3 rounds

Writes ``bench/results/detokenize_cpu.{json,md}``. Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.engine.detokenize import IncrementalText  # noqa: E402
from lamina.models import materialize_alias  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a builtin alias or a folder with a tokenizer")
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000])
    ap.add_argument("--steps", type=int, default=50, help="steps timed at each length")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import transformers

    folder = Path(args.model) if Path(args.model).is_dir() else materialize_alias(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    ids = [rng.randrange(len(tok)) for _ in range(max(args.lengths) + args.steps)]
    best: dict[int, dict[str, float]] = {n: {"whole": 1e9, "incremental": 1e9} for n in args.lengths}
    for _ in range(args.rounds):
        for n in args.lengths:
            grown = ids[:n]
            t = time.perf_counter()
            for k in range(args.steps):  # the old way: the whole output, every step
                grown.append(ids[n + k])
                tok.decode(grown, skip_special_tokens=True)
            whole = (time.perf_counter() - t) / args.steps
            inc, grown = IncrementalText(), ids[:n]
            inc.update(grown, tok)  # the text so far, as earlier steps left it
            t = time.perf_counter()
            for k in range(args.steps):
                grown.append(ids[n + k])
                inc.update(grown, tok)
            step = (time.perf_counter() - t) / args.steps
            if inc.text != tok.decode(grown[:inc.read], skip_special_tokens=True):
                raise SystemExit(f"the incremental text differs from the whole decode at {n}")
            best[n]["whole"] = min(best[n]["whole"], whole)
            best[n]["incremental"] = min(best[n]["incremental"], step)

    rows = [{"length": n, "whole_us": 1e6 * b["whole"], "incremental_us": 1e6 * b["incremental"],
             "ratio": b["whole"] / b["incremental"]} for n, b in best.items()]
    cmd = "python bench/detokenize.py" + (f" --model {args.model}" if args.model != "smollm2" else "")
    md = ["# A growing output's text per step: whole decode vs incremental", "",
          f"Machine: {platform.processor() or platform.machine()}; tokenizer of {args.model}; "
          f"transformers {transformers.__version__}; best of {args.rounds} rounds of "
          f"{args.steps} steps at each length.", "", "```bash", cmd, "```", "",
          "| output tokens | whole decode, us per step | incremental, us per step | ratio |",
          "|---:|---:|---:|---:|"]
    md += [f"| {r['length']} | {r['whole_us']:.0f} | {r['incremental_us']:.1f} | "
           f"{r['ratio']:.0f}x |" for r in rows]
    md.append("")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "detokenize_cpu.md").write_text("\n".join(md))
    (RESULTS / "detokenize_cpu.json").write_text(json.dumps(
        {"command": cmd, "model": args.model, "rounds": args.rounds, "steps": args.steps,
         "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
