"""Cluster borrowing across memory pools: the control plane (Infinite-LLM §5-6).

Every instance (engine + memory pool) has an :class:`RManager`; one :class:`GManager` (a Ray
actor via :func:`start_gmanager`, or a plain object in this process) keeps the request placement
map and brokers KV space between pools. Only plain dataclasses cross this boundary.

* **Heartbeats.** An rManager sends the :class:`RequestPlacementEntry` values that changed since
  its last heartbeat, plus its :class:`InstanceLoad`. A gManager that does not know the instance
  (it restarted) answers ``resync`` and the rManager sends its full state.
* **Reservations.** Before any KV moves, the source calls :meth:`GManager.try_move_kvcache`
  (move ``num_slabs`` of a request to ``dst``) or :meth:`GManager.try_borrow` (reactive: room for
  a request that outgrew its pool, on any creditor). Calls are served one at a time, first come
  first served; one is granted only if the destination's free slabs (``total - used - pending
  reservations``) cover it, so reservations never over-commit. A move whose request placement
  version is stale (the request grew, moved or finished since the command was planned) is
  rejected, and no data moves. A granted reservation stays pending until the destination's
  heartbeat acknowledges it (its slabs are then in that instance's ``used_slabs``) or the source
  aborts it.
* **Placement.** :meth:`GManager.plan` runs the greedy placement (Infinite-LLM Algorithm 1):
  debtors are instances with batch size <= ``beta_thres`` and memory use > ``util_thres``;
  creditors have memory use <= ``util_thres`` (never both). A debtor's longest requests move
  slabs to the creditor with the most free slabs while the :class:`PerfModel` says the debtor's
  throughput improves and the moved attention stays hidden under its local compute.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RequestPlacementEntry:
    """``num_slabs`` slabs of request ``req_id`` live in instance ``inst_id``'s pool; ``local`` when
    that instance is the request's home (it runs the request), False for a borrowed shard."""

    req_id: int
    inst_id: int
    num_slabs: int
    local: bool


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load: running requests, queued ones, and its own pool's slabs (``used``
    counts slabs lent to others and granted reservations it has acknowledged)."""

    inst_id: int
    batch_size: int
    waiting: int
    total_slabs: int
    used_slabs: int

    @property
    def util(self) -> float:
        return self.used_slabs / self.total_slabs if self.total_slabs else 1.0


@dataclass
class Heartbeat:
    """From an rManager: entries at ``inst_id`` that are new or changed, req_ids whose entry at
    ``inst_id`` is gone, reservations now counted in ``load.used_slabs``; ``full``: the whole
    state (after a gManager restart)."""

    inst_id: int
    load: InstanceLoad
    changed: list[RequestPlacementEntry] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    full: bool = False


@dataclass(frozen=True)
class HeartbeatReply:
    resync: bool  # the gManager does not know this instance: send a full heartbeat


@dataclass(frozen=True)
class MoveCommand:
    """Move ``num_slabs`` slabs of ``req_id`` from instance ``src`` (its home) to ``dst``;
    ``version`` is the request's placement version the plan saw."""

    req_id: int
    src: int
    dst: int
    num_slabs: int
    version: int


@dataclass(frozen=True)
class Reservation:
    """Space granted at ``dst`` for ``src``'s request ``req_id`` (None: reactive borrowing)."""

    res_id: int
    src: int
    dst: int
    num_slabs: int
    req_id: int | None = None


@dataclass
class PerfModel:
    """Per-layer decode time of an instance (Infinite-LLM §6): ``T_lyr = W(β)/f(β) + Σ_r S_r/g(S)``.

    ``compute_s(β)`` (the dense part at batch β) and ``attn_s(S)`` (one request of context S)
    interpolate measured points linearly and extrapolate the last segment.
    """

    batch_points: list[int]
    compute_points_s: list[float]
    context_points: list[int]
    attn_points_s: list[float]

    @staticmethod
    def _interp(x: float, xs: list[int], ys: list[float]) -> float:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        if x > xs[-1]:  # extrapolate the last segment
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (x - xs[-1])
        return float(np.interp(x, xs, ys))

    def compute_s(self, batch: int) -> float:
        return max(self._interp(batch, self.batch_points, self.compute_points_s), 0.0)

    def attn_s(self, context: int) -> float:
        return max(self._interp(context, self.context_points, self.attn_points_s), 0.0)

    def layer_s(self, batch: int, contexts: list[int]) -> float:
        return self.compute_s(batch) + sum(self.attn_s(s) for s in contexts)

    def throughput(self, batch: int, contexts: list[int]) -> float:
        """Tokens per second per layer-time unit for ``batch`` requests of ``contexts``."""
        return batch / self.layer_s(batch, contexts) if batch else 0.0


