"""A lone micro-batch's step in one C++ call (``ComputeReplica.run_step``: every slice's program
chained, each layer attended by the memory node's plane) computes what the slice-at-a-time path
computes, bit for bit, and leaves the node in the same state; where a layer's exchange declines,
the caller takes over at that layer and still gets the same; an in-process ``LLM`` runs its
lone micro-batches this way and matches transformers; a replica process's ring exchange does the
same over shared memory."""
import os
import sys
import threading
import time

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.computenode.replica import ComputeReplica
from lamina.kernels import cpp_ext
from lamina.memnode.native import plane_for, unavailable
from lamina.memnode.node import MemoryNode
from lamina.memnode.server import handle
from lamina.splitter import split_model
from lamina.splitter.slices import ATTN_OUT
from lamina.transport import codec
from lamina.transport.shm import shm_pair
from lamina.transport.wire import MsgKind
from lamina.types import AttendMsg, AttendResult, PrepareMsg, ShardWork

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


def _stepwise(replica, attend, step_id, values, k=0):
    """The slice-at-a-time path from slice k, ``attend(AttendMsg) -> AttendResult`` for each
    layer: the logits of the last slice."""
    while True:
        context, qkv, logits = replica.run_slice(k, values)
        if context is None:
            return logits
        context[ATTN_OUT] = attend(AttendMsg(step_id, k, *qkv)).o
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
        stamps = _stamps(replica)
        k, sent, context, qkv, got = replica.run_step(step_id, _values(split, ids, pos),
                                                      exchange, stamps)
        exchange.done()
        assert (k, sent, context, qkv) == (split.num_layers, False, None, None)
        _check_stamps(stamps.tolist(), k)
        want = _stepwise(replica, other.attend, step_id, _values(split, ids, pos))
        assert torch.equal(got, want)
    assert torch.equal(one.pool.k_cache, other.pool.k_cache)
    assert torch.equal(one.pool.v_cache, other.pool.v_cache)


def _stamps(replica) -> torch.Tensor:
    """A stamps buffer full of garbage (run_step must clear what it does not write)."""
    return torch.full((len(replica.split.slices), replica.step.STAMP_COLS), -7, dtype=torch.int64)


def _check_stamps(rows: list[list[int]], k: int, answered: int | None = None) -> None:
    """Row j <= k of a run_step's stamps, on one clock: the slice, then its exchange's send,
    the node's attend and the return, before the next slice (layers < ``answered``, all below
    k by default, were answered in the call; layer k, if not the last, is only sent)."""
    answered = k if answered is None else answered
    for j, (start, end, sent, n0, n1, back) in enumerate(rows):
        if j > k:
            assert (start, end, sent, n0, n1, back) == (0, 0, 0, 0, 0, 0)
            continue
        assert 0 < start <= end
        if j == len(rows) - 1:  # the last slice samples: no exchange
            assert (sent, n0, n1, back) == (0, 0, 0, 0)
        elif j < answered:
            assert end <= sent <= n0 <= n1 <= back <= rows[j + 1][0]
        else:
            assert end <= sent <= back and (n0, n1) == (0, 0)


def test_a_layer_the_exchange_declines_is_the_callers_from_there():
    replica = ComputeReplica(split_model(tiny_model("llama")), "cpu")
    split = replica.split
    one, other = _node(split), _node(split)
    step_id, works, ids, pos = next(_steps())
    for node in (one, other):
        node.prepare(PrepareMsg(step_id, works))
    progress = one._steps[step_id].progress  # shared with the plane: layer 1 looks attended
    progress[1] = -1
    k, sent, context, qkv, logits = replica.run_step(step_id, _values(split, ids, pos),
                                                     one.native_exchange())
    assert k == 1 and not sent and logits is None and context is not None
    progress[1] = 0
    context[ATTN_OUT] = one.attend(AttendMsg(step_id, 1, *qkv)).o  # the Python way
    got = _stepwise(replica, one.attend, step_id, context, 2)
    assert torch.equal(got, _stepwise(replica, other.attend, step_id, _values(split, ids, pos)))


def test_an_in_process_llm_runs_lone_steps_whole_and_matches_transformers(tmp_path,
                                                                           monkeypatch):
    from hf_oracle import hf_greedy
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    want = hf_greedy(model, [PROMPT], 8)
    whole = []
    real = ComputeReplica.run_step

    def spy(self, *args):
        out = real(self, *args)
        whole.append(out[0] == self.split.num_layers)
        return out
    monkeypatch.setattr(ComputeReplica, "run_step", spy)
    with LLM(tiny_folder("llama", tmp_path), memory=1, placement="inproc") as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want
    assert len(whole) == 8 and all(whole)  # every step, prefill included, in one call


def test_a_traced_llm_still_runs_whole_steps_and_records_every_layer(tmp_path, monkeypatch):
    """With a timeline recording, lone steps still run in one C++ call, and the timeline shows
    each layer of each step as the slice-at-a-time path would: ``slice j``, ``send``, the
    node's ``attend j``, ``recv``, in that order."""
    calls = []
    real = ComputeReplica.run_step

    def spy(self, step_id, values, exchange, stamps=None):
        calls.append(stamps is not None)
        return real(self, step_id, values, exchange, stamps)
    monkeypatch.setattr(ComputeReplica, "run_step", spy)
    trace = tmp_path / "trace.json"
    with LLM(tiny_folder("llama", tmp_path), memory=1, placement="inproc",
             trace=str(trace)) as llm:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
        spans = llm.timeline.spans
    layers = tiny_model("llama").config.num_hidden_layers
    assert calls == [True] * 3
    for step in {s.args.get("step") for s in spans if s.role == "compute"}:
        comp = sorted((s for s in spans if s.role == "compute" and s.args.get("step") == step),
                      key=lambda s: s.start_ns)
        names = [s.name for s in comp]
        want = []
        for j in range(layers):
            want += [f"slice {j}", "send", "recv"]
        assert names == want + [f"slice {layers} + sample"]
        attends = sorted((s for s in spans if s.role == "memory" and s.args.get("step") == step),
                         key=lambda s: s.start_ns)
        assert [s.name for s in attends] == [f"attend {j}" for j in range(layers)]
        for j, a in enumerate(attends):  # between its send and its recv
            assert comp[3 * j + 1].start_ns <= a.start_ns <= a.end_ns <= comp[3 * j + 2].start_ns


