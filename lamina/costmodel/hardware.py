"""Device catalog for the cost model and the planner.

The builtin catalog is ``configs/hardware.yaml`` (Lamina Table 1 plus a few more devices).
Users extend or override it with their own YAML files of the same shape, passed explicitly
or through ``$LAMINA_HARDWARE`` (one path, or several separated by ``os.pathsep``)::

    devices:
      - {name: H100, price_usd: 30000}          # override: only the fields given change
      - {name: MyBox, kind: cpu, price_usd: 8000, memory_gb: 768,
         mem_bw_gbps: 400, bf16_tflops: 4, nic_gbps: 100}   # new entry: every field required

Order of precedence, later wins: builtin, ``$LAMINA_HARDWARE`` files, explicit paths.
Units (GB = 1e9 bytes): ``memory_gb`` GB, ``mem_bw_gbps`` GB/s, ``bf16_tflops`` TFLOP/s,
``nic_gbps`` Gbit/s (bits!), ``price_usd`` US dollars. Any problem raises
:class:`CatalogError` naming the file and the entry.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from lamina import env as lamina_env

ENV_VAR = "LAMINA_HARDWARE"
KINDS = ("gpu", "cpu")
ROLES = ("compute", "memory")
_NUMERIC = ("price_usd", "memory_gb", "mem_bw_gbps", "bf16_tflops", "nic_gbps")


class CatalogError(ValueError):
    """A hardware catalog file is missing, malformed, or has an invalid entry."""


@dataclass(frozen=True)
class Device:
    """One purchasable device. Fields are in catalog units; properties convert to SI.

    Contract: ``kind`` in :data:`KINDS`; all numeric fields finite and > 0; ``roles`` a
    subset of :data:`ROLES`, empty meaning the kind's default (see :meth:`can`).
    """

    name: str
    kind: str
    price_usd: float
    memory_gb: float
    mem_bw_gbps: float  # GB/s
    bf16_tflops: float  # TFLOP/s, dense
    nic_gbps: float  # Gbit/s
    roles: tuple[str, ...] = ()

    def can(self, role: str) -> bool:
        """May the planner use this device as ``role``? Default: gpu both, cpu memory only."""
        return role in (self.roles or (ROLES if self.kind == "gpu" else ("memory",)))

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def mem_bw(self) -> float:
        """Memory bandwidth in bytes/s."""
        return self.mem_bw_gbps * 1e9

    @property
    def flops(self) -> float:
        """Peak dense BF16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def nic_bw(self) -> float:
        """Network bandwidth in bytes/s (``nic_gbps`` is in bits)."""
        return self.nic_gbps * 1e9 / 8


Catalog = dict[str, Device]
_FIELDS = tuple(f.name for f in fields(Device))
_REQUIRED = tuple(f for f in _FIELDS if f != "roles")


def builtin_catalog_path() -> Path:
    """Path of the builtin catalog: ``<repo>/configs/hardware.yaml`` in a source checkout or
    editable install, else the copy installed as package data ``lamina/configs/hardware.yaml``."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "configs", here / "configs"):
        if (candidate / "hardware.yaml").is_file():
            return candidate / "hardware.yaml"
    raise FileNotFoundError(f"builtin hardware catalog not found under {here.parent / 'configs'}"
                            f" or {here / 'configs'}; reinstall lamina")


def _entry_label(raw: Any, index: int) -> str:
    name = raw.get("name") if isinstance(raw, Mapping) else None
    return f"entry #{index}" + (f" ({name!r})" if name else "")


def _check_value(key: str, value: Any, where: str) -> Any:
    if key == "name":
        if not isinstance(value, str) or not value.strip():
            raise CatalogError(f"{where}: 'name' must be a non-empty string, got {value!r}")
        return value.strip()
    if key == "kind":
        if value not in KINDS:
            raise CatalogError(f"{where}: 'kind' must be one of {KINDS}, got {value!r}")
        return value
    if key == "roles":
        if (not isinstance(value, list) or not value or len(set(value)) != len(value)
                or not set(value) <= set(ROLES)):
            raise CatalogError(f"{where}: 'roles' must be a non-empty list from {list(ROLES)}, got {value!r}")
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(f"{where}: {key!r} must be a number, got {value!r}")
    if not (value > 0 and value != float("inf")):
        raise CatalogError(f"{where}: {key!r} must be a finite number > 0, got {value!r}")
    return float(value)


def parse_catalog(data: Any, source: str, base: Catalog | None = None) -> Catalog:
    """Validate parsed YAML ``data`` (``{"devices": [...]}`` or a bare list) and merge it
    over ``base`` (not modified). Entries naming a device already in ``base``
    (case-insensitive) override the fields they give; other entries must be complete.
    Returns a new catalog keyed by device name. Raises CatalogError naming ``source``."""
    out: Catalog = dict(base or {})
    entries = data.get("devices") if isinstance(data, Mapping) else data
    if isinstance(data, Mapping) and set(data) - {"devices"}:
        raise CatalogError(f"{source}: unknown top-level keys {sorted(set(data) - {'devices'})}"
                           " (expected only 'devices')")
    if not isinstance(entries, list):
        raise CatalogError(f"{source}: expected a list of devices under 'devices:'")
    seen: set[str] = set()
    for i, raw in enumerate(entries):
        where = f"{source}: {_entry_label(raw, i)}"
        if not isinstance(raw, Mapping):
            raise CatalogError(f"{where}: expected a mapping, got {type(raw).__name__}")
        unknown = set(raw) - set(_FIELDS)
        if unknown:
            raise CatalogError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {list(_FIELDS)}")
        if "name" not in raw:
            raise CatalogError(f"{where}: missing 'name'")
        vals = {k: _check_value(k, v, where) for k, v in raw.items()}
        key = vals["name"].lower()
        if key in seen:
            raise CatalogError(f"{where}: duplicate device name {vals['name']!r} in this file")
        seen.add(key)
        old = next((n for n in out if n.lower() == key), None)
        if old is not None:
            vals["name"] = old  # keep the catalog's spelling
            out[old] = replace(out[old], **vals)
            continue
        missing = [f for f in _REQUIRED if f not in vals]
        if missing:
            raise CatalogError(f"{where}: new device is missing field(s) {missing}")
        out[vals["name"]] = Device(**vals)
    return out


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogError(f"{path}: cannot read hardware catalog ({e.strerror or e})") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: invalid YAML: {e}") from e


def load_catalog(paths: str | Path | Iterable[str | Path] | None = None, *,
                 use_env: bool = True, include_builtin: bool = True) -> Catalog:
    """Load the builtin catalog, then ``$LAMINA_HARDWARE`` files (if ``use_env``), then
    ``paths``, each merged over the previous ones by name. Returns ``{name: Device}``."""
    files: list[Path] = [builtin_catalog_path()] if include_builtin else []
    env = lamina_env.text(ENV_VAR) if use_env else ""
    files += [Path(p) for p in env.split(os.pathsep) if p.strip()]
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files += [Path(p) for p in (paths or [])]
    catalog: Catalog = {}
    for f in files:
        catalog = parse_catalog(_read_yaml(f), str(f), catalog)
    return catalog


def get_device(catalog: Mapping[str, Device], name: str) -> Device:
    """Case-insensitive lookup; KeyError listing the known names when absent."""
    for n, dev in catalog.items():
        if n.lower() == name.lower():
            return dev
    raise KeyError(f"unknown device {name!r}; known: {', '.join(sorted(catalog))}")
