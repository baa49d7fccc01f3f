"""Whole-step graphs in a replica process (lamina/computenode/remote_steps.py): the MAILBOX
that joins a node, and the stand-in that answers a dead node's SENDs so the step fails at once
with a NodeFailure naming it."""
from types import SimpleNamespace

import pytest
import torch

from lamina.computenode.remote_steps import RemoteSteps
from lamina.errors import NodeFailure
from lamina.transport.mailbox import REPLY, SEND, map_shared
from lamina.transport.wire import MsgKind
from lamina.types import AttentionSpec, NodeRoute

SPLIT = SimpleNamespace(specs=[AttentionSpec(layer=i, num_heads=4, num_kv_heads=2, head_dim=8,
                                             scale=0.5) for i in range(3)])


class Link:
    def __init__(self):
        self.alive, self.closed = True, False

    def peer_alive(self):
        return self.alive


def _route(node, rows):
    r = NodeRoute.__new__(NodeRoute)
    r.node, r.works, r.span = node, [], None
    r.q_rows = r.kv_rows = torch.tensor(rows)
    return r


def test_attach_names_the_shared_mailbox_and_a_dead_node_gets_a_stand_in():
    links = [Link(), Link()]
    steps = RemoteSteps("emulated", SPLIT, 3, "cpu", slots=2, tokens=4, dtype=torch.float32,
                        links=links)
    try:
        assert set(steps.graphs) == {3}
        msg = steps.attach(1, links[1])
        assert msg.kind == MsgKind.MAILBOX and msg.meta["node"] == 1
        assert map_shared(msg.meta).shape == steps.box.shape  # what the node maps
        assert steps.attach(2, Link()) is None  # a node joined later (borrowed): not in it
        box = steps.box
        base = box.post(1, 12, 2, [_route(0, [0]), _route(1, [1])], layers=3)
        box.words(1)[SEND] = base + 1
        assert not steps.serve()  # both alive: nobody answers here
        links[1].alive = False
        steps._checked = 0.0  # (its liveness check runs at most every CHECK_S)
        assert steps.serve()
        assert int(box.node_words(1, 1)[REPLY]) == base + 1
        assert int(box.node_words(1, 0)[REPLY]) == 0  # the live node answers for itself
        box.node_words(1, 0)[REPLY] = base + 1
        with pytest.raises(NodeFailure, match="memory node 1 is gone .step 12, layer 0."):
            box.check(1)
        new = Link()
        steps.attach(1, new)  # its successor: the stand-in ends
        assert steps.stand_ins == {} and steps.links[1] is new
    finally:
        steps.close()
