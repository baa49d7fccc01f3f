"""Splits kept on disk: a model is exported and cut once per host, not once per process.

``torch.export`` of SmolLM2 takes ~40 s on one core; every process that runs a compute replica
(the engine's, each ``procs`` replica, each Ray actor) needs the split. :func:`load_split`
returns it from ``$LAMINA_CACHE/splits/<key>/`` (a :meth:`SplitModel.save` folder, ~14 s to
read for SmolLM2 in float32) or splits the model and stores it there, written to a temporary
folder and renamed, so concurrent processes never read half a split.

The key pins everything the split depends on: the model's files (path, size and modification
time of each; for a builtin alias its GGUF; for a ``package.module:function`` factory the
module's source file), dtype, device, and the versions of torch, transformers and Lamina's
splitter source. A model whose files cannot be named (a factory without a source file) is not
cached. ``LAMINA_SPLIT_CACHE=0`` turns the cache off, a path moves it; a folder that cannot be
read is split again (and replaced). Nothing here is pickled on the data plane: the folder is torch.export's
format plus a JSON file, read only by this host's own processes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch

from lamina.models import cache_dir, model_files
from lamina import env
from lamina import splitter
from lamina.splitter import SplitModel, split_model
from lamina.splitter.errors import SplitError
from lamina.stages import stage
from lamina.types import AttentionSpec

_SPLITTER = Path(splitter.__file__).resolve().parent  # its source is part of the key


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
    import transformers

    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    for src in sorted(_SPLITTER.glob("*.py")):
        h.update(src.read_bytes())
    d = torch.device(device)
    h.update(f"{name}|{dtype}|{'cpu' if d.type == 'cpu' else d}|{torch.__version__}|"
             f"{transformers.__version__}".encode())
    return h.hexdigest()[:24]


def _read(folder: Path) -> SplitModel | None:
    # torch's deserializer logs a warning per unused shape symbol, and warns (torch 2.11) about
    # the read-only buffer it loads weights from: not the user's business
    serde = logging.getLogger("torch._export.serde.serialize")
    level = serde.level
    serde.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable",
                                    category=UserWarning)
            return SplitModel.load(folder)
    except SplitError:
        shutil.rmtree(folder, ignore_errors=True)  # unreadable: split again
        return None
    finally:
        serde.setLevel(level)


def cached_layout(name: str, dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[list[AttentionSpec], int] | None:
    """``(attention specs, number of slices)`` of the cached split of ``name``, read from its
    ``split.json`` alone (no program, no weights), or None when there is no cached entry."""
    root = split_dir()
    key = split_key(name, dtype, device) if root is not None else None
    meta = root / key / "split.json" if key is not None else None
    if meta is None or not (meta.parent / "program.pt2").is_file() or not meta.is_file():
        return None
    try:
        m = json.loads(meta.read_text())
        return [AttentionSpec(**s) for s in m["specs"]], len(m["infos"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _split(load: Callable[[], torch.nn.Module]) -> SplitModel:
    model = load()
    with stage("split: export and cut"):
        return split_model(model)


def load_split(name: str, dtype: torch.dtype, device: torch.device | str,
               load: Callable[[], torch.nn.Module]) -> SplitModel:
    """The split of model ``name`` in ``dtype`` on ``device``: from the cache, else
    ``split_model(load())``, stored for the next process. ``load`` is called only on a miss."""
    root = split_dir()
    key = split_key(name, dtype, device) if root is not None else None
    if key is None:
        return _split(load)
    folder = root / key
    if (folder / "split.json").is_file():
        with stage("split: read cache"):
            split = _read(folder)
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
