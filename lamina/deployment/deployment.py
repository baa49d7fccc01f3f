"""Several instances in one deployment, with cluster borrowing between their memory pools.

A :class:`Deployment` runs several instances (:mod:`lamina.instance`), each an engine with its
own compute replicas and memory pool, under any placement (:func:`lamina.deployment.start_deployment`
builds it; ``LLM`` and ``lamina launch`` hold one). A router puts each request on the
least-loaded instance, and one thread drives every engine: each round starts all instances'
steps, then collects them. With ``borrowing`` on, every instance has an
:class:`~lamina.deployment.borrowing.RManager` and all share one
:class:`~lamina.deployment.borrowing.GManager` (a Ray actor with ``gmanager="ray"``), and KV
space flows between pools in two ways:

* **Reactive** (Infinite-LLM §5): a request that outgrows its pool borrows at once. Its
  scheduler asks the gManager for room (``try_borrow``); the creditor lends slots of one of its
  nodes (its scheduler's capacity for that node shrinks) and the debtor attaches that node, so
  the request's next positions are stored and attended there. Only queries and ``(o, lse)``
  cross pools, in the debtor's ATTEND fan-out; the LSE merge makes the result exact.
* **Proactive** (the gManager's greedy placement): :meth:`Deployment.move_kvcache` moves the
  oldest slabs of a request (a prefix of its first shard) to a creditor: reserve with
  ``try_move_kvcache``, EXPORT from the source node, IMPORT on the creditor's node while the
  instances decode, and only after the round switch the placement and free the source range.

Recovery: when a role of an instance dies (a memory node or compute replica process killed,
a Ray actor lost), the step that noticed it raises :class:`~lamina.errors.NodeFailure`. The
deployment restarts only the dead role (:meth:`Deployment._heal`): the steps in flight are
rolled back and re-run, a new memory node comes back empty and only the requests that had KV
on the dead one recompute it (with borrowing, those of every instance that had placed KV on
it), a new replica finds every request's KV where it was. Where that does not apply (nodes and
replicas dead together, a role that hangs rather than dies) or fails, it stops what is left of
the instance, starts a fresh one in its place (``restart``, given by
:func:`~lamina.deployment.start_deployment`) and hands it the unfinished requests, which
recompute their KV from prompt + tokens generated so far. Either way no request is lost and
the output is the same as without the fault (greedy, or sampled with a seed: draws are keyed
by position). Any other error of a step (a bug, an unexpected reply) restarts the instance
the same way, but its requests in flight end with that error
(one of them may be its cause: recomputing them could fail again and again); the waiting ones
go on. Only when the restart itself fails does the instance leave the router, ending its
requests with the error (and if it was the last, the error propagates).

Loans whose space the debtor no longer uses go back to the creditor after every round. A
memory node serves its own replicas, every debtor replica that borrowed from it, and the
engine-side client (moves, stats); request and step ids are kept disjoint per instance
(``Engine(id_base=...)``) so they never collide on a shared node.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

from lamina.deployment.borrowing import (GManager, GManagerClient, InstanceLoad, RManager,
                                        RequestPlacementEntry, start_gmanager)
from lamina.config import DeploymentConfig
from lamina.deployment.kv_moves import KVMove, KVMoves, Loan
from lamina.deployment.recovery import heal
from lamina.engine.engine import StepOutput
from lamina.engine.request import Request
from lamina.errors import NoCapacity, NodeFailure
from lamina.instance import ID_STRIDE, Instance
from lamina.types import SamplingParams

log = logging.getLogger("lamina.deployment")
REVIVE_S = 5.0  # seconds between restart attempts of an instance whose restart failed


class Deployment(KVMoves):
    """Several instances behind one router; see the module docstring.

    ``config`` is the chain the instances were started from (the slab size, whether pools lend,
    the gManager's thresholds and ``plan_every``: run its greedy placement every that many
    rounds, 0: reactive borrowing only, with ``perf``, a
    :class:`~lamina.deployment.borrowing.PerfModel`). ``gmanager``: ``"local"`` (an object in
    this process) or ``"ray"`` (a Ray actor; the default under the ``ray`` placement).
    ``launcher`` (closed last) placed the instances' roles. Built by
    :func:`lamina.deployment.start_deployment`.
    """

    def __init__(self, instances: list[Instance], config: DeploymentConfig, *,
                 gmanager: str | None = None, perf=None, launcher=None,
                 restart: Callable[[int], Instance] | None = None):
        if not instances:
            raise ValueError("a deployment needs at least one instance")
        gmanager = gmanager or ("ray" if config.instance.placement == "ray" else "local")
        if gmanager not in ("local", "ray"):
            raise ValueError(f"gmanager must be 'local' or 'ray', got {gmanager!r}")
        self.instances = instances
        self.config = config
        self.launcher = launcher  # closed last (a Ray launcher may own Ray)
        self.restart = restart  # inst_id -> a fresh instance (None: failures are final)
        self.recoveries = 0  # recoveries so far (a role died): whole instances or roles alone
        self.recovering = 0  # instances being restarted now (read by /health from another thread)
        self.recomputed_tokens = 0  # tokens whose KV was recomputed after a recovery
        self.instance_restarts = 0  # whole instances restarted
        self.node_restarts = 0  # memory nodes restarted alone (the rest of their instance ran on)
        self.replica_restarts = 0  # compute replicas restarted alone
        self.slab = config.cache.slab_size
        self.borrowing = config.lends
        self.plan_every = config.plan_every
        self.loans: dict[tuple[int, int], Loan] = {}  # (debtor, debtor_node) -> loan
        self.moves = 0
        self._rounds = itertools.count(1)
        self.gmanager: GManagerClient | None = None
        if self.borrowing:
            kw = dict(beta_thres=config.beta_thres, util_thres=config.util_thres, perf=perf)
            target = start_gmanager(self.slab, **kw) if gmanager == "ray" else GManager(self.slab, **kw)
            self.gmanager = GManagerClient(target)
            for inst in instances:
                self._lend(inst)
        self.heartbeat()
        self._keep_spare()

    def slabs(self, slots: int) -> int:
        """Slabs that ``slots`` KV slots take (the last one partial)."""
        return -(-slots // self.slab)

    def _lend(self, inst: Instance) -> None:
        inst.scheduler.lender = _Lender(self, inst.inst_id)
        inst.rmanager = RManager(inst.inst_id, self.gmanager,
                                 lambda i=inst.inst_id: self._state(i))

    # -- requests (the calls AsyncEngine makes of an engine) -------------------------------------
    def _of(self, req_id: int) -> Instance:
        return self.instances[req_id // ID_STRIDE]

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Route to the least-loaded live instance (fewest requests, then most free slots)."""
        live = [x for x in self.instances if x.failed is None]
        if not live and self.revive():
            live = [x for x in self.instances if x.failed is None]
        if not live:
            causes = "; ".join(f"instance {x.inst_id}: {x.failed}" for x in self.instances)
            raise NoCapacity(f"no instance can serve now ({causes}); a restart is retried "
                             f"every {REVIVE_S:g} s", REVIVE_S)
        inst = min(live, key=lambda x: (x.load(), -sum(x.scheduler.free), x.inst_id))
        return inst.engine.add_request(prompt_ids, params)

    def has_work(self) -> bool:
        return any(x.engine.has_work() for x in self.instances if x.failed is None)

    def abort(self, req: Request, error: Exception) -> None:
        self._of(req.req_id).engine.abort(req, error)

    def forget(self, req_id: int) -> None:
        self._of(req_id).engine.forget(req_id)

    def counts(self) -> tuple[int, int]:
        running, waiting = zip(*(x.engine.counts() for x in self.instances))
        return sum(running), sum(waiting)

    def prefix_stats(self) -> tuple[int, int, int]:
        """Every instance's :meth:`Engine.prefix_stats`, summed."""
        return tuple(sum(t) for t in zip(*(x.engine.prefix_stats() for x in self.instances)))

    def kv_slots(self) -> tuple[list[int], list[int]]:
        """(used, capacity) of every instance's own nodes, instance by instance."""
        used: list[int] = []
        for x in self.instances:
            used += [0] * x.own_nodes if x.failed else [c.stats().used_slots for c in x.nodes]
        return used, [c for x in self.instances for c in x.physical]

    def step(self) -> StepOutput:
        """One round: every instance with work starts a step (Ray-placed replicas run them
        at the same time); the moves the gManager planned (every ``plan_every`` rounds) copy
        their KV meanwhile; the steps finish; the moves switch placement; idle loans go back
        and the rManagers send heartbeats. An instance whose node or replica fails ends its
        requests with that error and leaves the router; the others go on."""
        out = StepOutput()
        if any(x.failed is not None for x in self.instances):
            self.revive()
        active = [x for x in self.instances if x.failed is None and x.engine.has_work()]
        for inst in active:
            self._guard(inst, out, inst.engine.start_step)
        moves: list[KVMove] = []
        if self.borrowing and self.plan_every and next(self._rounds) % self.plan_every == 0:
            for cmd in self.gmanager.call("plan"):
                m = self._begin_move(cmd)
                if m is not None:
                    moves.append(m)
        for inst in active:
            self._guard(inst, out, inst.engine.finish_step)
        for m in moves:
            self._end_move(m)
        if self.borrowing:
            self._reclaim()
            self.heartbeat()
        return out

    def _guard(self, inst: Instance, out: StepOutput, fn) -> None:
        if inst.failed is not None:
            return
        try:
            fn(out)
        except Exception as e:  # noqa: BLE001 - a dead role, or any other error of the step
            suspect = not isinstance(e, NodeFailure)
            if suspect:
                log.exception("instance %d: a step failed", inst.inst_id)
            elif self._heal(inst, out):
                return
            if self._recover(inst, e, out, fail_running=suspect):
                return
            if self.restart is None and all(x.failed is not None for x in self.instances
                                            if x is not inst):
                raise  # nothing left to serve, ever: the caller fails as a single engine would
            self._fail(inst, e, out)  # its requests end with the error; restarts are retried
            inst.retry_at = time.monotonic() + REVIVE_S

    def revive(self) -> int:
        """Try again to restart each failed instance whose retry time has come (its capacity
        may be back); returns how many serve again. Without ``restart``, none."""
        if self.restart is None:
            return 0
        revived = 0
        for i, inst in enumerate(self.instances):
            if inst.failed is None or inst.retry_at > time.monotonic():
                continue
            try:
                new = self._restart(inst.inst_id)
            except Exception as e:  # noqa: BLE001 - still no capacity: try again later
                inst.retry_at = time.monotonic() + REVIVE_S
                log.warning("instance %d still cannot be restarted: %s", inst.inst_id, e)
                continue
            self._install(inst, new, [])
            revived += 1
            log.warning("instance %d serves again", inst.inst_id)
        return revived

    def _heal(self, inst: Instance, out: StepOutput) -> bool:
        """Restart only what died (:func:`~lamina.deployment.recovery.heal`): ``inst``'s dead
        replica, or the dead memory nodes of any live instance, whose debtors recover too;
        False where that does not apply or failed (the whole instance then restarts)."""
        self.recovering += 1
        try:
            live = [x for x in self.instances if x.failed is None]
            healed = heal(inst, out, live, list(self.loans.values()))
        finally:
            self.recovering -= 1
        if healed is None:
            return False
        self._keep_spare()  # for the next death (the last one took the spare)
        self.recomputed_tokens += healed.lost_tokens
        self.recoveries += 1
        self.node_restarts += len(healed.nodes)
        self.replica_restarts += len(healed.replicas)
        return True

    def _keep_spare(self) -> None:
        """With ``spare``, have the launcher keep a role process ready for the next restart."""
        if self.config.instance.spare and self.launcher is not None:
            self.launcher.keep_spare()

    def _recover(self, inst: Instance, error: Exception, out: StepOutput,
                 fail_running: bool = False) -> bool:
        """Replace broken instance ``inst`` by a fresh one that adopts its unfinished requests
        (with ``fail_running``, only the waiting ones: the running ones end with ``error``);
        False (nothing changed but ``inst`` stopped) when there is no ``restart`` or it fails."""
        if self.restart is None:
            return False
        old = inst.engine
        log.warning("instance %d failed (%s); restarting it and recomputing its %d requests",
                    inst.inst_id, error, len(old.scheduler.running) + len(old.scheduler.waiting))
        for key in [k for k, ln in self.loans.items() if inst.inst_id in (ln.debtor, ln.creditor)]:
            del self.loans[key]
        inst.close()
        try:
            new = self._restart(inst.inst_id)
        except Exception as e:  # noqa: BLE001 - capacity really is gone: fail its requests
            log.error("instance %d could not be restarted: %s", inst.inst_id, e)
            return False
        for req_id, err in old._aborted.items():  # aborted while in flight: end them now
            req = old.requests.get(req_id)
            if req is not None and not req.finished:
                old.scheduler.finish(req, "error")
                req.error = err
                out.finished.append(req)
        if fail_running:
            for req in [r for r in old.scheduler.running if not r.finished]:
                old.scheduler.finish(req, "error")
                req.error = RuntimeError(f"instance {inst.inst_id}: a step failed: {error!r}")
                out.finished.append(req)
        pending = [r for r in list(old.scheduler.running) + list(old.scheduler.waiting)
                   if not r.finished]
        self.recomputed_tokens += sum(r.num_computed for r in pending)  # KV lost with the node
        self._install(inst, new, pending)
        return True

    def _restart(self, inst_id: int) -> Instance:
        """``restart(inst_id)``, counted in :attr:`recovering` while it runs."""
        self.recovering += 1
        try:
            return self.restart(inst_id)
        finally:
            self.recovering -= 1

    def _install(self, inst: Instance, new: Instance, pending: list[Request]) -> None:
        """Put restarted ``new`` in broken ``inst``'s place; it adopts ``pending`` (request ids
        go on past the old engine's)."""
        new.engine.adopt(pending, after=inst.engine)
        if self.gmanager is not None:
            self._lend(new)
        self.instances[self.instances.index(inst)] = new
        self.recoveries += 1
        self.instance_restarts += 1
        self._keep_spare()

    def _fail(self, inst: Instance, error: BaseException, out: StepOutput) -> None:
        """Instance ``inst`` is broken: its requests end with ``error``, its loans are void."""
        inst.failed = error
        for req in list(inst.engine.requests.values()):
            if not req.finished:
                inst.scheduler.finish(req, "error")
                req.error = RuntimeError(f"instance {inst.inst_id} failed: {error}")
                out.finished.append(req)
        for key in [k for k, ln in self.loans.items() if inst.inst_id in (ln.debtor, ln.creditor)]:
            del self.loans[key]

    def request(self, req_id: int) -> Request | None:
        """The request of that id, while its instance's engine holds it."""
        return self._of(req_id).engine.requests.get(req_id)

    def close(self) -> None:
        """Stop the gManager, then every instance (in reverse order: the first launched may
        own Ray)."""
        if self.gmanager is not None:
            self.gmanager.close()
            self.gmanager = None
        for inst in reversed(self.instances):
            inst.close()
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- heartbeats ------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        for inst in self.instances:
            if inst.rmanager is not None:
                inst.rmanager.beat()

    def _state(self, i: int) -> tuple[InstanceLoad, dict[int, RequestPlacementEntry]]:
        """Instance i's load and the entries for the KV its own nodes hold: its requests'
        shards there, and the shards debtors placed on slots it lent."""
        inst = self.instances[i]
        s = inst.scheduler
        total = sum(inst.physical)  # cached prefixes no request uses count as free (lendable)
        used = total - sum(s.reclaimable(k) for k in range(inst.own_nodes))
        slabs: dict[int, int] = {}
        for req in s.running:
            n = sum(sh.length for sh in req.shards if sh.node < inst.own_nodes)
            if n:
                slabs[req.req_id] = n
        entries = {r: RequestPlacementEntry(r, i, self.slabs(n), True) for r, n in slabs.items()}
        for loan in self.loans.values():
            if loan.creditor != i:
                continue
            for req in self.instances[loan.debtor].scheduler.running:
                n = sum(sh.length for sh in req.shards if sh.node == loan.debtor_node)
                if n:
                    prev = entries.get(req.req_id)
                    k = self.slabs(n) + (prev.num_slabs if prev else 0)
                    entries[req.req_id] = RequestPlacementEntry(req.req_id, i, k, False)
        load = InstanceLoad(i, len(s.running), len(s.waiting), total // self.slab,
                            self.slabs(used))
        return load, entries


class _Lender:
    """An instance's :class:`lamina.engine.scheduler.Lender`: the deployment's gManager and loans."""

    def __init__(self, deployment: Deployment, inst_id: int):
        self.deployment = deployment
        self.inst_id = inst_id

    def cluster_slots(self) -> int:
        return sum(sum(inst.physical) for inst in self.deployment.instances)

    def borrow(self, req: Request, num_slots: int) -> bool:
        return self.deployment.borrow(self.inst_id, req, num_slots)

