"""Whole-step graphs (computenode/step_graphs.py): the nodes' outputs merged on the device as
the replica core merges them, the CPU stand-in's bounded wait, and the config's choices. The
whole path end to end (greedy output equal to HF) is in tests/e2e/test_polling_procs.py; the
CUDA graphs, flags and mapped mailbox under ``gpu``."""
import pytest
import torch

from lamina.computenode.step_graphs import HostFlags, merge
from lamina.config import deployment_config
from lamina.kernels import merge_states
from lamina.transport.mailbox import MISSED, REPLY, SEND, Mailbox, MailboxShape, host_buffer


def test_merge_matches_merge_states_and_leaves_unseen_rows_zero():
    g = torch.Generator().manual_seed(0)
    o = [torch.randn(4, 3, 8, generator=g) for _ in range(2)]
    lse = [torch.randn(4, 3, generator=g) for _ in range(2)]
    lse[1][0] = float("-inf")  # row 0: node 0 only
    lse[0][3] = float("-inf")
    lse[1][3] = float("-inf")  # row 3: no node
    got = merge(o, lse)
    want, _ = merge_states([o[0][1:3], o[1][1:3]], [lse[0][1:3], lse[1][1:3]])
    torch.testing.assert_close(got[1:3], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], o[0][0])  # the other node's weight is exactly 0
    assert float(got[3].abs().sum()) == 0
    one = merge([o[0]], [lse[0]])
    assert torch.equal(one, o[0]) and one.data_ptr() != o[0].data_ptr()


def test_host_wait_serves_until_the_reply_and_gives_up_as_the_device_does():
    shape = MailboxShape(1, 1, 2, 1, 1, 4)
    buf = host_buffer(shape)
    box = Mailbox(shape, buf)
    base = box.post(0, 1, 2, [], layers=3)
    served = []

    def serve():
        served.append(1)
        if len(served) == 3:
            box.node_words(0, 0)[REPLY] = int(box.words(0)[SEND])
            return True
        return False

    flags = HostFlags(box, serve)
    flags.signal(0, 2)
    assert int(box.words(0)[SEND]) == base + 2
    flags.wait(0, 0, 2)
    assert len(served) == 3 and int(box.words(0)[MISSED]) == 0
    HostFlags(box, lambda: False, timeout_s=0.01).wait(0, 0, 3)  # nobody answers
    with pytest.raises(RuntimeError, match="gave up"):
        box.check(0)


def test_config_takes_graphs_with_polling_on_one_host_and_refuses_them_under_ray():
    for placement in ("inproc", "procs"):
        cfg = deployment_config("x", cuda_graphs=True, device_polling="emulated",
                                placement=placement)
        assert cfg.instance.cuda_graphs and cfg.instance.device_polling == "emulated"
    with pytest.raises(ValueError, match="needs the memory nodes on the replicas' host"):
        deployment_config("x", cuda_graphs=True, device_polling="emulated", placement="ray")
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA compute device"):
        deployment_config("x", cuda_graphs=True)


@pytest.mark.gpu
def test_cuda_flags_release_a_captured_wait_and_see_the_mapped_mailbox():
    from lamina.computenode.device_wait import mapped_alias, unavailable
    from lamina.computenode.step_graphs import CudaFlags
    if not torch.cuda.is_available() or unavailable() is not None:
        pytest.skip(unavailable() if torch.cuda.is_available() else "needs a CUDA GPU")
    shape = MailboxShape(1, 1, 4, 2, 1, 8)
    buf = host_buffer(shape)
    host = Mailbox(shape, buf)
    alias, unregister = mapped_alias(buf)
    dev = Mailbox(shape, alias)
    flags = CudaFlags(dev, timeout_s=20)
    x = torch.ones(4, 2, 8, device="cuda")
    q, _, _ = dev.qkv(0)
    o, _ = dev.landing(0, 0)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm the kernels up outside the capture
        flags.signal(0, 0)
        flags.wait(0, 0, 0)
    side.synchronize()
    with torch.cuda.graph(graph):
        q.copy_(x * 2)
        flags.signal(0, 1)
        flags.wait(0, 0, 1)
        out.copy_(o)
    for step in range(2):
        base = host.post(0, step, 4, [], layers=1)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        words = host.words(0)
        while int(words[SEND]) < base + 1:
            pass
        assert not done.query()  # parked on REPLY
        hq, _, _ = host.qkv(0)
        assert torch.equal(hq, torch.full((4, 2, 8), 2.0))
        host.landing(0, 0)[0].fill_(step + 5)
        host.node_words(0, 0)[REPLY] = base + 1
        done.synchronize()
        host.check(0)
        assert torch.equal(out.cpu(), torch.full((4, 2, 8), step + 5.0))
    unregister()
