"""Model loading: HF folders, GGUF files, factories, aliases, and clear errors naming the path."""
import pytest
import torch
import transformers

from lamina.models import ModelLoadError, default_dtype, load_model


def test_default_dtype():
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16


def test_hf_folder(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.dtype == torch.float32 and loaded.is_hf
    assert loaded.tokenizer is None  # no tokenizer saved: still loads
    sd = model.state_dict()
    for k, v in loaded.model.state_dict().items():
        torch.testing.assert_close(v, sd[k])


def test_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path / "nope")):
        load_model(tmp_path / "nope")


def test_folder_without_config_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*no config.json"):
        load_model(tmp_path)


def test_corrupt_gguf_names_it(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad)


def test_corrupt_weights_name_the_folder(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=str(tmp_path / "m")):
        load_model(tmp_path / "m")


def test_unknown_alias_or_factory():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="no_such_module_xyz:f"):
        load_model("no_such_module_xyz:f")


def test_factory():
    loaded = load_model("torch.nn:Identity")
    assert isinstance(loaded.model, torch.nn.Identity) and not loaded.is_hf


def test_loading_prints_no_progress_bar(tmp_path, capfd):
    """transformers' "Loading weights" bar stays off a user's terminal, and is restored after."""
    from transformers.utils import logging as hf_logging

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    capfd.readouterr()
    load_model(str(tmp_path))
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err
    assert hf_logging.is_progress_bar_enabled()
