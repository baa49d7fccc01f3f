"""The replica core: micro-batches through the slices of a split model on the compute replicas
of one process, written once for every placement.

A micro-batch's slice ``k`` runs on replica ``replica_for(schedule, j, k, N)``
(:mod:`lamina.computenode.schedule`). A :class:`SliceRunner` holds the replicas of its process
(``replicas``: index -> :class:`ComputeReplica`; all ``N`` in the engine's process, one in a
replica process) and knows no transport: a driver feeds it (:meth:`SliceRunner.start`,
:meth:`~SliceRunner.on_context`, :meth:`~SliceRunner.on_result`) and delivers what it emits
through a :class:`~lamina.computenode.microbatch.Port`: PREPAREs and ATTENDs for memory nodes,
a micro-batch's context for the next replica (when that replica lives elsewhere), the tokens
of a finished micro-batch.

Drivers: :class:`lamina.computenode.server.ReplicaServer` (a replica process or actor: inbox of
channel messages) and :class:`lamina.instance.inproc.InProcessReplicas` (the engine's process:
in-process memory nodes). See ``docs/architecture.md`` for one iteration end to end.

A slice is ready when its context is here and, past slice 0, every ATTEND part of the previous
layer has its RESULT. Running it merges those results exactly (log-sum-exp), runs the slice
(or lands it, pre-launched behind a device flag: :mod:`lamina.computenode.polling`), then sends
the layer's ATTENDs with ``reply_to`` the peer id of the replica that runs the next slice, or
samples after the last slice. A lone micro-batch whose node's ATTEND C++ can call (a plane in
this process, a ring to the node's process) runs its whole step in one C++ call instead
(:meth:`ComputeReplica.run_step`, which stamps each slice and exchange while a timeline
records). Timeline spans (compute: ``slice k``, ``send``, ``recv`` (the merge; in one C++
call, from the RESULT's arrival to the next slice), ``slice k + sample``; memory: ``attend
k``) go to the ``span`` callback.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from lamina.computenode.attend import attend_messages, join_results, merge_results
from lamina.computenode.microbatch import MicroBatch, Port, Span
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.schedule import replica_for
from lamina.config import PipelineConfig
from lamina.splitter.slices import ATTN_OUT
from lamina.types import AttendMsg, AttendResult, NativeExchange, PrepareMsg


class SliceRunner:
    """Micro-batches on ``replicas`` under ``pipeline``; see the module docstring.

    ``mbs``: step id -> micro-batch, in age order. ``peer_base`` + replica index is a replica's
    peer id on the memory nodes (``reply_to``). ``polling``: pre-launch each next slice that
    stays here (:func:`lamina.computenode.polling.make_polling`; None: off). ``step_graphs``:
    replica index -> its whole-step graphs (:mod:`lamina.computenode.step_graphs`), which run
    every step they hold; ``serve`` polls the mailboxes of nodes in this process while one
    runs (None: the nodes poll their own)."""

    def __init__(self, replicas: dict[int, ComputeReplica], pipeline: PipelineConfig, port: Port,
                 *, peer_base: int = 0, polling=None, span: Span | None = None,
                 step_graphs: dict | None = None, serve: Callable[[], bool] | None = None) -> None:
        self.replicas = replicas
        self.pipeline = pipeline
        self.port = port
        self.peer_base = peer_base
        self.polling = polling
        self.step_graphs = step_graphs or {}
        self.serve = serve
        self.span = span
        self.mbs: dict[int, MicroBatch] = {}
        self.waiting: dict[int, MicroBatch] = {}  # ATTENDs out, results not all used: by ``sent``
        self._all_here = len(replicas) == pipeline.replicas  # every slice runs in this process
        self._sent = itertools.count()
        self._whole: dict[int, int | None] = {}  # slot -> the replica running all its slices

    def replica_of(self, mb: MicroBatch, k: int) -> int:
        """The replica that runs slice ``k`` of ``mb``."""
        p = self.pipeline
        return replica_for(p.schedule, mb.slot, k, p.replicas)

    # -- inputs ---------------------------------------------------------------------------------
    def start(self, mb: MicroBatch) -> None:
        """Take ``mb``; where slice 0 runs here, send its PREPAREs and make its context."""
        self.mbs[mb.step_id] = mb
        first = self.replica_of(mb, 0)
        if first in self.replicas:
            for route in mb.routes:
                self.port.to_node(route.node, PrepareMsg(mb.step_id, route.works))
            mb.values, mb.k = self.replicas[first].begin(mb.plan), 0

    def on_context(self, mb: MicroBatch, k: int, values: dict[str, torch.Tensor],
                   parts: list[int]) -> None:
        """``mb``'s context for slice ``k``, from the replica that ran slice ``k-1``."""
        mb.values, mb.k, mb.parts = values, k, list(parts)

    def on_result(self, mb: MicroBatch, route: int, result: AttendResult) -> None:
        """One RESULT of ``mb`` from the node of ``mb.routes[route]``, for ``result.layer``."""
        per_route = mb.results.setdefault(result.layer, [[] for _ in mb.routes])
        per_route[route].append(result)
        mb.received_ns = time.perf_counter_ns()

    def drop(self, step_id: int) -> MicroBatch | None:
        """Forget a micro-batch; a slice pre-launched for it runs on garbage so its stream moves."""
        mb = self.mbs.pop(step_id, None)
        if mb is not None:
            self.waiting.pop(mb.sent, None)
            if mb.ahead is not None:
                self.polling.release(mb.ahead)
                mb.ahead = None
        return mb

    # -- running --------------------------------------------------------------------------------
    def ready(self, mb: MicroBatch) -> bool:
        if mb.values is None or not (self._all_here or self.replica_of(mb, mb.k) in self.replicas):
            return False
        if mb.k == 0:
            return True
        got = mb.results.get(mb.k - 1)
        return got is not None and [len(p) for p in got] == mb.parts

    def outstanding(self) -> MicroBatch | None:
        """The micro-batch whose ATTENDs went out first and whose slice has not run on their
        results yet (with none ready, the one at the head of every node's queue)."""
        return next(iter(self.waiting.values()), None)

    def next_ready(self) -> MicroBatch | None:
        """The oldest micro-batch with a slice ready to run here."""
        return next((mb for mb in self.mbs.values() if self.ready(mb)), None)

    def run_ready(self) -> None:
        """Run ready slices, oldest micro-batch first, until none is ready."""
        while (mb := self.next_ready()) is not None:
            self.run(mb)

    def run(self, mb: MicroBatch) -> None:
        """Run (or, pre-launched, land) slice ``mb.k`` on its replica, then send its ATTENDs,
        or sample and hand the tokens to the engine. With polling, all of a micro-batch's
        device work runs on its slot's stream."""
        if self.polling is None:
            self._run(mb)
        else:
            with self.polling.stream(mb.slot):
                self._run(mb)

    def _run(self, mb: MicroBatch) -> None:
        if mb.k == 0 and self.step_graphs and self._run_graph(mb):
            return
        got = None  # layer k-1's RESULT, waited for in place (a lone micro-batch, one node)
        if mb.k == 0 and (native := self._native_step(mb)) is not None:
            got = self._run_step(mb, *native)
            if got is None:
                return
        while True:
            got = self._run_one(mb, got)
            if got is None:
                return

    def _lone(self, mb: MicroBatch) -> bool:
        """Whether ``mb`` is alone here with one ATTEND of every row a layer, and the engine says
        so (``plan.alone``: else another may arrive while it waits in place, and run after it)."""
        if not mb.plan.alone or len(self.mbs) != 1 or self.polling is not None \
                or len(mb.routes) != 1:
            return False
        route = mb.routes[0]
        return route.span == (0, mb.plan.num_tokens) \
            and (self.pipeline.attn_parts <= 1 or len(route.works) == 1)

    def _native_step(self, mb: MicroBatch) -> tuple[int, NativeExchange] | None:
        """Where and how ``mb``'s whole step runs in one C++ call
        (:meth:`ComputeReplica.run_step`): the replica and its node's exchange, or None. It
        needs a lone micro-batch whose slices all run on one replica here that has the chained
        program, its node's ATTEND callable from C++."""
        if not self._lone(mb):
            return None
        here = self._whole_step_replica(mb.slot)
        if here is None or self.replicas[here].step is None:
            return None
        exchange = self.port.native_exchange(mb.routes[0].node, self.peer_base + here)
        return None if exchange is None else (here, exchange)

    def _whole_step_replica(self, slot: int) -> int | None:
        """The replica here that runs every slice of ``slot``'s micro-batches, or None; the
        schedule is fixed per slot, so the answer is kept."""
        if slot not in self._whole:
            p = self.pipeline
            here = replica_for(p.schedule, slot, 0, p.replicas)
            replica = self.replicas.get(here)
            self._whole[slot] = here if replica is not None and all(
                replica_for(p.schedule, slot, k, p.replicas) == here
                for k in range(1, len(replica.split.slices))) else None
        return self._whole[slot]

    def _run_step(self, mb: MicroBatch, here: int, exchange: NativeExchange
                  ) -> AttendResult | None:
        """``mb``'s step on replica ``here`` by one C++ call from slice 0; where a layer's
        exchange declined, its ATTEND goes out as :meth:`_run_one`'s do (the RESULT where it
        was waited for)."""
        replica = self.replicas[here]
        stamps = replica.step_stamps() if self.span is not None else None
        try:
            try:
                k, sent, context, qkv, logits = replica.run_step(mb.step_id, mb.values, exchange,
                                                                 stamps)
            finally:
                exchange.done()
            tokens = self._tokens(replica, mb, context, logits)
        except Exception as e:  # noqa: BLE001 -- this micro-batch fails; the others go on
            return self._fail(mb, e)
        mb.k = k
        if stamps is not None:
            self._step_spans(mb, here, stamps[:k + 1].tolist(), tokens is not None)
        return self._then(mb, here, context, qkv, tokens, sent)

    def _run_graph(self, mb: MicroBatch) -> bool:
        """``mb``'s whole step as one graph launch (:mod:`lamina.computenode.step_graphs`),
        sampled and handed to the engine; False where no graph holds it (nothing was done)."""
        here = self._whole_step_replica(mb.slot)
        graphs = self.step_graphs.get(here) if here is not None else None
        if graphs is None or not graphs.holds(mb.plan, mb.routes):
            return False
        replica = self.replicas[here]
        t0 = time.perf_counter_ns()
        try:
            logits = graphs.run(mb.slot, mb.plan, mb.routes, self.serve)
            tokens = replica.sample(logits, mb.req_ids, mb.params, mb.uniforms).tolist()
        except Exception as e:  # noqa: BLE001 -- this micro-batch fails; the others go on
            self._fail(mb, e)
            return True
        if self.span is not None:
            self.span("compute", here, "step (graph) + sample", t0, time.perf_counter_ns(), mb)
        del self.mbs[mb.step_id]
        mb.values, mb.sent = None, -1
        self.port.to_engine(mb, tokens)
        return True

    def _step_spans(self, mb: MicroBatch, here: int, stamps: list[list[int]],
                    sampled: bool) -> None:
        """The timeline of a step run in one C++ call, from its stamps: each layer answered in
        C++ as ``slice j``, ``send``, memory ``attend j``, ``recv``; the last row's slice alone
        (its sends are :meth:`_then`'s)."""
        node = mb.routes[0].node
        for j, (start, end, sent, n0, n1, back) in enumerate(stamps):
            if j == len(stamps) - 1:
                self.span("compute", here, f"slice {j}" + (" + sample" if sampled else ""),
                          start, time.perf_counter_ns() if sampled else end, mb)
                return
            self.span("compute", here, f"slice {j}", start, end, mb)
            self.span("compute", here, "send", end, sent, mb)
            if n0:
                mb.sent_ns, mb.received_ns = sent, back
                self.span("memory", node, f"attend {j}", n0, n1, mb)
            self.span("compute", here, "recv", back, stamps[j + 1][0], mb)

    def _run_one(self, mb: MicroBatch, got: AttendResult | None) -> AttendResult | None:
        """Slice ``mb.k`` (on ``got``, else on the filed results), then its sends; the RESULT of
        its ATTEND where it was waited for in place (then the next slice runs at once)."""
        k = mb.k
        here = self.replica_of(mb, k)
        replica = self.replicas[here]
        ahead, mb.ahead = mb.ahead, None
        self.waiting.pop(mb.sent, None)
        t0 = time.perf_counter_ns()
        try:
            o = None
            if k > 0:
                o = self._merge(mb, here, got)
                if ahead is None:
                    mb.values[ATTN_OUT] = o
            t1 = time.perf_counter_ns()
            if ahead is not None:  # enqueued when the ATTENDs went out: land o, release it
                context, qkv, logits = self.polling.land(ahead, o)
            else:
                context, qkv, logits = replica.run_slice(k, mb.values)
            tokens = self._tokens(replica, mb, context, logits)
        except Exception as e:  # noqa: BLE001 -- this micro-batch fails; the others go on
            return self._fail(mb, e)
        t2 = time.perf_counter_ns()
        if self.span is not None:
            if k > 0:
                self.span("compute", here, "recv", t0, t1, mb)
            self.span("compute", here, f"slice {k}" + (" + sample" if tokens is not None else "")
                      + (" (landed)" if ahead is not None else ""), t1, t2, mb)
        return self._then(mb, here, context, qkv, tokens)

    @staticmethod
    def _tokens(replica: ComputeReplica, mb: MicroBatch, context, logits) -> list[int] | None:
        """The sampled tokens after the last slice (``context`` None), else None."""
        if context is not None:
            return None
        return replica.sample(logits, mb.req_ids, mb.params, mb.uniforms).tolist()

    def _fail(self, mb: MicroBatch, error: Exception) -> None:
        self.drop(mb.step_id)
        self.port.failed(mb, error)

    def _then(self, mb: MicroBatch, here: int, context: dict[str, torch.Tensor] | None,
              qkv: tuple | None, tokens: list[int] | None,
              sent: bool = False) -> AttendResult | None:
        """After slice ``mb.k`` ran on replica ``here``: the tokens to the engine (the last
        slice), else the layer's ATTENDs out (``sent``: its one ATTEND is out already, by a
        native exchange) and the context to the next slice's replica. The RESULT where it was
        waited for in place (:meth:`Port.exchange`, :meth:`Port.collect`)."""
        k, plan = mb.k, mb.plan
        t2 = time.perf_counter_ns()
        if tokens is not None:
            del self.mbs[mb.step_id]
            mb.values, mb.sent = None, -1
            self.port.to_engine(mb, tokens)
            return None
        nxt = self.replica_of(mb, k + 1)
        reply_to, got = self.peer_base + nxt, None
        if nxt == here and self._lone(mb):
            # one ATTEND of every row, and nothing else can run here before its RESULT: send
            # it and wait for the RESULT in place
            parts = [1]
            if sent:
                sent_ns, got = t2, self.port.collect(mb.routes[0].node, plan.step_id, k)
            else:
                sent_ns, got = self.port.exchange(mb.routes[0].node,
                                                  AttendMsg(plan.step_id, k, *qkv, reply_to))
        else:
            msgs = attend_messages(plan.step_id, k, mb.routes, *qkv, reply_to=reply_to,
                                   parts=self.pipeline.attn_parts)
            for route, route_msgs in zip(mb.routes, msgs):
                for m in route_msgs:
                    self.port.to_node(route.node, m)
            parts = [len(m) for m in msgs]
            sent_ns = time.perf_counter_ns()
        mb.sent, mb.sent_ns = next(self._sent), sent_ns
        if got is None:
            self.waiting[mb.sent] = mb
        if nxt in self.replicas:
            mb.values, mb.k, mb.parts = context, k + 1, parts
            if self.polling is not None:
                self._prelaunch(mb, nxt, qkv[0])
        else:
            mb.values = None
            self.port.to_next(mb, context, parts)
        if self.span is not None:
            self.span("compute", here, "send", t2, mb.sent_ns, mb)
        if got is not None:
            mb.received_ns = time.perf_counter_ns()
        return got

    # -- internals -------------------------------------------------------------------------------
    def _merge(self, mb: MicroBatch, here: int, got: AttendResult | None) -> torch.Tensor:
        """Layer ``k-1``'s attention output ``o[T,H,Dv]`` from every node's RESULTs (``got``:
        the one RESULT of a lone micro-batch, waited for in place; else the filed ones)."""
        results = mb.results.pop(mb.k - 1) if got is None else [[got]]
        if self.span is not None:
            for route, parts in zip(mb.routes, results):
                for i, res in enumerate(parts):
                    if res.span_ns:
                        self.span("memory", route.node, f"attend {mb.k - 1}" +
                                  (f".{i}" if len(parts) > 1 else ""), *res.span_ns, mb)
        return merge_results(mb.routes, [join_results(p) for p in results],
                             mb.plan.num_tokens).contiguous()

    def _prelaunch(self, mb: MicroBatch, replica: int, q: torch.Tensor) -> None:
        """Enqueue slice ``mb.k`` now, reading an attention output not yet here (polling)."""
        k, values, run_slice = mb.k, mb.values, self.replicas[replica].run_slice

        def run(o: torch.Tensor):
            return run_slice(k, {**values, ATTN_OUT: o})

        try:
            mb.ahead = self.polling.prelaunch(mb.slot, q, run)
        except Exception as e:  # noqa: BLE001
            self._fail(mb, e)
