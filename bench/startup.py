"""Start-up time of an instance: how long ``LLM(...)`` takes to be ready, by split cache state.

Each measurement is a fresh Python process that builds ``LLM(model, memory=1, placement=P)``
and closes it (so nothing is memoised between them). Split cache states:

* ``off``: ``LAMINA_SPLIT_CACHE=0``: every process that runs a replica exports and cuts the
  model (the engine's, and each replica process under ``procs``);
* ``cold``: an empty cache folder: the first process splits and stores, later ones read;
* ``warm``: the folder the cold run filled: every process reads the split.

Each child also reports where its seconds went (:mod:`lamina.stages`): importing lamina,
loading the model, the split (read from the cache, or export and cut, and store), the memory
nodes and compute replicas (in process: built; ``procs``: spawned until their first PING reply,
with each role's own stages, for example ``replica 0: split: read cache``, and what its own
stages leave: ``start, other`` = the process's start, imports, C++ extension checks). Prints a
table and a breakdown per placement (median over rounds) and saves
``bench/results/startup_<device>.{json,md}``. Never asserts speed.

    python bench/startup.py                        # smollm2, inproc and procs, ~6 minutes
    python bench/startup.py --placements procs --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time
t = time.perf_counter()
from lamina import LLM, stages
imported = time.perf_counter() - t
llm = LLM(sys.argv[1], memory=1, placement=sys.argv[2], device=sys.argv[3])
ready = time.perf_counter() - t
record = stages.take()
llm.close()
print("READY", json.dumps({"ready": ready, "import lamina": imported, **record}))
"""


def one(model: str, placement: str, device: str, cache: str) -> dict[str, float]:
    """One fresh process's seconds: ``ready`` and its stages."""
    env = dict(os.environ, LAMINA_SPLIT_CACHE=cache, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, model, placement, device], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("READY")).split(" ", 1)[1])


def breakdown(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: each stage's median seconds per cache state, in the order first met;
    ``other`` is what the engine's own stages leave of ``ready``."""
    names: list[str] = []
    for recs in runs.values():
        for rec in recs:
            names += [n for n in rec if n not in names and n != "ready"]
    top = [n for n in names if ": " not in n or n.startswith("split: ")]
    rows = []
    for n in names + ["other", "ready"]:
        cells = []
        for recs in runs.values():
            if n == "other":
                vals = [r["ready"] - sum(r.get(t, 0.0) for t in top) for r in recs]
            else:
                vals = [r[n] for r in recs if n in r]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        label = f"&nbsp;&nbsp;{n}" if n not in top + ["other", "ready"] else n
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--placements", nargs="+", default=["inproc", "procs"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    rows = []
    for placement in a.placements:
        got: dict[str, list[dict[str, float]]] = {"off": [], "cold": [], "warm": []}
        for _ in range(a.rounds):
            with tempfile.TemporaryDirectory(prefix="lamina-startup-") as d:
                got["off"].append(one(a.model, placement, a.device, "0"))
                got["cold"].append(one(a.model, placement, a.device, d))
                got["warm"].append(one(a.model, placement, a.device, d))
        med = {k: statistics.median(r["ready"] for r in v) for k, v in got.items()}
        rows.append({"placement": placement, **{f"{k}_s": round(v, 1) for k, v in med.items()},
                     "warm_vs_off": round(med["off"] / med["warm"], 2), "runs": got})
        print(f"{placement}: off {med['off']:.1f} s, cold {med['cold']:.1f} s, "
              f"warm {med['warm']:.1f} s ({med['off'] / med['warm']:.2f}x faster warm)", flush=True)
    md = [f"# Start-up time ({a.model}, {a.device}, 1 memory node; {a.rounds} round(s), "
          f"{time.strftime('%Y-%m-%d')})", "",
          "Seconds from `import lamina` to a ready `LLM`, each in a fresh process. See the "
          "docstring of bench/startup.py.", "",
          "| placement | cache off s | cold s | warm s | off / warm |", "|---|---:|---:|---:|---:|"]
    md += [f"| {r['placement']} | {r['off_s']} | {r['cold_s']} | {r['warm_s']} | "
           f"{r['warm_vs_off']:.2f}x |" for r in rows]
    for r in rows:
        md += ["", f"### Where the seconds go: {r['placement']}", "",
               "Engine-process stages, then each role's own (indented; under `procs` they run "
               "inside that role's `start`). `other`: what the engine's stages leave of "
               "`ready`.", "",
               "| stage | cache off s | cold s | warm s |", "|---|---:|---:|---:|",
               *breakdown(r["runs"])]
    text = "\n".join(md) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if a.device.startswith("cuda") else "cpu"
    (a.out / f"startup_{dev}.md").write_text(text)
    (a.out / f"startup_{dev}.json").write_text(json.dumps({"model": a.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