class GManager:
    """The global manager: placement map, loads, reservations, greedy placement. Plain state and
    methods; :func:`start_gmanager` runs it as a Ray actor (one call at a time: FCFS)."""

    def __init__(self, slab_size: int, beta_thres: int = 8, util_thres: float = 0.5,
                 perf: PerfModel | None = None):
        self.slab_size = slab_size
        self.beta_thres = beta_thres
        self.util_thres = util_thres
        self.perf = perf
        self.loads: dict[int, InstanceLoad] = {}
        self.placement: dict[int, dict[int, RequestPlacementEntry]] = {}  # inst -> req -> entry
        self.versions: dict[int, int] = {}  # req_id -> placement version
        self.pending: dict[int, Reservation] = {}
        self._res_ids = itertools.count(1)

    # -- heartbeats ------------------------------------------------------------------------------
    def heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        if not hb.full and hb.inst_id not in self.loads:
            return HeartbeatReply(resync=True)
        entries = self.placement.setdefault(hb.inst_id, {})
        if hb.full:
            for r in entries:
                self._bump(r)
            entries.clear()
        for e in hb.changed:
            if e.inst_id != hb.inst_id:
                raise ValueError(f"instance {hb.inst_id} reported an entry of instance {e.inst_id}")
            entries[e.req_id] = e
            self._bump(e.req_id)
        for r in hb.removed:
            if entries.pop(r, None) is not None:
                self._bump(r)
        for res_id in hb.acked:
            self.pending.pop(res_id, None)
        self.loads[hb.inst_id] = hb.load
        return HeartbeatReply(resync=False)

    def _bump(self, req_id: int) -> None:
        self.versions[req_id] = self.versions.get(req_id, 0) + 1

    def version_of(self, req_id: int) -> int:
        """The request's placement version (a move command must carry the current one)."""
        return self.versions.get(req_id, 0)

    def snapshot(self) -> dict:
        """The placement map and loads as plain data (for tests and monitoring)."""
        return {"loads": dict(self.loads),
                "placement": {i: dict(e) for i, e in self.placement.items() if e},
                "pending": dict(self.pending)}

    # -- space -----------------------------------------------------------------------------------
    def free_slabs(self, inst_id: int) -> int:
        load = self.loads.get(inst_id)
        if load is None:
            return 0
        held = sum(r.num_slabs for r in self.pending.values() if r.dst == inst_id)
        return load.total_slabs - load.used_slabs - held

    def _is_debtor(self, load: InstanceLoad) -> bool:
        return load.batch_size <= self.beta_thres and load.util > self.util_thres

    def _is_creditor(self, load: InstanceLoad) -> bool:
        return load.util <= self.util_thres

    def _reserve(self, src: int, dst: int, num_slabs: int, req_id: int | None) -> Reservation | None:
        if num_slabs < 1 or dst == src or self.free_slabs(dst) < num_slabs:
            return None
        res = Reservation(next(self._res_ids), src, dst, num_slabs, req_id)
        self.pending[res.res_id] = res
        return res

    def try_move_kvcache(self, cmd: MoveCommand) -> Reservation | None:
        """Reserve ``cmd.num_slabs`` at ``cmd.dst`` for moving ``cmd.req_id``'s KV there; None
        when the command is stale (the request's placement changed since it was planned, or
        ``src`` no longer holds that many of its slabs) or the destination lacks room."""
        if self.version_of(cmd.req_id) != cmd.version:
            return None
        entry = self.placement.get(cmd.src, {}).get(cmd.req_id)
        if entry is None or not entry.local or entry.num_slabs < cmd.num_slabs:
            return None
        return self._reserve(cmd.src, cmd.dst, cmd.num_slabs, cmd.req_id)

    def try_borrow(self, src: int, num_slabs: int, exclude: tuple[int, ...] = ()) -> Reservation | None:
        """Reactive borrowing: reserve up to ``num_slabs`` (as many as it has free) on the
        instance, other than ``src`` and those in ``exclude``, with the most free slabs; None if
        none has any."""
        best = max((i for i in self.loads if i != src and i not in exclude),
                   key=lambda i: (self.free_slabs(i), -i), default=None)
        if best is None:
            return None
        return self._reserve(src, best, min(num_slabs, self.free_slabs(best)), None)

    def abort(self, res_id: int) -> None:
        """The source gives a reservation up (its data did not move)."""
        self.pending.pop(res_id, None)

    # -- greedy placement --------------------------------------------------------------------------
    def plan(self) -> list[MoveCommand]:
        """Moves that raise debtors' throughput, largest requests of the smallest batches first,
        each to the creditor with the most free slabs; the attention moved off a debtor stays
        under its local compute time (so it is hidden)."""
        if self.perf is None:
            return []
        slab = self.slab_size
        free = {i: self.free_slabs(i) for i, ld in self.loads.items() if self._is_creditor(ld)}
        cmds: list[MoveCommand] = []
        for load in sorted((ld for ld in self.loads.values() if self._is_debtor(ld)),
                           key=lambda ld: ld.batch_size):
            mine = {r: e for r, e in self.placement.get(load.inst_id, {}).items() if e.local}
            lent_out = {r: 0 for r in mine}
            for i, entries in self.placement.items():
                for r, e in entries.items():
                    if i != load.inst_id and r in lent_out:
                        lent_out[r] += e.num_slabs
            budget = self.perf.compute_s(load.batch_size) - sum(
                self.perf.attn_s(n * slab) for n in lent_out.values() if n)
            used, mine_cmds = load.used_slabs, []
            for r, e in sorted(mine.items(), key=lambda kv: -kv[1].num_slabs):
                movable = e.num_slabs - 1  # the tail slab stays home: new tokens append there
                if movable < 1 or not free or used / load.total_slabs <= self.util_thres:
                    continue
                dst = max(free, key=lambda i: (free[i], -i))
                n = min(movable, free[dst])
                while n > 0 and self.perf.attn_s(n * slab) > budget:
                    n -= 1
                if n < 1:
                    continue
                mine_cmds.append(MoveCommand(r, load.inst_id, dst, n, self.version_of(r)))
                free[dst] -= n
                budget -= self.perf.attn_s(n * slab)
                used -= n
            if mine_cmds and self._gains(load, load.used_slabs - used):
                cmds.extend(mine_cmds)
            else:  # no gain: the creditors' room stays for others
                for c in mine_cmds:
                    free[c.dst] += c.num_slabs
        return cmds

    def _gains(self, load: InstanceLoad, n: int) -> bool:
        """Would freeing ``n`` slabs raise the debtor's modelled throughput? Its requests' mean
        context ``S`` stays; the freed room admits ``n*slab/S`` more requests if any wait."""
        if load.waiting == 0 or load.batch_size == 0:
            return False
        ctx = load.used_slabs * self.slab_size / load.batch_size
        now = self.perf.throughput(load.batch_size, [int(ctx)] * load.batch_size)
        more = min(load.waiting, max(int(n * self.slab_size / ctx), 0))
        b = load.batch_size + more
        return more > 0 and self.perf.throughput(b, [int(ctx)] * b) > now


