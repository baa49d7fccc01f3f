"""Requests and their KV placement (pure Python, no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lamina.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ShardPlacement:
    """Positions ``start .. start+length-1`` of a request live on memory node ``node``."""

    node: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class Request:
    """One generation request.

    ``num_computed`` tokens of ``all_ids`` have their KV stored on memory nodes (in ``shards``,
    contiguous and ordered by position). A request whose KV was dropped by preemption goes back
    to WAITING with ``num_computed = 0`` and recomputes prompt + outputs so far (recompute
    preemption: nothing is lost, and already sampled tokens are not sampled again).

    With prefix caching, the first ``num_cached`` positions of its first shard are a cached
    prefix whose slots the prefix cache owns (the path ending at ``cache_last``, a
    :class:`~lamina.engine.prefix_cache.CacheNode`, locked while the request holds it);
    ``num_cached_tokens``: the prompt tokens its first admission found cached.
    """

    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    shards: list[ShardPlacement] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: Exception | None = None
    num_preemptions: int = 0
    max_shards: int = 0  # most memory nodes its KV ever spanned at once
    num_cached: int = 0
    cache_last: Any = None
    num_cached_tokens: int | None = None
    decoded: Any = None  # its output's text so far, for stop strings (an IncrementalText)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: Exception | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
