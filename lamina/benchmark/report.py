"""The ``lamina bench`` report: ``results.json``, ``report.md`` and PNG plots in one folder.

Plots (matplotlib, Agg):

* ``throughput_vs_batch.png``: decode tokens/s against batch size, one line per system and
  context length (grid cells that do not fit are left out);
* ``latency_breakdown.png``: each system's wall time on the trace split into compute,
  attention, network and idle (Lamina Fig. 14);
* ``throughput_per_dollar.png``: the cost model's estimated tokens/s/$ against context
  length for homogeneous and offloaded deployments of the same model (Lamina Fig. 1).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lamina.benchmark.measure import GridPoint, RunResult
from lamina.costmodel.model import Infeasible, ModelSpec
from lamina.costmodel.hardware import Device
from lamina.costmodel.planner import best_homogeneous, best_per_dollar

COMPONENTS = ("compute", "attention", "network", "idle")


@dataclass
class CostPoint:
    """Cost-model estimate of one deployment at one context length."""

    deployment: str
    compute: str
    memory: str  # "" when homogeneous
    offloaded: bool
    context: int
    throughput: float
    cost_usd: float
    per_dollar: float
    bottleneck: str


@dataclass
class BenchReport:
    """Everything one ``lamina bench`` run measured; ``config`` holds its arguments and
    machine; ``capacity`` is each system's KV slots; ``fits`` the largest batch per context."""

    config: dict[str, Any]
    trace: list[RunResult] = field(default_factory=list)
    grid: list[GridPoint] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)
    fits: dict[str, dict[int, int]] = field(default_factory=dict)
    cost: list[CostPoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"config": self.config, "trace": [r.to_dict() for r in self.trace],
                "grid": [g.to_dict() for g in self.grid], "capacity": self.capacity,
                "largest_batch": {s: {str(c): b for c, b in v.items()} for s, v in self.fits.items()},
                "cost": [asdict(c) for c in self.cost]}


def cost_curves(model: ModelSpec, contexts: list[int], compute: list[Device],
                memory: list[Device]) -> list[CostPoint]:
    """tokens/s/$ estimates: each compute device alone (best tensor-parallel size) and with
    each memory device (best memory count), at every context; infeasible points are skipped."""
    out = []
    for ctx in contexts:
        for comp in compute:
            ests = [best_homogeneous(model, comp, ctx)]
            for mem in memory:
                try:
                    ests.append(best_per_dollar(model, comp, mem, ctx))
                except Infeasible:
                    pass
            for e in ests:
                if e is not None:
                    out.append(CostPoint(e.label(), e.compute.name, e.memory.name if e.memory else "",
                                         e.memory is not None, ctx, e.throughput,
                                         e.cost_usd, e.per_dollar, e.bottleneck))
    return out


def best_pairs(points: list[CostPoint]) -> list[tuple[CostPoint, CostPoint | None]]:
    """Per (context, compute device): the homogeneous point and the offloaded point with the
    highest tokens/s/$ (None if no offloaded deployment fits)."""
    out = []
    for key in dict.fromkeys((p.context, p.compute) for p in points):
        homo = [p for p in points if (p.context, p.compute) == key and not p.offloaded]
        off = [p for p in points if (p.context, p.compute) == key and p.offloaded]
        if homo:
            out.append((homo[0], max(off, key=lambda p: p.per_dollar) if off else None))
    return out


def _fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def _ms(x: float) -> str:
    return _fmt(x * 1e3 if x == x else x, 1)


