"""Splits kept on disk: a model is exported and cut once per host, not once per process.

``torch.export`` of SmolLM2 takes ~40 s on one core; every process that runs a compute replica
(the engine's, each ``procs`` replica, each Ray actor) needs the split. :func:`load_split`
returns it from ``$LAMINA_CACHE/splits/<key>/`` (a :meth:`SplitModel.save` folder: the
slices' source and their weights as safetensors, :mod:`lamina.splitter.folder`) or splits the
model and stores it there, written to a temporary folder and renamed, so concurrent processes
never read half a split. The entry also keeps the engine's record of the model
(:func:`store_record`: stop ids, limits, tokenizer), so a warm engine loads no model.

The key pins everything the split depends on: the model's files (path, size and modification
time of each; for a builtin alias its GGUF; for a ``package.module:function`` factory the
module's source file), dtype, device, and the versions of torch, transformers and Lamina's
splitter source. A model whose files cannot be named (a factory without a source file) is not
cached. ``LAMINA_SPLIT_CACHE=0`` turns the cache off, a path moves it; a folder that cannot be
read is split again (and replaced). Nothing here is pickled, and nothing is on the data plane: the
folder is read only by this host's own processes, which run the slices' source as written.
"""
from __future__ import annotations

import hashlib
from importlib import metadata
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from lamina.models import cache_dir, model_files
from lamina import env
from lamina import splitter
from lamina.splitter import SplitModel, split_model
from lamina.splitter.errors import SplitError
from lamina.splitter.folder import WEIGHTS
from lamina.stages import stage
from lamina.types import AttentionSpec

_SPLITTER = Path(splitter.__file__).resolve().parent  # its source is part of the key
RECORD = "model.json"  # the engine's record of the model (store_record)


def split_dir() -> Path | None:
    """``LAMINA_SPLIT_CACHE``: unset -> ``$LAMINA_CACHE/splits``; ``0``/``off`` -> None (no
    cache); anything else -> that folder."""
    v = env.text("LAMINA_SPLIT_CACHE").strip()
    if v.lower() in ("0", "false", "no", "off"):
        return None
    return Path(v).expanduser() if v else cache_dir() / "splits"


def split_key(name: str, dtype: torch.dtype, device: torch.device | str) -> str | None:
    """A digest of what the split of ``name`` depends on; None when it cannot be pinned."""
    files = model_files(str(name))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    for src in sorted(_SPLITTER.glob("*.py")):
        h.update(src.read_bytes())
    d = torch.device(device)
    h.update(f"{name}|{dtype}|{'cpu' if d.type == 'cpu' else d}|{torch.__version__}|"
             f"{metadata.version('transformers')}".encode())  # not imported: ~1 s a role
    return h.hexdigest()[:24]


def _read(folder: Path, device: torch.device | str) -> SplitModel | None:
    try:
        return SplitModel.load(folder, device)
    except SplitError:
        shutil.rmtree(folder, ignore_errors=True)  # unreadable: split again
        return None


def _entry(name: str, dtype: torch.dtype, device: torch.device | str) -> Path | None:
    """The cache folder of this key (it may not exist), or None (no cache, or not cacheable)."""
    root = split_dir()
    key = split_key(name, dtype, device) if root is not None else None
    return root / key if key is not None else None


def cached_layout(name: str, dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[list[AttentionSpec], int] | None:
    """``(attention specs, number of slices)`` of the cached split of ``name``, read from its
    ``split.json`` alone (no program, no weights), or None when there is no cached entry."""
    entry = _entry(name, dtype, device)
    if entry is None or not (entry / WEIGHTS).is_file() or not (entry / "split.json").is_file():
        return None
    try:
        m = json.loads((entry / "split.json").read_text())
        return [AttentionSpec(**s) for s in m["specs"]], len(m["infos"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_record(name: str, dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[dict[str, Any], Any] | None:
    """What the engine needs of the model besides the split, as :func:`store_record` kept it
    in the entry: ``(record, tokenizer or None)``; None where there is none (or it does not
    read), so the caller loads the model."""
    entry = _entry(name, dtype, device)
    if entry is None or not (entry / RECORD).is_file():
        return None
    try:
        record = json.loads((entry / RECORD).read_text())
        tokenizer = None
        if record.get("tokenizer"):
            import transformers
            tokenizer = transformers.AutoTokenizer.from_pretrained(entry / "tokenizer")
        return record, tokenizer
    except Exception:  # noqa: BLE001 - an unreadable record: load the model instead
        return None


def store_record(name: str, dtype: torch.dtype, device: torch.device | str,
                 record: dict[str, Any], tokenizer: Any) -> None:
    """Keep ``record`` (plain JSON data) and ``tokenizer`` (saved with ``save_pretrained``) in
    the entry of the cached split, so a later engine needs no model load; nothing where the
    split is not cached (or the disk refuses)."""
    entry = _entry(name, dtype, device)
    if entry is None or not (entry / "split.json").is_file():
        return
    tmp = entry / f"tokenizer.tmp{os.getpid()}"
    try:
        if tokenizer is not None and not (entry / "tokenizer").is_dir():
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, entry / "tokenizer")
        data = json.dumps({**record, "tokenizer": tokenizer is not None})
        (entry / f"{RECORD}.tmp{os.getpid()}").write_text(data)
        os.replace(entry / f"{RECORD}.tmp{os.getpid()}", entry / RECORD)
    except Exception:  # noqa: BLE001 - a full disk, a lost race, a tokenizer that will not save:
        pass  # the next engine loads the model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split(load: Callable[[], torch.nn.Module]) -> SplitModel:
    model = load()
    with stage("split: export and cut"):
        return split_model(model)


def load_split(name: str, dtype: torch.dtype, device: torch.device | str,
               load: Callable[[], torch.nn.Module]) -> SplitModel:
    """The split of model ``name`` in ``dtype`` on ``device``: from the cache, else
    ``split_model(load())``, stored for the next process. ``load`` is called only on a miss."""
    folder = _entry(name, dtype, device)
    if folder is None:
        return _split(load)
    key = folder.name
    if (folder / "split.json").is_file():
        with stage("split: read cache"):
            split = _read(folder, device)
        if split is not None:
            return split
    split = _split(load)
    tmp = folder.with_name(f"{key}.tmp{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with stage("split: store"):
            split.save(tmp)
        (tmp / "key.json").write_text(json.dumps({"model": str(name), "dtype": str(dtype),
                                                  "device": str(device)}))
        os.replace(tmp, folder)  # atomic; fails if another process stored it first
    except OSError:
        pass  # a full disk or a lost race: this process has its split all the same
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return split
