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