def markdown(rep: BenchReport) -> str:
    c = rep.config
    lines = [f"# lamina bench: {c.get('model')}", "",
             f"Workload `{c.get('workload')}`; Lamina = compute {c.get('compute')} + memory "
             f"{c.get('memory')} ({c.get('transport')}); machine: {c.get('machine')}; "
             f"command: `{c.get('command')}`", ""]
    if rep.trace:
        ref = next((r for r in rep.trace if r.system == "hf"), None)
        lines += ["## Trace", "", "| system | done/req | out tok/s | vs HF | TTFT p50 ms | TTFT p99 ms "
                  "| TBT p50 ms | TBT p99 ms | max batch |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rep.trace:
            ratio = f"{r.throughput / ref.throughput:.2f}x" if ref else "n/a"
            lines.append(f"| {r.system} | {r.completed}/{r.num_requests} | {_fmt(r.throughput)} | "
                         f"{ratio} | {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | {_ms(r.tbt_p50)} | "
                         f"{_ms(r.tbt_p99)} | {r.max_batch} |")
        lines += ["", "Time breakdown (seconds of wall time):", "",
                  "| system | wall | " + " | ".join(COMPONENTS) + " |", "|---" * (2 + len(COMPONENTS)) + "|"]
        for r in rep.trace:
            b = r.breakdown
            lines.append(f"| {r.system} | {r.wall_s:.2f} | " + " | ".join(
                f"{getattr(b, k + '_s'):.2f}" for k in COMPONENTS) + " |")
        for r in rep.trace:
            for e in r.errors[:3]:
                lines.append(f"\n- {r.system} error: {e}")
        lines.append("")
    if rep.grid:
        lines += ["## Decode throughput vs batch (tokens/s; `-` = does not fit)", ""]
        systems = list(dict.fromkeys(g.system for g in rep.grid))
        lines += ["| context | batch | " + " | ".join(systems) + " |", "|---" * (2 + len(systems)) + "|"]
        cells = sorted({(g.context, g.batch) for g in rep.grid})
        for ctx, b in cells:
            row = [next((g for g in rep.grid if (g.system, g.context, g.batch) == (s, ctx, b)), None)
                   for s in systems]
            lines.append(f"| {ctx} | {b} | " + " | ".join(
                "-" if g is None or not g.fits else _fmt(g.throughput) for g in row) + " |")
        lines.append("")
    if rep.fits:
        lines += ["## Largest batch that fits (KV slots / (context + new tokens), capped by max_num_seqs)", "",
                  "| system | KV slots | " + " | ".join(f"ctx {k}" for k in next(iter(rep.fits.values()))) + " |",
                  "|---" * (2 + len(next(iter(rep.fits.values())))) + "|"]
        for s, v in rep.fits.items():
            lines.append(f"| {s} | {rep.capacity.get(s, 0):,} | " + " | ".join(str(b) for b in v.values()) + " |")
        lines.append("")
    if rep.cost:
        lines += ["## Estimated throughput per $ (cost model: bf16, MFU(B) curve, catalog prices)", "",
                  "Best homogeneous deployment of each compute device against its best offloaded "
                  "one (memory device and count chosen for tokens/s/$); every pair is in `results.json`.", "",
                  "| context | homogeneous | tok/s/$ | offloaded | tok/s/$ | advantage | bottleneck |",
                  "|---|---|---|---|---|---|---|"]
        for h, o in best_pairs(rep.cost):
            adv = f"{o.per_dollar / h.per_dollar:.2f}x" if o else "n/a"
            lines.append(f"| {h.context} | {h.deployment} | {h.per_dollar:.4g} | "
                         f"{o.deployment if o else 'none fits'} | {o.per_dollar if o else math.nan:.4g} | "
                         f"{adv} | {o.bottleneck if o else h.bottleneck} |")
        lines.append("")
    plots = [name for name, has_data, _ in PLOTS if has_data(rep)]
    lines += [f"Plots: {', '.join(f'`{n}`' for n in plots) or 'none'}; raw numbers: `results.json`.", ""]
    return "\n".join(lines)


def _throughput_vs_batch(rep: BenchReport, ax) -> None:
    for s in dict.fromkeys(g.system for g in rep.grid):
        for ctx in sorted({g.context for g in rep.grid}):
            pts = sorted((g.batch, g.throughput) for g in rep.grid
                         if g.system == s and g.context == ctx and g.fits)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{s}, ctx {ctx}")
    ax.set(xlabel="batch (requests)", ylabel="decode tokens/s", title="Throughput vs batch")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)


def _latency_breakdown(rep: BenchReport, ax) -> None:
    names = [r.system for r in rep.trace]
    left = [0.0] * len(names)
    for k in COMPONENTS:
        vals = [getattr(r.breakdown, k + "_s") for r in rep.trace]
        ax.barh(names, vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.set(xlabel="seconds of wall time", title="Where the time goes (trace)")


def _throughput_per_dollar(rep: BenchReport, ax) -> None:
    pairs = best_pairs(rep.cost)
    for comp in dict.fromkeys(h.compute for h, _ in pairs):
        homo = sorted((h.context, h.per_dollar) for h, _ in pairs if h.compute == comp)
        off = sorted((o.context, o.per_dollar) for h, o in pairs if h.compute == comp and o)
        line, = ax.plot(*zip(*homo), marker="o", label=f"{comp} alone")
        if off:
            ax.plot(*zip(*off), marker="s", ls="--", color=line.get_color(),
                    label=f"{comp} + best memory device")
    ax.set(xlabel="context length (tokens)", ylabel="estimated tokens/s per $",
           title="Throughput per $ (cost model)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)


# (file name, has data?, draw): a plot is written only when its part of the report has data
PLOTS = [("throughput_vs_batch.png", lambda r: any(g.fits for g in r.grid), _throughput_vs_batch),
         ("latency_breakdown.png", lambda r: bool(r.trace), _latency_breakdown),
         ("throughput_per_dollar.png", lambda r: bool(r.cost), _throughput_per_dollar)]


def _plots(rep: BenchReport, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, has_data, draw in PLOTS:
        if not has_data(rep):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        draw(rep, ax)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_report(rep: BenchReport, out_dir: str | Path) -> list[Path]:
    """Write ``results.json``, ``report.md`` and the PNGs into ``out_dir`` (created);
    returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rep.to_dict(), indent=1, default=str))
    (out / "report.md").write_text(markdown(rep))
    return [out / "results.json", out / "report.md", *_plots(rep, out)]
