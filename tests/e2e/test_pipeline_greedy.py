"""Staggered pipelining keeps greedy outputs token-identical to HF (so identical across none,
fixed and rotational) with 1-3 compute replicas and 2-4 micro-batches, on tiny llama/gpt2 and
on the builtin SmolLM2 (slow). Every role runs in this process (the replica core), except
one case of attention mini-batches under ``placement="procs"`` (slow); tests/e2e/
test_pipeline_processes.py and tests/instance/ cover pipelining across processes."""
import pytest

from lamina import LLM, SamplingParams
from lamina.engine.micro_batch_choice import MicroBatchChoice
from lamina.models import load_model

from hf_oracle import hf_greedy, tiny_case

MAX_NEW = 10
PROMPTS = [[(11 * i + 7 * j + 5) % 90 + 3 for j in range(n)]
           for i, n in enumerate((3, 17, 1, 9, 22, 5, 12, 7))]
# (pipeline, compute replicas, micro-batches, memory setup); every role in this process
# unless the setup names a placement
CONFIGS = [
    ("none", 1, 1, dict(memory=2)),
    ("fixed", 1, 2, dict(memory=2)),
    ("fixed", 2, 2, dict(memory=1)),
    ("fixed", 3, 4, dict(memory=3)),
    ("rotational", 1, 2, dict(memory=2)),
    ("rotational", 2, 3, dict(memory=2)),
    ("rotational", 3, 4, dict(memory=2)),
    # 24 slots per node: requests span two nodes, queue and get preempted while others are in
    # flight in another micro-batch
    ("rotational", 2, 3, dict(memory=2, kv_cache_tokens=24)),
    # communication-attention overlap: each node's share of a layer in mini-batches
    ("none", 1, 1, dict(memory=2, attn_parts=3)),
    ("rotational", 1, 2, dict(memory=3, attn_parts=2, kv_cache_tokens=40)),
    ("fixed", 2, 2, dict(memory=2, attn_parts=2, kv_cache_tokens=24)),
    # the same mini-batches sent by a compute replica process to memory-node processes
    ("none", 1, 1, dict(memory=2, attn_parts=3, placement="procs")),
]
IDS = [f"{p}-N{c}-n{n}-M{m['memory']}{'-tight' if 'kv_cache_tokens' in m else ''}"
       f"{'-parts%d' % m['attn_parts'] if 'attn_parts' in m else ''}"
       f"{'-' + m['placement'] if 'placement' in m else ''}" for p, c, n, m in CONFIGS]
PARAMS = [pytest.param(c, id=i, marks=[pytest.mark.slow] if "placement" in c[3] else [])
          for c, i in zip(CONFIGS, IDS)]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request, tmp_path_factory):
    return tiny_case(request.param, tmp_path_factory, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("config", PARAMS)
def test_pipelined_greedy_matches_hf(tiny, config):
    folder, want = tiny
    pipeline, compute, n, mem = config
    with LLM(str(folder), compute=compute, micro_batches=n, pipeline=pipeline, **mem) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.error is None for o in outs)
        inst = llm.deployment.instances[0]
        worker = inst.engine.worker
        assert worker.times().steps > 0
        if n > 1:  # more than one micro-batch really was in flight
            assert worker.max_in_flight > 1
        assert [c.stats().used_slots for c in inst.nodes] == inst.engine.scheduler.cache.held


def test_adapting_micro_batches_switches_between_one_and_two_and_matches_hf(tiny):
    folder, want = tiny
    with LLM(str(folder), micro_batches=2, adapt_micro_batches=True, memory=2) as llm:
        engine = llm.deployment.instances[0].engine
        assert engine.choice.candidates == (2, 1)
        engine.choice = MicroBatchChoice((2, 1), window=1, keep=1)  # switch within 10 tokens
        fills = []  # (count chosen, micro-batches in flight) after each fill, all 8 running
        fill = engine._fill

        def logged(out):
            fill(out)
            if len(engine.scheduler.running) == len(PROMPTS):
                fills.append((engine.choice.current, len(engine._in_flight)))
        engine._fill = logged
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert set(engine.choice.rates) == {1, 2}
        assert (1, 1) in fills and (2, 2) in fills  # one micro-batch held all 8, and two 4 each


def test_adapting_needs_one_replica_and_two_micro_batches():
    with pytest.raises(ValueError, match="adapt_micro_batches"):
        LLM("unused", compute=2, adapt_micro_batches=True)
    with pytest.raises(ValueError, match="adapt_micro_batches"):
        LLM("unused", micro_batches=1, adapt_micro_batches=True)


@pytest.mark.slow
@pytest.mark.parametrize("config", [("rotational", 2, 3, 1), ("fixed", 1, 2, 1),
                                    ("rotational", 1, 2, 2), ("rotational", 3, 4, 1)],
                         ids=["rotational-N2-n3", "fixed-N1-n2", "rotational-N1-n2-parts2",
                              "rotational-N3-n4"])
def test_smollm2_pipelined_greedy_matches_hf(config):
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Hello",
             "Write a haiku about the sea.", "In 1492, Columbus"]
    loaded = load_model("smollm2")
    ids = [loaded.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    want = hf_greedy(loaded.model, ids, 12)
    pipeline, compute, n, parts = config
    with LLM("smollm2", memory=2, compute=compute, micro_batches=n, pipeline=pipeline,
             attn_parts=parts) as llm:
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
