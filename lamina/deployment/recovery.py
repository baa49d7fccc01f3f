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
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lamina.engine.engine import StepOutput
from lamina.instance import Instance

log = logging.getLogger("lamina.deployment")
EXIT_S = 1.0  # how long a role whose peers saw it die may still look alive to its launcher


@dataclass
class Healed:
    """What :func:`heal` restarted: own node and replica indices, and the KV tokens that the
    requests which had KV on a dead node recompute."""

    nodes: list[int]
    replicas: list[int]
    lost_tokens: int


def heal(inst: Instance, out: StepOutput) -> Healed | None:
    """Restart ``inst``'s dead memory nodes or its dead replica alone (module docstring);
    requests aborted meanwhile end in ``out``. None (nothing restarted) where that does not
    apply: the placement runs no role processes, no role process is gone (one that stopped
    answering), nodes and replicas died together; or where it fails (the caller then restarts
    the whole instance, which stops whatever this started)."""
    worker = inst.engine.worker
    if inst.restart_node is None:
        return None
    deadline = time.monotonic() + EXIT_S
    while True:  # a killed process may be reaped a moment after its peers saw it end
        nodes, replicas = inst.dead_nodes(), worker.dead_replicas()
        if nodes or replicas or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if bool(nodes) == bool(replicas):
        return None
    t0 = time.monotonic()
    what = ", ".join([f"memory node {k}" for k in nodes] + [f"compute replica {i}" for i in replicas])
    try:
        for k in nodes:  # the clients point at the new nodes before anything is cancelled
            inst.restart_node(k)
        lost = inst.engine.recover(set(nodes), out)
        for i in replicas:  # after the cancel: nothing in flight reaches the new replica
            worker.replace_replica(i)
    except Exception as e:  # noqa: BLE001 - the whole instance restarts instead
        log.warning("instance %d: restarting %s alone failed (%s); restarting the instance",
                    inst.inst_id, what, e)
        return None
    log.warning("instance %d: %s restarted alone in %.1f s; %d KV tokens recompute, the other "
                "requests keep theirs", inst.inst_id, what, time.monotonic() - t0, lost)
    return Healed(nodes, replicas, lost)
