"""Calibration: the cost model's parameters fitted to stage times measured on one machine.

A measured decode step of ``B`` requests at KV length ``c`` (one compute replica, one memory
node, one micro-batch: the stages add up) splits into three stage times, in seconds per step
(:class:`StagePoint`, measured by :mod:`lamina.benchmark.calibrate` from the run's timeline):

* ``dense``: the replica's slices and sampling. Fitted ``dense = d0 + d1*B``, which is the
  cost model's MFU curve (:class:`~lamina.costmodel.model.MfuCurve`) against the measured
  peak ``F``: ``mfu_max = 2N / (F*d1)``, ``b_half = d0 / d1`` (N = parameters multiplied per
  token).
* ``attention``: the memory node's ATTEND kernels. Fitted ``attention = a0 + bytes / bw``
  with ``bytes = B * c * kv_bytes_per_token``; ``bw_efficiency = bw / copy bandwidth``.
* ``other``: the rest of the step (building, sending and merging ATTENDs, wake-ups, engine
  scheduling). Fitted ``other = r0 + B * transfer_bytes_per_token / net_bw``.

The fixed parts ``a0 + r0`` do not depend on B or c; the model carries them as one round trip
per layer, ``2 * L * latency`` (the planner's ``--nic-latency`` term). Every fit is a least
squares on relative error (weights ``1/y``), with the intercept dropped when it comes out
negative. :func:`predict` then runs the planner's own code (:func:`~lamina.costmodel.model.offloaded`
and :func:`~lamina.costmodel.search.evaluate`) with the fitted parameters, so what is validated
against measured ``lamina bench`` runs is the planner's prediction, not a side formula.
"""
from __future__ import annotations

import math
import platform
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lamina.costmodel.constraints import Constraints
from lamina.costmodel.hardware import Device
from lamina.costmodel.model import Assumptions, MfuCurve, ModelSpec, offloaded
from lamina.costmodel.search import evaluate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "calibration"
TOLERANCE = 0.25  # predicted vs measured decode tokens/s and TBT (issue 21)


@dataclass(frozen=True)
class StagePoint:
    """Stage seconds per decode step of ``batch`` requests whose KV length averages
    ``kv_len`` tokens over the measured steps; ``tbt`` is the whole step."""

    batch: int
    kv_len: float
    steps: int
    tbt: float
    dense: float
    attention: float

    @property
    def other(self) -> float:
        return max(self.tbt - self.dense - self.attention, 0.0)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b*x`` minimising the squared *relative* error; ``a >= 0`` (refit
    through the origin otherwise) and ``b >= 0``. Needs two distinct x (one x: ``b = 0``)."""
    if not xs or len(xs) != len(ys) or min(ys) <= 0:
        raise ValueError("fit_line needs as many positive y as x, at least one")
    w = [1.0 / (y * y) for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 1e-12 * max(sw * sxx, 1e-300):
        return sy / sw, 0.0
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if a < 0:
        a, b = 0.0, sxy / sxx
    if b < 0:
        a, b = sy / sw, 0.0
    return a, b


@dataclass
class Calibration:
    """Fitted parameters of one device kind running one model (SI units: FLOP/s, bytes/s,
    seconds). ``peak_flops``: a large matmul on the compute role's cores; ``copy_bw``: a
    tensor copy on the memory role's cores. ``points``: the measurements fitted."""

    kind: str
    machine: str
    model: str
    dtype_bytes: int
    peak_flops: float
    copy_bw: float
    mfu_max: float
    b_half: float
    bw_efficiency: float
    latency: float  # one way, per layer (the fixed part of a step is 2 * L * latency)
    net_bw: float
    memory_gb: float
    points: list[StagePoint] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)

    @property
    def mfu(self) -> MfuCurve:
        return MfuCurve(self.mfu_max, self.b_half)

    def device(self) -> Device:
        """This machine as a catalog device (price unknown: 1 USD), both roles allowed."""
        return Device(self.kind, "cpu", 1.0, self.memory_gb, self.copy_bw / 1e9, self.peak_flops / 1e12,
                      self.net_bw * 8 / 1e9, ("compute", "memory"))

    def assumptions(self, micro_batches: int = 1) -> Assumptions:
        return Assumptions(mfu=self.mfu, max_batch=1 << 16, usable_memory=1.0,
                           microbatches=micro_batches, bw_efficiency=self.bw_efficiency)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("points", "validation")},
                "points": [asdict(p) for p in self.points], "validation": self.validation}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        pts = [StagePoint(**p) for p in d.get("points", [])]
        return cls(**{**{k: v for k, v in d.items() if k not in ("points", "validation")},
                      "points": pts, "validation": list(d.get("validation", []))})

    def save(self, directory: str | Path = CONFIG_DIR) -> Path:
        """Write ``<directory>/<kind>.yaml``; returns the path."""
        import yaml

        path = Path(directory) / f"{self.kind}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        head = (f"# Lamina cost-model calibration of device kind {self.kind!r} ({self.machine}) on "
                f"{self.model}.\n# Written by `lamina plan --calibrate`; units SI (FLOP/s, bytes/s, "
                "seconds). See lamina/costmodel/calibration.py.\n")
        path.write_text(head + yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()))


