"""A timeline of a run as Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

Spans are complete events (``ph: "X"``) on tracks: one process per role ("compute", "memory"),
one thread per replica or node. Times are ``time.perf_counter_ns`` values (CLOCK_MONOTONIC, the
same clock in every process on one host), written in microseconds from the first span.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("compute", "memory")


@dataclass
class Span:
    role: str  # "compute" or "memory"
    track: int  # replica or node index
    name: str  # e.g. "slice 3", "attend 2", "send", "recv"
    start_ns: int
    end_ns: int
    args: dict = field(default_factory=dict)


class Timeline:
    """Collects spans; :meth:`save` writes the trace file. Not thread-safe (one driver)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, role: str, track: int, name: str, start_ns: int, end_ns: int, **args) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown timeline role {role!r}; expected one of {ROLES}")
        self.spans.append(Span(role, track, name, int(start_ns), int(max(end_ns, start_ns)),
                               args))

    def to_chrome(self) -> dict:
        t0 = min((s.start_ns for s in self.spans), default=0)
        events: list[dict] = []
        tracks = sorted({(s.role, s.track) for s in self.spans})
        for role in ROLES:
            events.append({"ph": "M", "name": "process_name", "pid": ROLES.index(role),
                           "args": {"name": role}})
        for role, track in tracks:
            label = "replica" if role == "compute" else "memory node"
            events.append({"ph": "M", "name": "thread_name", "pid": ROLES.index(role),
                           "tid": track, "args": {"name": f"{label} {track}"}})
        for s in self.spans:
            events.append({"ph": "X", "name": s.name, "pid": ROLES.index(s.role), "tid": s.track,
                           "ts": (s.start_ns - t0) / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3,
                           "args": s.args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    def busy_fraction(self, role: str, track: int, names: tuple[str, ...] = ()) -> float:
        """Fraction of the timeline's extent that ``role/track`` spends in spans (whose names
        start with one of ``names``, when given)."""
        if not self.spans:
            return 0.0
        t0 = min(s.start_ns for s in self.spans)
        t1 = max(s.end_ns for s in self.spans)
        busy = sum(s.end_ns - s.start_ns for s in self.spans
                   if s.role == role and s.track == track
                   and (not names or s.name.startswith(names)))
        return busy / max(t1 - t0, 1)

    # span name prefix -> stage, per role (the rest of a track's wall time is "idle")
    STAGES = {"compute": {"slice": "dense", "send": "transfer", "recv": "transfer"},
              "memory": {"attend": "attention"}}

    def stage_seconds(self, start_ns: int, end_ns: int) -> list[dict]:
        """Seconds per stage for every (role, track), spans clipped to ``[start_ns, end_ns]``:
        compute ``dense`` (slices and sampling) and ``transfer`` (building and sending ATTENDs,
        merging results), memory ``attention`` (ATTEND kernels), and each track's ``idle`` (the
        rest of the window) and ``wall``. One dict per track, ``role`` = ``"compute 0"`` ..."""
        tracks: dict[tuple[str, int], dict[str, float]] = {}
        for sp in self.spans:
            kind = self.STAGES.get(sp.role, {}).get(sp.name.split()[0])
            lo, hi = max(sp.start_ns, start_ns), min(sp.end_ns, end_ns)
            t = tracks.setdefault((sp.role, sp.track), {})
            if kind is not None and hi > lo:
                t[kind] = t.get(kind, 0.0) + (hi - lo) / 1e9
        wall = (end_ns - start_ns) / 1e9
        out = []
        for (role, track), t in sorted(tracks.items()):
            busy = sum(t.values())
            out.append({"role": f"{role} {track}", **{k: round(v, 6) for k, v in t.items()},
                        "idle": round(max(0.0, wall - busy), 6), "wall": round(wall, 6)})
        return out
