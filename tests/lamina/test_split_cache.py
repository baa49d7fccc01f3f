"""lamina/split_cache.py: a split is stored once and read back by the next process; its key
follows the model's files, dtype and device; the cache can be turned off; a broken entry is
split again."""
import os
import sys

import pytest
import torch

from lamina import split_cache
from lamina.models import load_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINA_SPLIT_CACHE", str(tmp_path / "splits"))
    return tiny_folder("llama", tmp_path / "llama")


def _split(name, calls):
    def load():
        calls.append(name)
        return load_model(name).model
    return split_cache.load_split(name, torch.float32, "cpu", load)


def _logits(split):
    ids = torch.tensor([5, 9, 2])
    with torch.inference_mode():
        return split.forward(ids, torch.arange(3), torch.arange(3),
                             lambda k, q, key, v: torch.zeros_like(q))


def test_second_process_reads_the_stored_split(model, tmp_path):
    calls = []
    first = _split(model, calls)
    entries = list((tmp_path / "splits").iterdir())
    assert len(entries) == 1 and (entries[0] / "weights.safetensors").is_file()
    second = _split(model, calls)
    assert calls == [model]  # the model was loaded and exported once
    assert second is not first and torch.equal(_logits(first), _logits(second))


def test_cached_layout_reads_the_specs_without_the_split(model):
    assert split_cache.cached_layout(model, torch.float32, "cpu") is None  # nothing cached yet
    split = _split(model, [])
    specs, num_slices = split_cache.cached_layout(model, torch.float32, "cpu")
    assert specs == split.specs and num_slices == len(split.slices)
    assert split_cache.cached_layout(model, torch.bfloat16, "cpu") is None  # another key


def test_engine_info_reads_the_split_only_when_used(model):
    """A warm cache gives the engine the specs from split.json; the split itself (which only
    in-process replicas run) is read on first use; a cold one splits at once."""
    from lamina.instance import _load_model_info
    cold = _load_model_info(model, torch.float32, torch.device("cpu"))
    assert cold._split is not None and cold.specs == cold.split.specs
    warm = _load_model_info(model, torch.float32, torch.device("cpu"))
    assert warm._split is None and (warm.specs, warm.num_slices) == (cold.specs,
                                                                     cold.num_slices)
    assert torch.equal(_logits(warm.split), _logits(cold.split)) and warm._split is not None


def test_a_warm_engine_needs_no_model_load(model, monkeypatch):
    """The first engine keeps its record of the model (stop ids, limits, tokenizer) in the
    cache entry; the next one starts from it and the split's layout without loading the
    model."""
    import tokenizers
    import transformers

    from lamina import instance
    vocab = {f"w{i}": i for i in range(95)} | {"[UNK]": 95}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w7")
    tok.save_pretrained(model)
    cold = instance._load_model_info(model, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(instance, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    warm = instance._load_model_info(model, torch.float32, torch.device("cpu"))
    assert (warm.eos, warm.vocab_size, warm.max_model_len, warm.dtype) == \
        (cold.eos, cold.vocab_size, cold.max_model_len, cold.dtype)
    assert warm.tokenizer("w3 w9 w7")["input_ids"] == cold.tokenizer("w3 w9 w7")["input_ids"]
    assert warm.tokenizer.eos_token_id == 7


def test_key_follows_files_dtype_and_device(model):
    key = split_cache.split_key(model, torch.float32, "cpu")
    assert key == split_cache.split_key(model, torch.float32, "cpu:0")  # CPU cores share it
    assert key != split_cache.split_key(model, torch.bfloat16, "cpu")
    assert key != split_cache.split_key(model, torch.float32, "cuda:0")
    cfg = os.path.join(model, "config.json")
    st = os.stat(cfg)
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert key != split_cache.split_key(model, torch.float32, "cpu")
    assert split_cache.split_key("/no/such/model", torch.float32, "cpu") is None


def test_factory_is_keyed_by_its_module_file():
    key = split_cache.split_key("lamina.models:smollm2_shaped", torch.float32, "cpu")
    assert key is not None
    assert split_cache.split_key("no_such_module_xyz:f", torch.float32, "cpu") is None


def test_off_splits_every_time_and_stores_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINA_SPLIT_CACHE", "0")
    calls = []
    _split(model, calls)
    _split(model, calls)
    assert calls == [model, model] and not (tmp_path / "splits").exists()


def test_unreadable_entry_is_split_again_and_replaced(model, tmp_path):
    calls = []
    _split(model, calls)
    (entry,) = (tmp_path / "splits").iterdir()
    (entry / "weights.safetensors").write_bytes(b"not weights")
    again = _split(model, calls)
    assert calls == [model, model]
    assert (entry / "weights.safetensors").stat().st_size > 100  # stored afresh
    assert _logits(again).shape[-1] > 0
