"""Prometheus exposition of :class:`~lamina.server.async_engine.EngineMetrics` (``/metrics``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _count_on(counter, now: int, seen: int) -> None:
    """Advance a Prometheus counter by what an engine count gained since it was last seen; a
    count that went down (reset) is counted on from its new value, never subtracted."""
    counter.inc(max(0, now - seen))


class MetricsExporter:
    """One app's Prometheus registry. It folds one :class:`EngineMetrics` into it (counters
    advance by what the engine counted since the last render; an engine count that went down,
    reset by a restart or put back by a test, is counted on from its new value, never
    subtracted); each app owns its exporter, so two engines in one process never share what
    was seen."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("lamina_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("lamina_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_used = Gauge("lamina_kv_slots_used", "KV slots in use", ["node"], registry=r)
        self.kv_cap = Gauge("lamina_kv_slots_capacity", "KV slots in total", ["node"], registry=r)
        self.gen = Counter("lamina_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("lamina_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.finished = Counter("lamina_requests_finished", "Finished requests", ["reason"],
                                registry=r)
        self.ttft = Histogram("lamina_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("lamina_time_between_tokens_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.restarts = Counter("lamina_restarts", "Restarts after a role died, by what was "
                                "restarted (instance, memory_node, replica)", ["kind"], registry=r)
        self.prefix_queries = Counter("lamina_prefix_cache_queried_tokens", "Prompt tokens looked "
                                      "up in the prefix cache", registry=r)
        self.prefix_hits = Counter("lamina_prefix_cache_hit_tokens", "Prompt tokens found in the "
                                   "prefix cache (their prefill was skipped)", registry=r)
        self.prefix_slots = Gauge("lamina_prefix_cache_slots", "KV slots the prefix cache holds",
                                  registry=r)
        self._seen = {"gen": 0, "prompt": 0, "pq": 0, "ph": 0}
        self._restarts_seen: dict[str, int] = {}
        self._finished_seen: dict[str, int] = {}

    def render(self, m) -> bytes:
        """Fold the engine's counters and latency samples (an ``EngineMetrics``) into the
        metrics and render them."""
        self.running.set(m.running)
        self.waiting.set(m.waiting)
        for i, (used, cap) in enumerate(zip(m.kv_used_slots, m.kv_capacity_slots)):
            self.kv_used.labels(node=str(i)).set(used)
            self.kv_cap.labels(node=str(i)).set(cap)
        _count_on(self.gen, m.generated_tokens, self._seen["gen"])
        _count_on(self.prompt, m.prompt_tokens, self._seen["prompt"])
        for kind, n in m.restarts.items():
            _count_on(self.restarts.labels(kind=kind), n, self._restarts_seen.get(kind, 0))
            self._restarts_seen[kind] = n
        # an instance restarted whole starts its cache's counts again: count on from there
        _count_on(self.prefix_queries, m.prefix_queried_tokens, self._seen["pq"])
        _count_on(self.prefix_hits, m.prefix_hit_tokens, self._seen["ph"])
        self.prefix_slots.set(m.prefix_cached_slots)
        self._seen.update(gen=m.generated_tokens, prompt=m.prompt_tokens,
                          pq=m.prefix_queried_tokens, ph=m.prefix_hit_tokens)
        for reason, n in list(m.finished.items()):
            _count_on(self.finished.labels(reason=reason), n, self._finished_seen.get(reason, 0))
            self._finished_seen[reason] = n
        for samples, hist in ((m.ttft_s, self.ttft), (m.tbt_s, self.tbt)):
            while samples:
                hist.observe(samples.pop())
        return generate_latest(self.registry)
