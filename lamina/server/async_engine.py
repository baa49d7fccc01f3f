"""The engine behind a server: one thread owns the Engine (or a
:class:`~lamina.deployment.deployment.Deployment` of several instances, which answers the same calls:
``add_request``, ``has_work``, ``step``, ``abort``, ``forget``, ``counts``, ``kv_slots``);
asyncio callers submit requests and read their deltas from per-request queues.

Only the engine thread touches the Engine (and through it the compute replica and memory
nodes). Submissions and aborts are commands on a thread-safe queue; results are delivered to
the caller's event loop with ``call_soon_threadsafe``. When the engine fails (a memory node
died), every open request ends with that error and new submissions are refused.

Admission is bounded: at most ``max_open`` requests are open at once (running or waiting);
one more raises :class:`Overloaded` before anything is queued, so the server can answer 429.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from lamina.engine.engine import Engine
from lamina.errors import NoCapacity
if TYPE_CHECKING:
    from lamina.deployment.deployment import Deployment
from lamina.outputs import StreamCursor, StreamDelta
from lamina.engine.request import Request
from lamina.types import SamplingParams

STATS_INTERVAL_S = 1.0


class Overloaded(RuntimeError):
    """Too many open requests: the submission was refused and nothing was queued."""


@dataclass
class EngineMetrics:
    """Counters and samples the engine thread updates; read by /metrics."""

    running: int = 0
    waiting: int = 0
    kv_used_slots: list[int] = field(default_factory=list)
    kv_capacity_slots: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # by kind: instance, memory_node, replica
    prefix_queried_tokens: int = 0  # prefix cache: prompt tokens looked up
    prefix_hit_tokens: int = 0  # of which found cached
    prefix_cached_slots: int = 0  # KV slots the cache holds now
    ttft_s: list[float] = field(default_factory=list)  # drained by the metrics exporter
    tbt_s: list[float] = field(default_factory=list)


@dataclass
class _Stream:
    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cursor: StreamCursor = field(default_factory=StreamCursor)  # what was streamed
    submitted: float = 0.0
    last_token: float = 0.0


class AsyncEngine:
    def __init__(self, engine: Engine | Deployment, tokenizer=None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 max_open: int | None = None) -> None:
        self.engine = engine
        self.max_open = max_open
        self._open = 0  # requests inside generate(); touched by the caller's event loop only
        self.tokenizer = tokenizer
        self.metrics = EngineMetrics(kv_capacity_slots=engine.kv_slots()[1])
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[int, _Stream] = {}
        self._fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lamina-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread / event loop) ---------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Yield deltas of one request; raises ValueError (nothing queued) for a bad request and
        :class:`Overloaded` (nothing queued) when ``max_open`` requests are already open.
        Closing the generator early aborts the request and frees its KV."""
        if self._fatal is not None:
            raise RuntimeError(f"the engine has failed: {self._fatal}")
        if self.max_open is not None and self._open >= self.max_open:
            raise Overloaded(f"the server is at capacity ({self._open} open requests); "
                             "retry later")
        self._open += 1
        inner = self._generate(prompt_ids, params)
        try:
            async for delta in inner:
                yield delta
        finally:
            self._open -= 1
            await inner.aclose()  # runs its abort now, not whenever it is collected

    @property
    def open_requests(self) -> int:
        return self._open

    async def _generate(self, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("add", prompt_ids, params, loop, q, fut))
        req = await fut  # raises the ValueError of add_request
        try:
            while True:
                delta = await q.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.finished and delta.finish_reason == "error":  # its instance failed
                    raise RuntimeError(f"the request failed: {delta.error}")
                yield delta
                if delta.finished:
                    return
        finally:
            if not req.finished:
                self._cmds.put(("abort", req))

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self._fatal is None and self._thread.is_alive()

    @property
    def recovering(self) -> bool:
        """Whether an instance is being restarted now (a role died; the engine thread is busy
        starting its replacement)."""
        return getattr(self.engine, "recovering", 0) > 0

    @property
    def serving(self) -> bool:
        """Whether some instance can take requests now (False while every one lost a role
        and its restarts are being retried)."""
        instances = getattr(self.engine, "instances", None)  # a Deployment; an Engine: serving
        return instances is None or any(x.failed is None for x in instances)

    # -- engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_work())
                if self._stop.is_set():
                    break
                if not self.serving:  # capacity was lost: retry restarts, idle or not
                    self.engine.revive()
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                if time.monotonic() >= next_stats:
                    self._update_stats()
                    next_stats = time.monotonic() + STATS_INTERVAL_S
            except BaseException as e:  # a dead node or a bug: fail every open request
                self._fail(e)
                return

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=STATS_INTERVAL_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, prompt_ids, params, loop, q, fut = cmd
            try:
                req = self.engine.add_request(prompt_ids, params)
            except (ValueError, NoCapacity) as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
                return
            now = time.monotonic()
            self._streams[req.req_id] = _Stream(req, loop, q, submitted=now)
            self.metrics.prompt_tokens += len(prompt_ids)
            loop.call_soon_threadsafe(_set_result, fut, req)
        elif cmd[0] == "abort":
            req = cmd[1]
            self.engine.abort(req, RuntimeError("aborted by the client"))
            self._streams.pop(req.req_id, None)
            self.engine.forget(req.req_id)

    def _deliver(self, step) -> None:
        now = time.monotonic()
        touched = set(step.new_tokens) | {r.req_id for r in step.finished}
        for rid in touched:
            st = self._streams.get(rid)
            if st is None:
                continue
            req = st.req
            if rid in step.new_tokens:
                self.metrics.generated_tokens += 1
                if st.cursor.tokens == 0 and not st.last_token:
                    self.metrics.ttft_s.append(now - st.submitted)
                else:
                    self.metrics.tbt_s.append(now - st.last_token)
                st.last_token = now
            new_ids, delta = st.cursor.advance(req, self.tokenizer)
            if req.finished:
                self._streams.pop(rid, None)
                self.engine.forget(rid)
                reason = req.finish_reason or "stop"
                self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
            st.loop.call_soon_threadsafe(st.queue.put_nowait, StreamDelta(
                rid, 0, new_ids, delta, req.finished, req.finish_reason, req.error,
                req.num_cached_tokens or 0))

    def _update_stats(self) -> None:
        self.metrics.running, self.metrics.waiting = self.engine.counts()
        self.metrics.kv_used_slots, self.metrics.kv_capacity_slots = self.engine.kv_slots()
        m = self.metrics
        m.prefix_queried_tokens, m.prefix_hit_tokens, m.prefix_cached_slots = \
            self.engine.prefix_stats()
        d = self.engine
        self.metrics.restarts = {"instance": getattr(d, "instance_restarts", 0),
                                 "memory_node": getattr(d, "node_restarts", 0),
                                 "replica": getattr(d, "replica_restarts", 0)}

    def _fail(self, e: BaseException) -> None:
        self._fatal = e
        err = RuntimeError(f"the engine has failed: {e}")
        for st in self._streams.values():
            st.loop.call_soon_threadsafe(st.queue.put_nowait, err)
        self._streams.clear()
        while True:  # refuse what is still queued
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[3].call_soon_threadsafe(_set_exception, cmd[5], err)
        if self._on_fatal is not None:
            self._on_fatal(e)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
