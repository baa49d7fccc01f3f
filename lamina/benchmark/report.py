"""The ``lamina bench`` report: ``results.json``, ``report.md`` and PNG plots in one folder.

Plots (matplotlib, Agg):

* ``throughput_vs_batch.png``: decode tokens/s against batch size, one line per system and
  context length (grid cells that do not fit are left out);
* ``latency_breakdown.png``: each system's wall time on the trace split into compute,
  attention, network and idle (Lamina Fig. 14);
* ``throughput_per_dollar.png``: estimated tokens/s/$ against context length of the best
  homogeneous and the best offloaded plan that the constrained planner
  (:mod:`lamina.costmodel.search`, ``lamina plan``) finds within the report's limits.

``report.md`` also lists the top constrained plans at one context (``--plan-context``), each
with its bottleneck, as ``lamina plan`` prints them.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lamina.benchmark.measure import GridPoint, RunResult
from lamina.costmodel.constraints import Constraints
from lamina.costmodel.hardware import Device
from lamina.costmodel.model import ModelSpec
from lamina.costmodel.plan_cli import as_dict
from lamina.costmodel.search import Candidate, Outcome, binding_message, search

COMPONENTS = ("compute", "attention", "network", "idle")


@dataclass
class CostPoint:
    """The planner's best homogeneous or best offloaded plan at one context length, within the
    report's constraints (:func:`lamina.costmodel.search.search`)."""

    context: int
    offloaded: bool
    deployment: str  # e.g. "1 x H100 + 53 x Arc-A770"
    throughput: float  # tokens/s
    usd: float
    per_dollar: float  # tokens/s per USD of devices
    usd_per_mtok: float
    tbt_ms: float
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
    plans: list[dict] = field(default_factory=list)  # top constrained plans (plan_cli.as_dict)
    plan_note: str = ""  # model, context and constraints of ``plans``, or why there are none
    failures: dict[str, str] = field(default_factory=dict)  # system -> the error that stopped it

    def to_dict(self) -> dict:
        return {"config": self.config, "trace": [r.to_dict() for r in self.trace],
                "grid": [g.to_dict() for g in self.grid], "capacity": self.capacity,
                "largest_batch": {s: {str(c): b for c, b in v.items()} for s, v in self.fits.items()},
                "cost": [asdict(c) for c in self.cost], "plans": self.plans, "plan_note": self.plan_note,
                "failures": self.failures}


def _point(context: int, p: Candidate) -> CostPoint:
    e = p.est
    name = f"{e.n_compute} x {e.compute.name}" + (f" + {e.n_memory} x {e.memory.name}" if e.memory else "")
    return CostPoint(context, not p.homogeneous, name, p.throughput, p.usd, p.throughput / p.usd,
                     p.usd_per_mtok, p.tbt * 1e3, p.bottleneck)


def _search(model: ModelSpec, context: int, c: Constraints, catalog: dict[str, Device]) -> Outcome:
    return search(model, [d for d in catalog.values() if d.can("compute")],
                  [d for d in catalog.values() if d.can("memory")], context, c)


def cost_curves(model: ModelSpec, contexts: list[int], c: Constraints,
                catalog: dict[str, Device]) -> list[CostPoint]:
    """Per context: the best homogeneous and the best offloaded plan the constrained planner
    finds (either may be missing when nothing of its kind fits)."""
    out = []
    for ctx in contexts:
        res = _search(model, ctx, c, catalog)
        best_off = next((p for p in res.plans if not p.homogeneous), None)
        out += [_point(ctx, p) for p in (res.baseline, best_off) if p is not None]
    return out


def top_plans(model: ModelSpec, context: int, c: Constraints, catalog: dict[str, Device],
              top: int) -> tuple[list[dict], str]:
    """The ``top`` best constrained plans at ``context`` (plus the homogeneous baseline) as
    ``lamina plan --json`` rows, or no rows and the binding constraint."""
    res = _search(model, context, c, catalog)
    if not res.plans:
        return [], binding_message(res, c)
    rows = res.plans[:top]
    if res.baseline is not None and res.baseline not in rows:
        rows.append(res.baseline)
    return [as_dict(p, res.baseline) for p in rows], ""


def best_pairs(points: list[CostPoint]) -> list[tuple[int, CostPoint | None, CostPoint | None]]:
    """Per context: (context, homogeneous point or None, offloaded point or None)."""
    return [(ctx, next((p for p in points if p.context == ctx and not p.offloaded), None),
             next((p for p in points if p.context == ctx and p.offloaded), None))
            for ctx in dict.fromkeys(p.context for p in points)]


def _fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def _ms(x: float) -> str:
    return _fmt(x * 1e3 if x == x else x, 1)


def _cell(g: GridPoint | None, notes: list[GridPoint]) -> str:
    if g is None or not g.fits:
        return "-"
    return f"n/m [{next(k for k, n in enumerate(notes, 1) if n is g)}]" if g.note else _fmt(g.throughput)


