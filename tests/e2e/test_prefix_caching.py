"""Prefix caching end to end on a tiny random llama (float32): traces whose requests share
prefixes (one shared stem, partial overlaps that split the tree, multi-turn conversations), run
in waves so later requests find earlier ones' KV cached. Greedy outputs equal HF generate's
(hence the uncached run's) under every placement and pipeline, including a pool so tight that
the cache is evicted and requests span nodes; the cached prompt tokens are reported."""
import pytest

from lamina import LLM, SamplingParams

from hf_oracle import hf_greedy
from tiny_models import tiny_folder, tiny_model

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _tokens(seed: int, n: int) -> list[int]:
    return [(13 * seed + 7 * j + 3 * j * j) % 90 + 3 for j in range(n)]


STEM = _tokens(1, 30)
SHARED = [[STEM + [5]],  # waves: each is one generate call
          [STEM + _tokens(2, k) for k in (1, 3, 5)] + [STEM[:20] + [9, 9]],
          [STEM, STEM + [5] + _tokens(3, 4)]]
OVERLAP = [[_tokens(4, 24)],
           [_tokens(4, 12) + _tokens(5, 10), _tokens(4, 18) + [7]],
           [_tokens(4, 12) + _tokens(5, 4) + [8, 8], _tokens(4, 6)]]
SETUPS = {
    "inproc": dict(memory=1),
    "inproc-uncached": dict(memory=1, prefix_caching=False),
    # 40 slots a node: the cache is evicted to make room and long requests span both nodes
    "inproc-tight": dict(memory=2, kv_cache_tokens=40),
    "inproc-rotational": dict(compute=2, memory=2),
    "procs": dict(memory=2, placement="procs"),
    "ray": dict(memory=2, placement="ray"),
}
SLOW = {"procs", "ray"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return tiny_folder("llama", tmp_path_factory.mktemp("llama")), model


def _conversations(model, turns: int) -> list[list[list[int]]]:
    """Two conversations as HF runs them: each turn's prompt is the last prompt, its greedy
    reply and a new user message."""
    convs = []
    for c in range(2):
        prompt, conv = _tokens(10 + c, 16), []
        for t in range(turns):
            conv.append(prompt)
            prompt = prompt + hf_greedy(model, [prompt], MAX_NEW)[0] + _tokens(20 + 3 * c + t, 5)
        convs.append(conv)
    return [[conv[t] for conv in convs] for t in range(turns)]  # waves: turn by turn


@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                   for s in SETUPS])
def test_cached_prefixes_keep_greedy_output(tiny, setup):
    folder, model = tiny
    traces = {"shared": SHARED, "overlap": OVERLAP, "multi-turn": _conversations(model, 3)}
    cached = {}
    with LLM(str(folder), **SETUPS[setup]) as llm:
        for name, waves in traces.items():
            cached[name] = []
            for wave in waves:
                outs = llm.generate(wave, GREEDY, use_tqdm=False)
                assert [o.error for o in outs] == [None] * len(wave)
                assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, wave, MAX_NEW), \
                    (name, wave)
                cached[name].append([o.num_cached_tokens for o in outs])
        inst = llm.deployment.instances[0]
        cache = inst.engine.scheduler.cache
        if cache is None:
            assert all(n == 0 for c in cached.values() for wave in c for n in wave)
            return
        # no request holds KV any more: the nodes hold exactly the cache
        assert [c.stats().used_slots for c in inst.nodes] == cache.held
    if setup == "inproc-tight":
        assert sum(n for c in cached.values() for wave in c for n in wave) > 0
        return
    assert cached["shared"] == [[0], [30, 30, 30, 20], [29, 31]]
    assert cached["overlap"] == [[0], [12, 18], [16, 5]]
    assert cached["multi-turn"][0] == [0, 0]
    for t, wave in enumerate(cached["multi-turn"][1:], 1):  # the whole previous turn, but
        assert all(n >= 16 + (t - 1) * (MAX_NEW + 5) + MAX_NEW - 1 for n in wave)  # its reply's last token
