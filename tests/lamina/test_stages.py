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
