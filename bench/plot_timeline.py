"""Render a Lamina timeline (Chrome/Perfetto trace JSON from ``--trace``) as a PNG Gantt chart:
one row per compute replica and memory node, bars coloured by micro-batch (slices, attention)
with send/recv/wait in grey shades.

    python bench/plot_timeline.py bench/results/timeline_rotational.json            # -> .png
    python bench/plot_timeline.py trace.json --start-ms 200 --window-ms 150 --out t.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHADES = {"send": "#999999", "recv": "#555555", "wait": "#dddddd"}


def load_rows(trace: dict) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str]]:
    names = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    return sorted(names), names


def plot(trace: dict, out: Path, start_ms: float | None, window_ms: float | None) -> Path:
    rows, names = load_rows(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    if not xs:
        raise ValueError("the trace has no spans")
    t_end = max(e["ts"] + e["dur"] for e in xs) / 1e3
    lo = start_ms if start_ms is not None else t_end * 0.4  # steady state, past the prefill
    hi = lo + (window_ms if window_ms is not None else min(t_end - lo, 400.0))
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(rows)))
    for e in xs:
        a, d = e["ts"] / 1e3, e["dur"] / 1e3
        if a + d < lo or a > hi:
            continue
        y = rows.index((e["pid"], e["tid"]))
        kind = e["name"].split()[0]
        color = SHADES.get(kind, colors(int(e["args"].get("micro_batch", 0)) % 10))
        ax.broken_barh([(a, d)], (y - 0.4, 0.8), color=color, edgecolor="none")
    ax.set_yticks(range(len(rows)), [names[r] for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i)) for i in range(4)]
    handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in SHADES.values()]
    ax.legend(handles, [f"micro-batch {i}" for i in range(4)] + list(SHADES),
              loc="upper right", fontsize=7, ncol=7)
    ax.set_title(f"Lamina timeline ({out.stem})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--start-ms", type=float)
    ap.add_argument("--window-ms", type=float)
    args = ap.parse_args()
    out = plot(json.loads(args.trace.read_text()), args.out or args.trace.with_suffix(".png"),
               args.start_ms, args.window_ms)
    print(out)


if __name__ == "__main__":
    main()
