"""SliceGraphs: padded replays equal the eager slices; outputs belong to the caller.

The padding, token-dimension and ownership logic runs on CPU through EagerGraph (the same
static-buffer semantics as a CUDA graph); the CUDA capture itself is tested under ``gpu``.
"""
import os
import sys

import pytest
import torch

from lamina.computenode.cuda_graphs import SliceGraphs, capture_sizes, unavailable
from lamina.computenode.replica import ComputeReplica
from lamina.splitter import split_model
from lamina.splitter.reference import ReferenceKV

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import ARCHS, tiny_model  # noqa: E402


def test_capture_sizes_like_vllm():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64)[-3:] == (48, 56, 64)
    with pytest.raises(ValueError):
        capture_sizes(0)


def _attend_fn(split, kv, pos, bounds):
    """Reference attention for requests whose tokens are ``bounds``-delimited runs of a step."""
    def attend(layer, q, k, v):
        return torch.cat([kv.attend(r, layer, q[a:b], k[a:b], v[a:b], pos[a:b], split.specs[layer])
                          for r, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    return attend


def _decode_logits(split, tokens, rows, run=None):
    """Logits of ``rows`` of a decode step of ``tokens`` requests, each with 6 cached tokens
    (prefilled eagerly); the decode step runs through ``run`` when given."""
    g = torch.Generator().manual_seed(tokens)
    kv = ReferenceKV()
    prefix = torch.randint(0, 60, (tokens * 6,), generator=g)
    pos = torch.arange(6).repeat(tokens)
    with torch.inference_mode():
        split.forward(prefix, pos, torch.tensor([0]), _attend_fn(split, kv, pos, list(range(0, 6 * tokens + 1, 6))))
        ids = torch.randint(0, 60, (tokens,), generator=g)
        pos = torch.full((tokens,), 6)
        return split.forward(ids, pos, torch.arange(tokens - rows, tokens),
                             _attend_fn(split, kv, pos, list(range(tokens + 1))), run)


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_replay_equals_eager(arch):
    split = split_model(tiny_model(arch))
    graphs = SliceGraphs(split, "cpu", capture_sizes(8), eager=True)
    for tokens, rows in ((1, 1), (3, 3), (5, 2), (8, 8), (11, 11)):
        before = graphs.replays
        want = _decode_logits(split, tokens, rows)
        got = _decode_logits(split, tokens, rows, graphs)
        assert got.shape == want.shape and got.shape[0] == rows
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        replayed = graphs.replays - before
        assert replayed == (0 if tokens > 8 else len(split.slices)), (tokens, replayed)


def test_outputs_survive_the_next_replay():
    """Two micro-batches of the same size through one graph: the first one's context must
    not change when the second replays (outputs are cloned out of the static buffers)."""
    split = split_model(tiny_model("llama"))
    graphs = SliceGraphs(split, "cpu", (4,), eager=True)
    a = split.start(torch.tensor([1, 2, 3]), torch.arange(3), torch.arange(3))
    b = split.start(torch.tensor([7, 8, 9]), torch.arange(3), torch.arange(3))
    with torch.inference_mode():
        ctx_a, _, _ = split.advance(0, a, graphs)
        kept = {n: t.clone() for n, t in ctx_a.items()}
        split.advance(0, b, graphs)
    for n, t in kept.items():
        assert torch.equal(ctx_a[n], t), n


def test_replica_refuses_graphs_without_cuda():
    why = unavailable(torch.device("cpu"))
    assert "CUDA compute device" in why
    with pytest.raises(RuntimeError, match="CUDA"):
        ComputeReplica(split_model(tiny_model("llama")), "cpu", cuda_graph_tokens=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_equals_eager_on_gpu():
    split = split_model(tiny_model("llama").cuda())
    graphs = SliceGraphs(split, "cuda", capture_sizes(16))
    for tokens in (1, 3, 16, 17):
        ids = torch.randint(0, 60, (tokens,), device="cuda")
        pos = torch.arange(40, 40 + tokens, device="cuda")
        rows = torch.arange(tokens, device="cuda")
        with torch.inference_mode():
            zero = lambda k, q, kk, v: torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # noqa: E731
            want = split.forward(ids, pos, rows, zero)
            got = split.forward(ids, pos, rows, zero, graphs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_replica_runs_its_slices_through_the_graphs():
    split = split_model(tiny_model("llama"))
    replica = ComputeReplica(split, "cpu")
    want = _decode_logits(split, 4, 4)
    replica.graphs = SliceGraphs(split, "cpu", (4,), eager=True)
    values = split.start(torch.tensor([3, 4]), torch.arange(2), torch.arange(2))
    replica.run_slice(0, values)
    assert replica.graphs.replays == 1
    torch.testing.assert_close(_decode_logits(split, 4, 4, replica.graphs), want, rtol=1e-5, atol=1e-5)
