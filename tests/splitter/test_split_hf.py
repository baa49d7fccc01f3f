"""Split tiny HF models of eight architectures; the chained slices must reproduce HF's logits."""
import pytest
import torch

from lamina.splitter import split_model

from tiny_models import ARCHS, tiny_model

# At least 3 ragged sequences of different lengths; longer than the sliding windows (4).
SEQS = [[(7 * i + 3) % 90 for i in range(n)] for n in (6, 13, 9)]


@pytest.fixture(scope="module", params=ARCHS)
def split(request):
    model = tiny_model(request.param)
    return request.param, model, split_model(model)


def test_slices_reproduce_hf_logits(split):
    arch, model, sm = split
    r = sm.verify(seqs=SEQS, split=0.5)
    assert r.prompt_diff < 1e-5, (arch, r)          # whole prompts
    assert r.continuation_diff < 1e-5, (arch, r)    # continuation over cached KV
    assert len(sm.slices) == len(sm.specs) + 1 == model.config.num_hidden_layers + 1


def test_attention_specs_match_config(split):
    arch, model, sm = split
    cfg = model.config
    heads = cfg.num_attention_heads
    for i, spec in enumerate(sm.specs):
        assert spec.layer == i and spec.num_heads == heads
        assert spec.num_kv_heads == getattr(cfg, "num_key_value_heads", heads)
        if arch == "mistral":
            assert spec.window == 4
        if arch == "gemma2":
            assert spec.softcap == 2.0
            # alternating sliding / global layers
            assert spec.window == (4 if cfg.layer_types[i] == "sliding_attention" else None)
        if arch not in ("mistral", "gemma2"):
            assert spec.window is None and spec.softcap is None


def test_llama_context_is_exactly_the_residual_stream():
    model = tiny_model("llama")
    sm = split_model(model)
    hidden = model.config.hidden_size
    for info, ctx in zip(sm.infos[:-1], sm.partition.contexts):
        assert len(ctx) == 1
        assert info.context_bytes == hidden * 4  # float32
    spec = sm.specs[0]
    assert sm.infos[0].qkv_bytes == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * 4


def test_sampled_rows_only(split):
    """The last slice computes logits only for ``sample_rows``."""
    arch, model, sm = split
    ids = torch.tensor(SEQS[1])
    pos = torch.arange(len(ids))
    from lamina.splitter.reference import ReferenceKV
    kv = ReferenceKV()
    rows = torch.tensor([3, len(ids) - 1])
    out = sm.forward(ids, pos, rows, lambda l, q, k, v: kv.attend(0, l, q, k, v, pos, sm.specs[l]))
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0, rows]
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen2")
    sm = split_model(model)
    sm.save(tmp_path / "split")
    loaded = type(sm).load(tmp_path / "split")
    assert [i.inputs for i in loaded.infos] == [i.inputs for i in sm.infos]
    assert loaded.specs == sm.specs
    loaded.source = model  # a loaded split has no source; attach it to verify
    r = loaded.verify(seqs=SEQS)
    assert r.max_abs_diff < 1e-5
