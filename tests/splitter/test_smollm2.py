"""The builtin SmolLM2 (30 layers, GQA 9/3) through the alias: split, verify, context size."""
import pytest
import torch

from lamina.models import load_model
from lamina.splitter import split_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model("smollm2")
    return loaded, split_model(loaded.model)


def test_smollm2_split_matches_transformers(smollm2):
    loaded, sm = smollm2
    assert len(sm.specs) == 30 and len(sm.slices) == 31
    assert (sm.specs[0].num_heads, sm.specs[0].num_kv_heads, sm.specs[0].head_dim) == (9, 3, 64)
    tok = loaded.tokenizer
    seqs = [tok(t).input_ids for t in ("The capital of France is",
                                       "def fibonacci(n):\n    if n < 2:\n        return n",
                                       "Once upon a time, in a land far away, there lived")]
    r = sm.verify(seqs=seqs)
    # float32 through 30 layers; logits are O(10)
    assert r.prompt_diff < 1e-3 and r.continuation_diff < 1e-3, r


def test_smollm2_context_is_the_residual(smollm2):
    loaded, sm = smollm2
    hidden = loaded.model.config.hidden_size
    assert all(i.context_bytes == hidden * 4 for i in sm.infos[:-1])
    assert all(len(c) == 1 for c in sm.partition.contexts)
