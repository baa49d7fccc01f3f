"""Hardware catalog: builtin values (Lamina Table 1), user overrides, and clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from lamina.costmodel.hardware import ENV_VAR, CatalogError, get_device, load_catalog, parse_catalog

TABLE1 = {  # Lamina Table 1: price $, memory GB, bandwidth GB/s
    "A100-80G": (17_500, 80, 1935), "H100": (36_500, 80, 3350), "RTX-3090": (1_600, 24, 936.2),
    "RX-7900-XTX": (1_000, 24, 960), "Arc-A770": (350, 16, 560),
}
NEW = "{name: Box, kind: cpu, price_usd: 5000, memory_gb: 256, mem_bw_gbps: 200, bf16_tflops: 2, nic_gbps: 100}"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def write(tmp_path: Path, text: str, name: str = "hw.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_builtin_has_table1_h200_and_cpu_hosts():
    cat = load_catalog()
    for name, (price, mem, bw) in TABLE1.items():
        d = cat[name]
        assert (d.price_usd, d.memory_gb, d.mem_bw_gbps) == (price, mem, bw)
    assert cat["H200"].memory_gb == 141
    cpus = [d for d in cat.values() if d.kind == "cpu"]
    assert len(cpus) >= 2 and any(d.memory_gb >= 512 and 600 <= d.mem_bw_gbps <= 700 for d in cpus)
    assert all(not d.can("compute") and d.can("memory") for d in cpus)
    assert cat["H100"].can("compute") and not cat["RTX-3090"].can("compute")
    assert cat["H100"].nic_bw == 400e9 / 8  # nic_gbps is Gbit/s


def test_user_file_overrides_by_name_and_extends(tmp_path):
    p = write(tmp_path, f"devices:\n  - {{name: h100, price_usd: 30000}}\n  - {NEW}\n")
    cat = load_catalog(p)
    h = get_device(cat, "H100")
    assert h.price_usd == 30_000 and h.mem_bw_gbps == 3350 and h.name == "H100"  # other fields kept
    assert cat["Box"].memory_gb == 256 and cat["Box"].can("memory")
    assert load_catalog()["H100"].price_usd == 36_500  # builtin untouched


def test_env_var_then_explicit_path(tmp_path, monkeypatch):
    env = write(tmp_path, "- {name: H100, price_usd: 1}\n- " + NEW + "\n", "env.yaml")
    monkeypatch.setenv(ENV_VAR, str(env))
    assert load_catalog()["H100"].price_usd == 1 and "Box" in load_catalog()
    explicit = write(tmp_path, "devices: [{name: H100, price_usd: 2}]", "explicit.yaml")
    assert load_catalog(explicit)["H100"].price_usd == 2  # explicit path wins over the env file
    assert load_catalog(use_env=False)["H100"].price_usd == 36_500


@pytest.mark.parametrize("text, message", [
    ("devices:\n  - {name: Foo, kind: gpu, price_usd: 1}\n", r"entry #0 \('Foo'\): new device is missing field\(s\) \['memory_gb'"),
    ("devices:\n  - {name: H100, pricee_usd: 1}\n", r"entry #0 \('H100'\): unknown field\(s\) \['pricee_usd'\]"),
    ("devices:\n  - {name: H100, kind: tpu}\n", r"'kind' must be one of"),
    ("devices:\n  - {name: H100}\n  - {name: H100, price_usd: -5}\n", r"entry #1 \('H100'\): 'price_usd' must be a finite number > 0"),
    ("devices:\n  - {name: H100, memory_gb: lots}\n", r"'memory_gb' must be a number"),
    ("devices:\n  - {name: H100, price_usd: 1}\n  - {name: h100, price_usd: 2}\n", r"entry #1 \('h100'\): duplicate device name 'h100'"),
    ("devices:\n  - {name: H100, roles: [storage]}\n", r"'roles' must be a non-empty list"),
    ("devices:\n  - {price_usd: 1}\n", r"entry #0: missing 'name'"),
    ("devices: {name: H100}\n", r"expected a list of devices"),
    ("gpus: []\n", r"unknown top-level keys \['gpus'\]"),
    ("devices: [unclosed\n", r"invalid YAML"),
])
def test_errors_name_file_and_entry(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(CatalogError, match=message) as info:
        load_catalog(p)
    assert str(p) in str(info.value)


def test_missing_file_and_unknown_device(tmp_path):
    with pytest.raises(CatalogError, match="cannot read hardware catalog"):
        load_catalog(tmp_path / "nope.yaml")
    with pytest.raises(KeyError, match="unknown device 'H300'; known: .*H100"):
        get_device(load_catalog(), "H300")
    assert parse_catalog([], "empty") == {}
