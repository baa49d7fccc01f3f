"""Start-up stages: timed where they run, a role's record filed under its name."""
from __future__ import annotations

import time

from lamina import stages


def test_stages_add_up_and_take_clears():
    stages.take()
    with stages.stage("a"):
        time.sleep(0.01)
    with stages.stage("a"):
        pass
    with stages.stage("b"):
        pass
    rec = stages.take()
    assert list(rec) == ["a", "b"] and rec["a"] >= 0.01
    assert stages.take() == {}


def test_a_roles_record_is_filed_under_its_name():
    stages.take()
    stages.add_role("replica 1", 5.0, {"load split": 2.0, "replica": 1.5, "bad": "x"})
    assert stages.take() == {"replica 1: start": 5.0, "replica 1: load split": 2.0,
                             "replica 1: replica": 1.5, "replica 1: start, other": 1.5}


def test_roles_ready_lists_each_roles_start():
    stages.take()
    stages.add_role("memory node 0", 2.04, {"build node": 1.0})
    stages.add_role("replica 0", 3.91, {})
    assert stages.roles_ready(stages.take()) == "memory node 0 2.0 s, replica 0 3.9 s"
    assert stages.roles_ready({"load model": 3.0}) == ""  # in process: no role process


def test_a_nodes_first_ping_reply_carries_its_stages():
    import torch

    from lamina.memnode.server import build_node, handle, node_config
    from lamina.transport import codec
    from lamina.types import AttentionSpec
    stages.take()
    with stages.stage("build node"):
        node = build_node(node_config([AttentionSpec(0, 2, 1, 8, 0.3)], 64, "cpu",
                                      torch.float32, 16))
    first = handle(node, codec.ping()).meta["stages"]
    assert list(first) == ["build node"]
    assert handle(node, codec.ping()).meta["stages"] == {}
