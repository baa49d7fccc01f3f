"""``heal``: which roles it restarts and which engines recover, over fake instances (the real
restarts are in the slow e2e tests: ``tests/e2e/test_pipeline_processes.py``,
``test_borrowing_greedy.py``, ``tests/lamina/test_cluster_deployment.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from lamina.deployment import recovery
from lamina.deployment.kv_moves import Loan
from lamina.deployment.recovery import Healed, heal
from lamina.engine.engine import StepOutput
from lamina.instance import Instance


@dataclass
class Proc:
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


@dataclass(eq=False)  # hashed by identity: a restart makes a new one
class Client:
    process: Proc = field(default_factory=Proc)


class Worker:
    def __init__(self, log: list, inst_id: int, replicas: int = 1):
        self.log, self.inst_id = log, inst_id
        self.procs = [Proc() for _ in range(replicas)]

    def dead_replicas(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if not p.alive]

    def replace_node(self, k: int, client: Client) -> None:
        self.log.append(("join", self.inst_id, k, client))

    def replace_replica(self, i: int) -> None:
        self.log.append(("replica", self.inst_id, i))


class Engine:
    def __init__(self, log: list, inst_id: int):
        self.log, self.inst_id = log, inst_id
        self.worker = Worker(log, inst_id)

    def recover(self, lost: set[int], out: StepOutput) -> int:
        self.log.append(("recover", self.inst_id, frozenset(lost)))
        return 10 * len(lost)


def _instance(log: list, inst_id: int, nodes: int = 1) -> Instance:
    inst = Instance(inst_id, Engine(log, inst_id), [Client() for _ in range(nodes)])

    def restart(k: int) -> None:
        log.append(("restart", inst_id, k))
        inst.nodes[k] = Client()
    inst.restart_node = restart
    return inst


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(recovery, "EXIT_S", 0.0)


def test_a_dead_replica_is_restarted_after_its_instance_recovers():
    log: list = []
    inst = _instance(log, 0)
    inst.engine.worker.procs[0].alive = False
    assert heal(inst, StepOutput()) == Healed([], [0], 0)
    assert log == [("recover", 0, frozenset()), ("replica", 0, 0)]  # steps cancelled first


def test_a_dead_lending_node_restarts_alone_and_its_debtor_recovers_too():
    """Instance 0 borrowed instance 1's node 0 (its node 1) and instance 2 borrowed it too (its
    node 2); instance 0's step noticed the death. Instance 1 restarts the node, both debtors
    join the new one at their loan's index, and all three recover."""
    log: list = []
    debtor, creditor, other = _instance(log, 0), _instance(log, 1), _instance(log, 2)
    creditor.nodes[0].process.alive = False
    loans = [Loan(0, 1, 1, 0), Loan(2, 2, 1, 0), Loan(1, 1, 2, 0)]  # the last: node alive
    healed = heal(debtor, StepOutput(), [debtor, creditor, other], loans)
    assert healed == Healed([(1, 0)], [], 10 * 3)
    new = creditor.nodes[0]
    assert new.process.alive
    assert log[0] == ("restart", 1, 0)
    assert set(log[1:3]) == {("join", 0, 1, new), ("join", 2, 2, new)}
    assert set(log[3:]) == {("recover", 0, frozenset({1})), ("recover", 1, frozenset({0})),
                            ("recover", 2, frozenset({2}))}


def test_nothing_dead_or_nodes_and_replicas_together_restart_the_instance():
    log: list = []
    inst = _instance(log, 0)
    assert heal(inst, StepOutput()) is None  # it stopped answering without dying
    inst.nodes[0].process.alive = False
    inst.engine.worker.procs[0].alive = False
    assert heal(inst, StepOutput()) is None
    inst.restart_node = None  # in process: roles live and die with the engine
    inst.engine.worker.procs[0].alive = True
    assert heal(inst, StepOutput()) is None
    assert log == []