def start_gmanager(slab_size: int, name: str | None = None, **kwargs):
    """The gManager as a Ray actor (one call at a time, so reservations are FCFS). Needs
    ``ray.init()`` first; ``name`` makes it a named actor that instances can look up."""
    import ray
    opts = {"num_cpus": 0, "max_concurrency": 1}
    if name:
        opts["name"] = name
    return ray.remote(GManager).options(**opts).remote(slab_size, **kwargs)


class GManagerClient:
    """Calls a gManager in this process or behind a Ray actor handle with the same syntax."""

    def __init__(self, target):
        self.target = target
        self.remote = hasattr(getattr(target, "heartbeat", None), "remote")

    def call(self, method: str, *args, timeout: float = 30.0):
        fn = getattr(self.target, method)
        if not self.remote:
            return fn(*args)
        import ray
        return ray.get(fn.remote(*args), timeout=timeout)

    def close(self) -> None:
        """Stop the gManager actor (a gManager in this process needs nothing)."""
        if self.remote:
            import ray
            if ray.is_initialized():
                ray.kill(self.target)


class RManager:
    """One instance's resource manager: reports placement deltas to the gManager.

    ``state()`` returns the instance's current load, its entries (keyed by req_id) and the
    reservation ids its load now counts; the rManager diffs the entries against what it last
    sent. It also remembers acknowledged reservations until a heartbeat carries them.
    """

    def __init__(self, inst_id: int, gmanager: GManagerClient, state):
        self.inst_id = inst_id
        self.gmanager = gmanager
        self.state = state
        self._sent: dict[int, RequestPlacementEntry] = {}
        self._acked: list[int] = []
        self.resyncs = 0  # full heartbeats sent because the gManager did not know us

    def ack(self, res_id: int) -> None:
        """A reservation on this instance is now part of its ``used_slabs``."""
        self._acked.append(res_id)

    def beat(self) -> HeartbeatReply:
        load, entries = self.state()
        changed = [e for r, e in entries.items() if self._sent.get(r) != e]
        removed = [r for r in self._sent if r not in entries]
        acked, self._acked = self._acked, []
        reply = self.gmanager.call("heartbeat", Heartbeat(self.inst_id, load, changed, removed,
                                                          acked))
        if reply.resync:
            self.resyncs += 1
            reply = self.gmanager.call("heartbeat", Heartbeat(self.inst_id, load,
                                                              list(entries.values()), [], acked,
                                                              full=True))
        self._sent = dict(entries)
        return reply