def fit(model: ModelSpec, points: list[StagePoint], *, kind: str, machine: str, peak_flops: float,
        copy_bw: float, memory_gb: float) -> Calibration:
    """Fit the three stage lines (module docstring) to ``points``. ``model.dtype_bytes`` must be
    the served dtype's size (it sets the KV and transfer bytes)."""
    if len({p.batch for p in points}) < 2:
        raise ValueError("calibration needs decode steps at two batch sizes at least")
    d0, d1 = fit_line([p.batch for p in points], [p.dense for p in points])
    kv = [p.batch * p.kv_len * model.kv_bytes_per_token for p in points]
    a0, a1 = fit_line(kv, [p.attention for p in points])
    r0, r1 = fit_line([p.batch * model.transfer_bytes_per_token for p in points],
                      [max(p.other, 1e-9) for p in points])
    if d1 <= 0 or a1 <= 0:
        raise ValueError("dense or attention time does not grow with batch / KV: widen the grid")
    mfu_max = 2 * model.active_params / (peak_flops * d1)
    if mfu_max > 1:  # the slices beat the matmul probe: take the slices' rate as the peak
        peak_flops, mfu_max = 2 * model.active_params / d1, 1.0
    return Calibration(kind, machine, model.name, model.dtype_bytes, peak_flops, copy_bw, mfu_max,
                       d0 / d1, (1 / a1) / copy_bw, (a0 + r0) / (2 * model.layers),
                       1 / r1 if r1 > 0 else math.inf, memory_gb, list(points))


def predict(cal: Calibration, model: ModelSpec, batch: int, kv_len: float) -> tuple[float, float]:
    """``(tbt_s, tokens_per_s)`` the planner predicts for ``batch`` requests at KV length
    ``kv_len`` on one compute and one memory device of this kind, one micro-batch."""
    dev, a = cal.device(), cal.assumptions()
    ctx = max(1, round(kv_len))
    est = offloaded(model, dev, dev, 1, 1, ctx, a, batch=batch)
    cons = Constraints(nic_bw=cal.net_bw if math.isfinite(cal.net_bw) else 1e30, nic_latency=cal.latency)
    cand, _ = evaluate(model, est, 1, cons, a, 1)
    return cand.tbt, cand.throughput


def error_rows(cal: Calibration, model: ModelSpec, measured: list[dict]) -> list[dict]:
    """Predicted vs measured for each ``{"batch", "context", "kv_len", "tbt_s", "tok_s"}``
    row; adds ``pred_tbt_s``, ``pred_tok_s`` and signed relative errors ``tbt_err``,
    ``tok_err`` ((predicted - measured) / measured)."""
    out = []
    for m in measured:
        tbt, tok = predict(cal, model, m["batch"], m["kv_len"])
        out.append({**m, "pred_tbt_s": tbt, "pred_tok_s": tok, "tbt_err": tbt / m["tbt_s"] - 1,
                    "tok_err": tok / m["tok_s"] - 1})
    return out


def cpu_name() -> str:
    """This host's CPU model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_kind(simd: str = "") -> str:
    """A file-name-safe kind for this host's CPU: model words, SIMD level, usable cores,
    e.g. ``cpu-amd-epyc-avx2-2c``."""
    import os

    words = [w for w in re.split(r"[^a-z0-9]+", cpu_name().lower())
             if w and w not in ("processor", "cpu", "core", "tm", "r", "with", "radeon", "graphics")]
    slug = "-".join(words[:4]) or "unknown"
    return "-".join(x for x in ("cpu", slug, simd, f"{len(os.sched_getaffinity(0))}c") if x)


def with_dtype(model: ModelSpec, dtype_bytes: int) -> ModelSpec:
    return replace(model, dtype_bytes=dtype_bytes)
