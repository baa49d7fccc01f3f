"""Several instances in one deployment, with cluster borrowing between their memory pools.

A :class:`Deployment` runs ``instances`` engines, each with its own compute replicas and memory
pool, in this process (they share one split model's weights). A router puts each request on
the least-loaded instance. With ``borrowing`` on, every instance has an
:class:`~lamina.borrowing.RManager` and all share one :class:`~lamina.borrowing.GManager` (a
Ray actor with ``gmanager="ray"``), and KV space flows between pools in two ways:

* **Reactive** (Infinite-LLM §5): a request that outgrows its pool borrows at once. Its
  scheduler asks the gManager for room (``try_borrow``); the creditor lends slots of one of its
  nodes (its scheduler's capacity for that node shrinks) and the debtor attaches that node, so
  the request's next positions are stored and attended there. Only queries and ``(o, lse)``
  cross pools, in the debtor's ATTEND fan-out; the LSE merge makes the result exact.
* **Proactive** (the gManager's greedy placement): :meth:`Deployment.move_kvcache` moves the
  oldest slabs of a request (a prefix of its first shard) to a creditor: reserve with
  ``try_move_kvcache``, EXPORT from the source node, IMPORT on the creditor's node, and only
  then switch the placement and free the source range.

Loans whose space the debtor no longer uses go back to the creditor after every round. Memory
nodes are shared between instances only in this process (``transport="local"``): request and
step ids are kept disjoint per instance (``Engine(id_base=...)``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from lamina.borrowing import (GManager, GManagerClient, InstanceLoad, MoveCommand, RManager,
                              RequestPlacementEntry, start_gmanager)
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.sampling import Sampler
from lamina.engine import Engine, StepOutput
from lamina.nodes import MemoryPoolHandle, start_memory_pool
from lamina.pool import InProcessNode
from lamina.request import Request
from lamina.scheduler import SchedulerConfig
from lamina.splitter import SplitModel
from lamina.types import SamplingParams
from lamina.worker import LocalWorker, ReplicaWorker

ID_STRIDE = 1 << 40  # request/step ids of instance i start at i * ID_STRIDE


@dataclass
class Loan:
    """``slots`` of creditor ``creditor``'s node ``creditor_node`` lent to ``debtor``, where it
    is node ``debtor_node``."""

    debtor: int
    debtor_node: int
    creditor: int
    creditor_node: int
    client: InProcessNode  # the debtor's client of the creditor's node
    slots: int = 0


@dataclass
class Instance:
    inst_id: int
    engine: Engine
    pool: MemoryPoolHandle
    own_nodes: int
    rmanager: RManager | None = None
    physical: list[int] = field(default_factory=list)  # own nodes' real capacities

    @property
    def scheduler(self):
        return self.engine.scheduler

    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting)


class Deployment:
    """``instances`` engines over one split model; see the module docstring.

    ``memory`` nodes of ``kv_cache_tokens`` slots per instance. ``gmanager``: ``"local"`` (an
    object in this process) or ``"ray"`` (a Ray actor; needs Ray). ``plan_every``: run the
    gManager's greedy placement every that many rounds (0: reactive borrowing only) with
    ``perf`` (a :class:`~lamina.borrowing.PerfModel`, or ``"profile"``: measure it now with
    :func:`lamina.profiling.profile_perf`).
    """

    def __init__(self, split: SplitModel, instances: int = 2, memory: int = 1, *,
                 kv_cache_tokens: int, slab_size: int = 16, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, borrowing: bool = True,
                 gmanager: str = "local", beta_thres: int = 8, util_thres: float = 0.5,
                 perf=None, plan_every: int = 0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 eos_token_ids: set[int] | None = None, tokenizer=None):
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        if gmanager not in ("local", "ray"):
            raise ValueError(f"gmanager must be 'local' or 'ray', got {gmanager!r}")
        self.slab = slab_size
        self.borrowing = borrowing
        self.plan_every = plan_every
        self.loans: dict[tuple[int, int], Loan] = {}  # (debtor, debtor_node) -> loan
        self.moves = 0
        self._rounds = itertools.count(1)
        self.gmanager: GManagerClient | None = None
        if borrowing:
            if perf == "profile":
                from lamina.profiling import profile_perf
                perf = profile_perf(split, device, dtype)
            kw = dict(beta_thres=beta_thres, util_thres=util_thres, perf=perf)
            target = start_gmanager(slab_size, **kw) if gmanager == "ray" else GManager(slab_size, **kw)
            self.gmanager = GManagerClient(target)
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.instances: list[Instance] = []
        for i in range(instances):
            pool = start_memory_pool(split.specs, memory, transport="local", device=device,
                                     dtype=dtype, kv_cache_tokens=kv_cache_tokens,
                                     slab_size=slab_size)
            worker = LocalWorker(ReplicaWorker([ComputeReplica(split, device, Sampler())],
                                               pool.clients))
            lender = _Lender(self, i) if borrowing else None
            engine = Engine(worker, pool.capacities, config, eos_token_ids, tokenizer,
                            id_base=i * ID_STRIDE, lender=lender)
            inst = Instance(i, engine, pool, memory, physical=list(pool.capacities))
            if borrowing:
                inst.rmanager = RManager(i, self.gmanager, lambda i=i: self._state(i))
            self.instances.append(inst)
        self.heartbeat()

    @classmethod
    def from_model(cls, model: str = "smollm2", dtype: torch.dtype | None = None,
                   device: str = "cpu", **kwargs) -> "Deployment":
        """Load and split ``model`` (as :class:`lamina.LLM` does), then build the deployment."""
        from lamina.api import _eos_ids
        from lamina.models import load_model
        from lamina.splitter import split_model
        loaded = load_model(model, dtype=dtype, device=device)
        cfg = getattr(loaded.model, "config", None)
        kwargs.setdefault("max_model_len", getattr(cfg, "max_position_embeddings", None))
        return cls(split_model(loaded.model), device=device, dtype=loaded.dtype,
                   eos_token_ids=_eos_ids(loaded.model, loaded.tokenizer),
                   tokenizer=loaded.tokenizer, **kwargs)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Route to the least-loaded instance (fewest requests, then most free slots)."""
        inst = min(self.instances, key=lambda x: (x.load(), -sum(x.scheduler.free), x.inst_id))
        return inst.engine.add_request(prompt_ids, params)

    def has_work(self) -> bool:
        return any(x.engine.has_work() for x in self.instances)

    def step(self) -> StepOutput:
        """One round: every instance with work runs one step; then loans nobody uses go back,
        rManagers send heartbeats, and every ``plan_every`` rounds the gManager's moves run."""
        out = StepOutput()
        for inst in self.instances:
            if inst.engine.has_work():
                o = inst.engine.step()
                out.new_tokens.update(o.new_tokens)
                out.finished.extend(o.finished)
        if self.borrowing:
            self._reclaim()
            self.heartbeat()
            if self.plan_every and next(self._rounds) % self.plan_every == 0:
                for cmd in self.gmanager.call("plan"):
                    self.move_kvcache(cmd)
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Run ``prompts`` (token ids) to completion; the finished requests in prompt order."""
        reqs = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return reqs

    def close(self) -> None:
        for inst in self.instances:
            inst.pool.close()

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
        total = sum(inst.physical)
        used = total - sum(s.free[:inst.own_nodes])
        slabs: dict[int, int] = {}
        for req in s.running:
            n = sum(sh.length for sh in req.shards if sh.node < inst.own_nodes)
            if n:
                slabs[req.req_id] = n
        entries = {r: RequestPlacementEntry(r, i, -(-n // self.slab), True) for r, n in slabs.items()}
        for loan in self.loans.values():
            if loan.creditor != i:
                continue
            for req in self.instances[loan.debtor].scheduler.running:
                n = sum(sh.length for sh in req.shards if sh.node == loan.debtor_node)
                if n:
                    prev = entries.get(req.req_id)
                    k = -(-n // self.slab) + (prev.num_slabs if prev else 0)
                    entries[req.req_id] = RequestPlacementEntry(req.req_id, i, k, False)
        load = InstanceLoad(i, len(s.running), len(s.waiting), total // self.slab,
                            -(-used // self.slab))
        return load, entries

    # -- loans -----------------------------------------------------------------------------------
    def _loan(self, debtor: int, creditor: int, cnode: int) -> Loan:
        """The debtor's loan on creditor's node ``cnode``, attaching the node on first use."""
        for loan in self.loans.values():
            if (loan.debtor, loan.creditor, loan.creditor_node) == (debtor, creditor, cnode):
                return loan
        client = self.instances[creditor].pool.clients[cnode]
        if not isinstance(client, InProcessNode):
            raise NotImplementedError("borrowing needs in-process memory nodes")
        borrowed = InProcessNode(client.node, f"instance {creditor} {client.name}")
        index = self.instances[debtor].engine.attach(borrowed, 0)
        loan = Loan(debtor, index, creditor, cnode, borrowed)
        self.loans[(debtor, index)] = loan
        return loan

    def lend(self, loan: Loan, slots: int) -> None:
        """Move ``slots`` free slots of the creditor's node into the debtor's loan."""
        self.instances[loan.creditor].scheduler.resize(loan.creditor_node, -slots)
        self.instances[loan.debtor].scheduler.resize(loan.debtor_node, slots)
        loan.slots += slots

    def _reclaim(self) -> None:
        """Give back loans' idle slots: all of them once the debtor has no KV there, else all but
        one slab's worth of headroom (so a decoding request does not borrow every step)."""
        for loan in self.loans.values():
            s = self.instances[loan.debtor].scheduler
            idle = min(s.free[loan.debtor_node], loan.slots)
            if idle < loan.slots:  # in use: keep a slab of headroom
                idle = max(idle - self.slab, 0)
            if idle:
                s.resize(loan.debtor_node, -idle)
                self.instances[loan.creditor].scheduler.resize(loan.creditor_node, idle)
                loan.slots -= idle

    def borrow(self, debtor: int, req: Request, num_slots: int) -> bool:
        """Reactive borrowing of ``num_slots`` for ``req``, from as many creditors as it takes
        (see :class:`lamina.scheduler.Lender`); True if any slot was lent."""
        used = {sh.node for sh in req.shards}
        tail = req.shards[-1].node if req.shards else None
        exclude: list[int] = []
        got = 0
        while got < num_slots:
            res = self.gmanager.call("try_borrow", debtor, -(-(num_slots - got) // self.slab),
                                     tuple(exclude))
            if res is None:
                break
            exclude.append(res.dst)
            creditor = self.instances[res.dst]
            want, lent = res.num_slabs * self.slab, 0
            for cnode in sorted(range(creditor.own_nodes), key=lambda n: -creditor.scheduler.free[n]):
                loan = self._loan(debtor, res.dst, cnode)
                if loan.debtor_node in used and loan.debtor_node != tail:
                    continue  # a request holds one contiguous shard per node
                take = min(want - lent, creditor.scheduler.free[cnode])
                if take > 0:
                    self.lend(loan, take)
                    lent += take
                if lent >= want:
                    break
            creditor.rmanager.ack(res.res_id)
            got += lent
        return got > 0

    # -- proactive moves -------------------------------------------------------------------------
    def move_kvcache(self, cmd: MoveCommand) -> bool:
        """Move ``cmd.num_slabs`` slabs of the oldest KV of ``cmd.req_id`` to ``cmd.dst``; False
        (nothing moved) when the request is in flight, its first shard is not in its own pool,
        or the gManager or creditor refuses."""
        src = self.instances[cmd.src]
        req = src.engine.requests.get(cmd.req_id)
        if req is None or req.finished or req.req_id in src.engine.busy() or not req.shards:
            return False
        first = req.shards[0]
        count = min(cmd.num_slabs * self.slab, first.length - 1)
        if first.node >= src.own_nodes or count < 1:
            return False
        res = self.gmanager.call("try_move_kvcache", cmd)
        if res is None:
            return False
        creditor = self.instances[cmd.dst]
        cnode = max(range(creditor.own_nodes), key=lambda n: creditor.scheduler.free[n])
        loan = self._loan(cmd.src, cmd.dst, cnode)
        if creditor.scheduler.free[cnode] < count or loan.debtor_node in {s.node for s in req.shards}:
            self.gmanager.call("abort", res.res_id)
            return False
        a = first.start
        chunk = src.pool.clients[first.node].export(req.req_id, a, a + count)
        loan.client.import_kv(chunk)
        self.lend(loan, count)
        creditor.rmanager.ack(res.res_id)
        # the data has landed: switch the placement, then free the source range
        src.scheduler.move_prefix(req, loan.debtor_node, count)
        src.pool.clients[first.node].free_range(req.req_id, a, a + count)
        self.moves += 1
        return True


class _Lender:
    """An instance's :class:`lamina.scheduler.Lender`: the deployment's gManager and loans."""

    def __init__(self, deployment: Deployment, inst_id: int):
        self.deployment = deployment
        self.inst_id = inst_id

    def cluster_slots(self) -> int:
        return sum(sum(inst.physical) for inst in self.deployment.instances)

    def borrow(self, req: Request, num_slots: int) -> bool:
        return self.deployment.borrow(self.inst_id, req, num_slots)
