"""Loans of KV space between instances' pools and proactive KV moves (Infinite-LLM's greedy
placement), the part of :class:`~lamina.deployment.deployment.Deployment` that moves data.

:class:`KVMoves` is a mixin of ``Deployment``: it keeps the loan book (``loans``: ``_loan``,
``lend``, ``_reclaim``, reactive ``borrow``) and moves KV, using the deployment's
``instances``, ``gmanager``, ``slab`` and ``moves`` counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.deployment.borrowing import MoveCommand
from lamina.engine.request import Request
from lamina.errors import NodeFailure


@dataclass
class Loan:
    """``slots`` of creditor ``creditor``'s node ``creditor_node`` lent to ``debtor``, where it
    is node ``debtor_node``."""

    debtor: int
    debtor_node: int
    creditor: int
    creditor_node: int
    slots: int = 0


@dataclass
class KVMove:
    """A KV move whose data is in flight (EXPORT/IMPORT done while the instances step)."""

    cmd: MoveCommand
    res_id: int
    req: Request
    node: int  # source node (the request's first shard)
    start: int
    count: int
    loan: Loan
    target: Any  # the creditor's client of the node the copy went to (a restart replaces it)


class KVMoves:
    """The loan book and proactive moves of a request's oldest KV to another pool (see the
    module docstring)."""

    def move_kvcache(self, cmd: MoveCommand) -> bool:
        """Move ``cmd.num_slabs`` slabs of the oldest KV of ``cmd.req_id`` to ``cmd.dst`` now
        (between rounds); False when nothing moved. :meth:`step` runs the same two halves
        around the instances' steps, so the copy overlaps decoding."""
        m = self._begin_move(cmd)
        return m is not None and self._end_move(m)

    def _begin_move(self, cmd: MoveCommand) -> KVMove | None:
        """Reserve at the destination (``try_move_kvcache``), EXPORT the oldest ``count``
        positions of the request's first shard and IMPORT them on the creditor's node. The
        request may be decoding meanwhile: only its tail grows, and these positions are
        written (``< num_computed``) and never change. None (nothing reserved or copied) when
        the request has no such prefix in its own pool, or the gManager or creditor refuses."""
        src = self.instances[cmd.src]
        req = src.engine.requests.get(cmd.req_id)
        if (req is None or req.finished or not req.shards or req.num_cached
                or self.instances[cmd.dst].failed):  # a cached prefix is shared, never moved
            return None
        first = req.shards[0]
        written = min(first.end, req.num_computed) - first.start
        count = min(cmd.num_slabs * self.slab, first.length - 1, written)
        if first.node >= src.own_nodes or count < 1:
            return None
        res = self.gmanager.call("try_move_kvcache", cmd)
        if res is None:
            return None
        creditor = self.instances[cmd.dst]
        cnode = max(range(creditor.own_nodes), key=lambda n: creditor.scheduler.reclaimable(n))
        creditor.engine.reclaim(cnode, count)
        loan = self._loan(cmd.src, cmd.dst, cnode)
        if creditor.scheduler.free[cnode] < count or loan.debtor_node in {s.node for s in req.shards}:
            self.gmanager.call("abort", res.res_id)
            return None
        a = first.start
        target = creditor.nodes[cnode]
        try:
            target.import_kv(src.nodes[first.node].export(req.req_id, a, a + count))
        except NodeFailure:  # a node died: the next step notices it and recovery follows
            self.gmanager.call("abort", res.res_id)
            return None
        return KVMove(cmd, res.res_id, req, first.node, a, count, loan, target)

    def _end_move(self, m: KVMove) -> bool:
        """After the steps: the data has landed, so switch the placement and free the source
        range; if the request finished, was preempted or changed shape meanwhile, drop the
        copy instead (unless the node it went to died and was restarted meanwhile: then the
        copy is gone). True if the move took effect."""
        req, loan = m.req, m.loan
        creditor = self.instances[loan.creditor]
        first = req.shards[0] if req.shards else None
        landed = creditor.nodes[loan.creditor_node] is m.target
        ok = (landed and not req.finished and first is not None and first.node == m.node
              and not req.num_cached and first.start == m.start and first.length > m.count
              and loan.debtor_node not in {s.node for s in req.shards}
              and creditor.scheduler.free[loan.creditor_node] >= m.count)
        if not ok:
            if landed:
                m.target.free_range(req.req_id, m.start, m.start + m.count)
            self.gmanager.call("abort", m.res_id)
            return False
        self.lend(loan, m.count)
        creditor.rmanager.ack(m.res_id)
        src = self.instances[m.cmd.src]
        src.scheduler.move_prefix(req, loan.debtor_node, m.count)
        try:
            src.nodes[m.node].free_range(req.req_id, m.start, m.start + m.count)
        except NodeFailure:  # the source died since: its restart comes back empty anyway
            pass
        self.moves += 1
        return True

    # -- loans -----------------------------------------------------------------------------------
    def _loan(self, debtor: int, creditor: int, cnode: int) -> Loan:
        """The debtor's loan on creditor's node ``cnode``, attaching the node on first use."""
        for loan in self.loans.values():
            if (loan.debtor, loan.creditor, loan.creditor_node) == (debtor, creditor, cnode):
                return loan
        d = self.instances[debtor]
        index = d.engine.attach(self.instances[creditor].share(cnode), 0)
        loan = Loan(debtor, index, creditor, cnode)
        self.loans[(debtor, index)] = loan
        return loan

    def lend(self, loan: Loan, slots: int) -> None:
        """Move ``slots`` free slots of the creditor's node into the debtor's loan (a negative
        count gives them back)."""
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
                self.lend(loan, -idle)

    def borrow(self, debtor: int, req: Request, num_slots: int) -> bool:
        """Reactive borrowing of ``num_slots`` for ``req``, from as many creditors as it takes
        (see :class:`lamina.engine.scheduler.Lender`); True if any slot was lent."""
        used = {sh.node for sh in req.shards}
        tail = req.shards[-1].node if req.shards else None
        exclude: list[int] = [x.inst_id for x in self.instances if x.failed is not None]
        got = 0
        while got < num_slots:
            res = self.gmanager.call("try_borrow", debtor, self.slabs(num_slots - got),
                                     tuple(exclude))
            if res is None:
                break
            exclude.append(res.dst)
            creditor = self.instances[res.dst]
            want, lent = res.num_slabs * self.slab, 0
            cs = creditor.scheduler
            for cnode in sorted(range(creditor.own_nodes), key=lambda n: -cs.reclaimable(n)):
                loan = self._loan(debtor, res.dst, cnode)
                if loan.debtor_node in used and loan.debtor_node != tail:
                    continue  # a request holds one contiguous shard per node
                creditor.engine.reclaim(cnode, want - lent)  # its cached prefixes give way
                take = min(want - lent, cs.free[cnode])
                if take > 0:
                    self.lend(loan, take)
                    lent += take
                if lent >= want:
                    break
            creditor.rmanager.ack(res.res_id)
            got += lent
        return got > 0
