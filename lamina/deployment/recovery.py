"""Restarting only what died of an instance: a memory node or a compute replica, each with its
index, while the instance's other roles keep running and keep their state.

:func:`heal` is what :meth:`Deployment._guard <lamina.deployment.deployment.Deployment._guard>`
tries first on a :class:`~lamina.errors.NodeFailure`. By then the engine has dropped every
micro-batch in flight (their slot reservations went back to the scheduler, their step ids wait
in ``Engine.dropped``). A dead memory node is started again empty (``Instance.restart_node``)
and every replica joins it in the dead one's place; then ``Engine.recover`` cancels the dropped
steps on every node, trims what a node holds beyond the scheduler's view, and sends back to the
queue only the requests that had KV on the dead node. A dead replica is started again after
that cancel (``RemoteReplicas.replace_replica``), so nothing of the dropped steps reaches it; it
rejoins every node and the ring of contexts, and every request keeps its KV.

With borrowing, a node may hold KV that other instances placed on slots it lent them. The dead
node is restarted by the instance that owns it, whichever instance's step noticed the death;
each debtor with a loan on it joins the new node in place of the old one (its replicas open
peer channels of it, at the loan's index) and recovers as its owner does: only the debtor's
requests with KV there recompute it. The loans stay (the new node has the same capacity).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lamina.deployment.kv_moves import Loan
from lamina.engine.engine import StepOutput
from lamina.instance import Instance

log = logging.getLogger("lamina.deployment")
EXIT_S = 1.0  # how long a role whose peers saw it die may still look alive to its launcher


@dataclass
class Healed:
    """What :func:`heal` restarted: memory nodes as ``(inst_id, node)``, the failing instance's
    replica indices, and the KV tokens that the requests which had KV on a dead node recompute
    (in every instance)."""

    nodes: list[tuple[int, int]]
    replicas: list[int]
    lost_tokens: int


def heal(inst: Instance, out: StepOutput, pool: list[Instance] | None = None,
         loans: list[Loan] = ()) -> Healed | None:
    """Restart the dead memory nodes of ``pool`` (the deployment's live instances, ``inst``
    among them; default ``[inst]``) or ``inst``'s dead replica alone (module docstring); each
    debtor of ``loans`` on a dead node joins its successor and recovers too. Requests aborted
    meanwhile end in ``out``. None (nothing restarted) where that does not apply: a placement
    that runs no role processes, no role process gone (one that stopped answering), nodes and
    replicas dead together; or where it fails (the caller then restarts the whole instance,
    which stops whatever this started)."""
    pool = pool or [inst]
    worker = inst.engine.worker
    if any(x.restart_node is None for x in pool):
        return None
    deadline = time.monotonic() + EXIT_S
    while True:  # a killed process may be reaped a moment after its peers saw it end
        nodes = {x.inst_id: ks for x in pool if (ks := x.dead_nodes())}
        replicas = worker.dead_replicas()
        if nodes or replicas or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if bool(nodes) == bool(replicas):
        return None
    t0 = time.monotonic()
    by_id = {x.inst_id: x for x in pool}
    what = ", ".join([f"memory node {k}" if i == inst.inst_id else f"instance {i}'s memory node {k}"
                      for i, ks in nodes.items() for k in ks]
                     + [f"compute replica {i}" for i in replicas])
    try:
        lost = {inst.inst_id: set()}  # inst recovers even if only its replica died: its
        lost.update({i: set(ks) for i, ks in nodes.items()})  # steps in flight are cancelled
        for i, ks in nodes.items():  # the clients point at the new nodes before any cancel
            for k in ks:
                by_id[i].restart_node(k)
        for loan in loans:
            if loan.creditor_node in nodes.get(loan.creditor, ()):
                new = by_id[loan.creditor].nodes[loan.creditor_node]
                by_id[loan.debtor].engine.worker.replace_node(loan.debtor_node, new)
                lost.setdefault(loan.debtor, set()).add(loan.debtor_node)
        tokens = sum(by_id[i].engine.recover(ks, out) for i, ks in lost.items())
        for i in replicas:  # after the cancel: nothing in flight reaches the new replica
            worker.replace_replica(i)
    except Exception as e:  # noqa: BLE001 - the whole instance restarts instead
        log.warning("instance %d: restarting %s alone failed (%s); restarting the instance",
                    inst.inst_id, what, e)
        return None
    log.warning("instance %d: %s restarted alone in %.1f s; %d KV tokens recompute, the other "
                "requests keep theirs", inst.inst_id, what, time.monotonic() - t0, tokens)
    return Healed([(i, k) for i, ks in nodes.items() for k in ks], replicas, tokens)