class RingNode:
    """``node`` served over a shm link by a thread (as a node's process serves its rings):
    ``client`` is the replica's end. ``delay``: layer -> seconds to wait before answering."""

    def __init__(self, node: MemoryNode, delay: dict[int, float] | None = None) -> None:
        self.node, self.delay = node, delay or {}
        self.client, self.end = shm_pair(capacity=1 << 22, spin_us=0.0, wake_interval=0.002)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                msg = self.end.recv(0.05)
            except TimeoutError:
                continue
            if msg.kind == MsgKind.ATTEND:
                time.sleep(self.delay.get(msg.layer, 0.0))
            self.end.send(handle(self.node, msg))

    def prepare(self, msg: PrepareMsg, wait: bool = True) -> None:
        """PREPARE; ``wait``: take its OK here (else it stays first in the ring)."""
        self.client.send(codec.to_message(msg))
        if wait:
            assert self.client.recv(5).kind == MsgKind.OK

    def attend(self, msg: AttendMsg) -> AttendResult:  # the Python way
        self.client.send(codec.to_message(msg))
        return codec.from_message(self.client.recv(5))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.client.close()
        self.end.close()


@pytest.mark.parametrize("late", [None, 1])  # the tiny llama has 2 layers
def test_a_whole_step_over_a_ring_is_the_stepwise_path(late):
    """A replica process's exchange (lamina/transport/csrc/shm_ring.cpp RingExchange): every
    layer answered in the call, or, where a RESULT comes late (layer ``late``), the call
    returns with that layer's ATTEND out and the caller receives its RESULT and goes on. In
    time, the PREPARE's OK is left in the ring for the exchange to drop (as a replica's is)."""
    replica = ComputeReplica(split_model(tiny_model("llama")), "cpu")
    split = replica.split
    ring = RingNode(MemoryNode(split.specs, 256, slab_size=8),
                    {late: 0.2} if late is not None else None)
    other = MemoryNode(split.specs, 256, slab_size=8)
    try:
        for step_id, works, ids, pos in _steps():
            ring.prepare(PrepareMsg(step_id, works), wait=late is not None)
            other.prepare(PrepareMsg(step_id, works))
            want = _stepwise(replica, other.attend, step_id, _values(split, ids, pos))
            exchange = ring.client.native_exchange(MsgKind.ATTEND, 0, MsgKind.RESULT,
                                                   int(0.05e9), 0,  # waits ~50 ms a layer
                                                   skip=MsgKind.OK)
            assert exchange is not None
            stamps = _stamps(replica)
            try:
                k, sent, context, qkv, got = replica.run_step(step_id, _values(split, ids, pos),
                                                              exchange, stamps)
            finally:
                exchange.done()
            _check_stamps(stamps.tolist(), k, late)
            if late is None:
                assert (k, sent) == (split.num_layers, False)
            else:
                assert (k, sent) == (late, True)
                context[ATTN_OUT] = codec.from_message(ring.client.recv(5)).o
                got = _stepwise(replica, ring.attend, step_id, context, late + 1)
            assert torch.equal(got, want)
    finally:
        ring.close()


@pytest.mark.parametrize("prompts", [1, 2])
def test_only_a_micro_batch_the_engine_calls_alone_waits_in_place(tmp_path, monkeypatch,
                                                                  prompts):
    """With two micro-batch slots, one request fills one slot: the engine submits it ``alone``
    and its steps run whole in C++. Two requests fill both: neither is alone, so no step runs
    whole and no RESULT is waited for in place (each micro-batch's slices run while the other's
    attention does); outputs equal transformers either way."""
    from hf_oracle import hf_greedy
    from lamina.instance.inproc import InProcessReplicas
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    batch = [PROMPT, [5, 9, 2]][:prompts]
    want = hf_greedy(model, batch, 6)
    whole, in_place, plans = [], [], []
    real_step, real_exchange = ComputeReplica.run_step, InProcessReplicas.exchange
    real_submit = InProcessReplicas.submit

    def run_step(self, *args):
        whole.append(args[0])
        return real_step(self, *args)

    def exchange(self, *args):
        in_place.append(args)
        return real_exchange(self, *args)

    def submit(self, slot, plan, *args):
        plans.append(plan.alone)
        return real_submit(self, slot, plan, *args)
    monkeypatch.setattr(ComputeReplica, "run_step", run_step)
    monkeypatch.setattr(InProcessReplicas, "exchange", exchange)
    monkeypatch.setattr(InProcessReplicas, "submit", submit)
    with LLM(tiny_folder("llama", tmp_path), memory=1, placement="inproc", micro_batches=2,
             pipeline="rotational") as llm:
        out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want
    if prompts == 1:
        assert plans == [True] * 6 and len(whole) == 6
    else:
        assert plans == [False] * 12 and whole == [] and in_place == []