def markdown(rep: BenchReport) -> str:
    c = rep.config
    lines = [f"# lamina bench: {c.get('model')}", "",
             f"Workload `{c.get('workload')}`; Lamina = compute {c.get('compute')} + memory "
             f"{c.get('memory')} ({c.get('transport')}); machine: {c.get('machine')}; "
             f"command: `{c.get('command')}`", ""]
    if rep.trace:
        ref = next((r for r in rep.trace if r.system == "hf"), None)
        lines += ["## Trace", "", "| system | done/req | out tok/s | vs HF | TTFT p50 ms | TTFT p99 ms "
                  "| TBT p50 ms | TBT p99 ms | max batch | cached prompt tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rep.trace:
            ratio = f"{r.throughput / ref.throughput:.2f}x" if ref else "n/a"
            lines.append(f"| {r.system} | {r.completed}/{r.num_requests} | {_fmt(r.throughput)} | "
                         f"{ratio} | {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | {_ms(r.tbt_p50)} | "
                         f"{_ms(r.tbt_p99)} | {r.max_batch} | "
                         f"{r.cached_tokens}/{r.prompt_tokens} |")
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
    if rep.failures:
        lines += ["## Systems that failed", ""]
        lines += [f"- {s}: {e}" for s, e in rep.failures.items()] + [""]
    if rep.grid:
        lines += ["## Decode throughput vs batch (tokens/s; `-` = does not fit; `n/m [k]` = not "
                  "measured, note k)", ""]
        systems = list(dict.fromkeys(g.system for g in rep.grid))
        lines += ["| context | batch | " + " | ".join(systems) + " |", "|---" * (2 + len(systems)) + "|"]
        notes = [g for g in rep.grid if g.note]
        cells = sorted({(g.context, g.batch) for g in rep.grid})
        for ctx, b in cells:
            row = [next((g for g in rep.grid if (g.system, g.context, g.batch) == (s, ctx, b)), None)
                   for s in systems]
            lines.append(f"| {ctx} | {b} | " + " | ".join(_cell(g, notes) for g in row) + " |")
        lines.append("")
        lines += [f"{k}. {g.system}, batch {g.batch}, context {g.context}: {g.note}"
                  for k, g in enumerate(notes, 1)] + ([""] if notes else [])
    if rep.fits:
        lines += ["## Largest batch that fits (KV slots / (context + new tokens), capped by max_num_seqs)", "",
                  "| system | KV slots | " + " | ".join(f"ctx {k}" for k in next(iter(rep.fits.values()))) + " |",
                  "|---" * (2 + len(next(iter(rep.fits.values())))) + "|"]
        for s, v in rep.fits.items():
            lines.append(f"| {s} | {rep.capacity.get(s, 0):,} | " + " | ".join(str(b) for b in v.values()) + " |")
        lines.append("")
    if rep.plans or rep.plan_note:
        lines += [f"## Top plans (cost model; {rep.config.get('plan_summary', 'no model to plan for')})", ""]
        if rep.plans:
            lines += ["| # | compute | memory | batch | mb/pipeline | tok/s | TBT ms | USD | $/Mtok "
                      "| vs homogeneous | bottleneck |", "|---" * 11 + "|"]
            for i, p in enumerate(rep.plans, 1):
                mem = f"{p['memory']['count']} x {p['memory']['kind']}" if p["memory"] else "-"
                lines.append(f"| {i}{'*' if p['homogeneous'] else ''} | {p['compute']['count']} x "
                             f"{p['compute']['kind']} | {mem} | {p['batch']} | {p['micro_batches']}/"
                             f"{p['pipeline']} | {_fmt(p['throughput_tok_s'], 0)} | {p['tbt_ms']:.1f} | "
                             f"{_fmt(p['usd'], 0)} | {p['usd_per_mtok']:.4g} | "
                             f"{p.get('vs_homogeneous', float('nan')):.2f}x | {p['bottleneck']} |")
            lines += ["", "`*` homogeneous baseline; $/Mtok = device capex over 3 years of 24/7 decoding."]
        else:
            lines.append(rep.plan_note)
        lines.append("")
    if rep.cost:
        lines += ["## Throughput per $ vs context (cost model, same constraints)", "",
                  "| context | homogeneous | tok/s/$ | bottleneck | offloaded | tok/s/$ | bottleneck | advantage |",
                  "|---|---|---|---|---|---|---|---|"]
        for ctx, h, o in best_pairs(rep.cost):
            adv = f"{o.per_dollar / h.per_dollar:.2f}x" if o and h else "n/a"
            lines.append(f"| {ctx} | {h.deployment if h else 'none fits'} | {h.per_dollar if h else math.nan:.4g} | "
                         f"{h.bottleneck if h else '-'} | {o.deployment if o else 'none fits'} | "
                         f"{o.per_dollar if o else math.nan:.4g} | {o.bottleneck if o else '-'} | {adv} |")
        lines.append("")
    plots = [name for name, has_data, _ in PLOTS if has_data(rep)]
    lines += [f"Plots: {', '.join(f'`{n}`' for n in plots) or 'none'}; raw numbers: `results.json`.", ""]
    return "\n".join(lines)


def _throughput_vs_batch(rep: BenchReport, ax) -> None:
    for s in dict.fromkeys(g.system for g in rep.grid):
        for ctx in sorted({g.context for g in rep.grid}):
            pts = sorted((g.batch, g.throughput) for g in rep.grid
                         if g.system == s and g.context == ctx and g.fits and not g.note)
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
    for offloaded, label, style in ((False, "homogeneous (best plan)", "o-"),
                                    (True, "offloaded (best plan)", "s--")):
        pts = sorted((p.context, p.per_dollar) for p in rep.cost if p.offloaded == offloaded)
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set(xlabel="context length (tokens)", ylabel="estimated tokens/s per $",
           title="Throughput per $ (constrained plans)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)


# (file name, has data?, draw): a plot is written only when its part of the report has data
PLOTS = [("throughput_vs_batch.png", lambda r: any(g.fits and not g.note for g in r.grid),
          _throughput_vs_batch),
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
