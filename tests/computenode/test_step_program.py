"""A lone micro-batch's step in one C++ call (``ComputeReplica.run_step``: every slice's program
chained, each layer attended by the memory node's plane) computes what the slice-at-a-time path
computes, bit for bit, and leaves the node in the same state; where a layer's exchange declines,
the caller takes over at that layer and still gets the same; an in-process ``LLM`` runs its
lone micro-batches this way and matches transformers."""
import os
import sys

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.computenode.replica import ComputeReplica
from lamina.kernels import cpp_ext
from lamina.memnode.native import plane_for, unavailable
from lamina.memnode.node import MemoryNode
from lamina.splitter import split_model
from lamina.splitter.slices import ATTN_OUT
from lamina.types import AttendMsg, PrepareMsg, ShardWork

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from tiny_models import tiny_folder, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not cpp_ext.available(), reason="C++ extension unavailable")
PROMPT = [7, 3, 11, 42, 5]


def _node(split) -> MemoryNode:
    node = MemoryNode(split.specs, 256, slab_size=8)
    why = unavailable(node)
    if why is not None:
        pytest.skip(f"no native plane here: {why}")
    node.plane = plane_for(node)
    return node


def _steps():
    """(step id, works, token ids, positions): a prefill of PROMPT, then two decode tokens."""
    yield 1, [ShardWork(0, 0, 5, 0, 5)], PROMPT, list(range(5))
    yield 2, [ShardWork(0, 5, 1, 5, 1)], [9], [5]
    yield 3, [ShardWork(0, 6, 1, 6, 1)], [4], [6]


def _values(split, ids, pos):
    return split.start(torch.tensor(ids), torch.tensor(pos), torch.tensor([len(ids) - 1]))


def _stepwise(replica, node, step_id, values, k=0):
    """The slice-at-a-time path from slice k: the logits of the last slice."""
    while True:
        context, qkv, logits = replica.run_slice(k, values)
        if context is None:
            return logits
        context[ATTN_OUT] = node.attend(AttendMsg(step_id, k, *qkv)).o
        values, k = context, k + 1


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding windows, soft caps
def test_a_whole_step_is_the_stepwise_path_bit_for_bit(arch):
    replica = ComputeReplica(split_model(tiny_model(arch)), "cpu")
    assert replica.step is not None
    split = replica.split
    one, other = _node(split), _node(split)
    for step_id, works, ids, pos in _steps():  # a step not ended on the node fails the next
        for node in (one, other):
            node.prepare(PrepareMsg(step_id, works))
        exchange = one.native_exchange()
        k, context, qkv, got = replica.run_step(step_id, _values(split, ids, pos), exchange)
        exchange.done()
        assert (k, context, qkv) == (split.num_layers, None, None)
        want = _stepwise(replica, other, step_id, _values(split, ids, pos))
        assert torch.equal(got, want)
    assert torch.equal(one.pool.k_cache, other.pool.k_cache)
    assert torch.equal(one.pool.v_cache, other.pool.v_cache)


def test_a_layer_the_exchange_declines_is_the_callers_from_there():
    replica = ComputeReplica(split_model(tiny_model("llama")), "cpu")
    split = replica.split
    one, other = _node(split), _node(split)
    step_id, works, ids, pos = next(_steps())
    for node in (one, other):
        node.prepare(PrepareMsg(step_id, works))
    progress = one._steps[step_id].progress  # shared with the plane: layer 1 looks attended
    progress[1] = -1
    k, context, qkv, logits = replica.run_step(step_id, _values(split, ids, pos),
                                               one.native_exchange())
    assert k == 1 and logits is None and context is not None
    progress[1] = 0
    context[ATTN_OUT] = one.attend(AttendMsg(step_id, 1, *qkv)).o  # the Python way
    got = _stepwise(replica, one, step_id, context, 2)
    assert torch.equal(got, _stepwise(replica, other, step_id, _values(split, ids, pos)))


def test_an_in_process_llm_runs_lone_steps_whole_and_matches_transformers(tmp_path,
                                                                           monkeypatch):
    from hf_oracle import hf_greedy
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    want = hf_greedy(model, [PROMPT], 8)
    whole = []
    real = ComputeReplica.run_step

    def spy(self, step_id, values, exchange):
        out = real(self, step_id, values, exchange)
        whole.append(out[0] == self.split.num_layers)
        return out
    monkeypatch.setattr(ComputeReplica, "run_step", spy)
    with LLM(tiny_folder("llama", tmp_path), memory=1, placement="inproc") as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want
    assert len(whole) == 8 and all(whole)  # every step, prefill included, in one call
