"""How many micro-batches the engine keeps in flight, chosen by timing decode with each.

Two micro-batches on one compute replica overlap one's dense slices with the other's attention
on the memory nodes, but stream the weights twice a step. That pays where attention is a large
share of a step (long contexts, many requests) and costs where it is small. Which holds depends
on the batch, the contexts (which grow as requests decode), the machine and the placement, so
:class:`MicroBatchChoice` measures it: it times decode with each candidate count in turn, keeps
the faster, and times both again every so often. Prefill runs with the first candidate (the
configured count): its chunks overlap with the other micro-batch's attention too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MicroBatchChoice"]


@dataclass
class MicroBatchChoice:
    """Chooses between ``candidates`` (micro-batch counts, e.g. ``(2, 1)``; the first runs
    prefill, is timed first and wins ties) by decode tokens per second.

    A timing window is ``window`` rounds of the count being timed (a round: one completion per
    micro-batch), after the completions that may still belong to the count before. A completion
    with prefill rows (whose tokens are not decode tokens) hands the engine to the first
    candidate until two rounds of it complete with decode rows only; then the window being
    timed starts again. Once every candidate has a rate, the fastest runs for ``keep`` windows'
    worth of its completions, then all are timed again (contexts grow, requests come and go):
    ``keep`` doubles each time the timing confirms the choice (up to ``max_keep``) and starts
    over when it changes. ``rates``: the last rate measured for each count, tokens/s."""

    candidates: tuple[int, ...]
    window: int = 4
    keep: int = 16
    max_keep: int = 64
    rates: dict[int, float] = field(default_factory=dict)
    current: int = 0  # the count in use
    best: int | None = None  # the count the last timing chose
    _queue: list[int] = field(default_factory=list)  # counts still to time, the one timed first
    _keep: int = 0  # keep, as doubled so far
    _left: int = 0  # completions still to run ``best`` before timing again
    _prefill: bool = False  # prefill seen; the first candidate runs until decode settles
    _streak: int = 0  # decode-only completions in a row during prefill
    _settle: int = 0  # completions to skip before the window starts
    _start: float | None = None
    _tokens: int = 0
    _done: int = 0

    def __post_init__(self) -> None:
        if not self.candidates or min(self.candidates) < 1:
            raise ValueError(f"micro-batch counts must be >= 1, got {self.candidates}")
        self.current, self._keep = self.candidates[0], self.keep
        self._time(list(self.candidates))

    def record(self, tokens: int, decode_only: bool, now: float) -> None:
        """One micro-batch completed at ``now`` (seconds, monotonic) and sampled ``tokens``;
        ``decode_only``: each of its rows decoded one token (no prefill chunk)."""
        if not decode_only or self._prefill:
            self._streak = self._streak + 1 if decode_only else 0
            if not self._prefill:
                self._prefill = True
                self._use(self.candidates[0])
            elif self._streak >= 2 * self.candidates[0]:  # decoding again
                self._prefill = False
                self._use(self._queue[0] if self._queue else self.best)
            return
        if not self._queue:
            self._left -= 1
            if self._left <= 0:  # time every count again, the chosen one first
                self._time([self.best] + [c for c in self.candidates if c != self.best])
            return
        if self._settle > 0:
            self._settle -= 1
            if self._settle == 0:
                self._start, self._tokens, self._done = now, 0, 0
            return
        self._tokens += tokens
        self._done += 1
        if self._done < self.window * self.current or now <= self._start:
            return
        self.rates[self.current] = self._tokens / (now - self._start)
        self._queue.pop(0)
        if self._queue:
            self._use(self._queue[0])
            return
        best = max(self.candidates, key=lambda c: (self.rates[c], -self.candidates.index(c)))
        self._keep = self.keep if best != self.best else min(2 * self._keep, self.max_keep)
        self.best, self._left = best, self._keep * self.window * best
        self._use(best)

    def _time(self, counts: list[int]) -> None:
        self._queue = counts
        self._use(counts[0])

    def _use(self, count: int) -> None:
        """Run ``count`` from the next fill; completions of micro-batches formed before a
        change are not timed (one completion is skipped even without one)."""
        self._settle = max(self.current, count) if count != self.current else 1
        self._start = None
        self.current = count
