"""``lamina plan``: every shown plan obeys every limit, limits change the plans, and an
impossible target names the binding constraint. Model: LLaMA-13B as a config-only folder."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lamina.costmodel.constraints import Constraints, parse_bandwidth, parse_duration, parse_usd
from lamina.costmodel.hardware import ENV_VAR, load_catalog
from lamina.costmodel.model import PRESETS
from lamina.costmodel.plan_cli import main, resolve_model
from lamina.costmodel.search import AMORTISATION_YEARS, search

LLAMA13B = {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
            "intermediate_size": 13824, "vocab_size": 32000}
KEYS = {"devices", "throughput_tok_s", "usd", "usd_per_mtok", "tbt_ms", "ttft_ms", "bottleneck"}
NECKS = {"compute", "memory bandwidth", "KV capacity", "interconnect", "latency target"}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def llama13b(tmp_path):
    d = tmp_path / "llama-13b-config"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA13B))
    return str(d)


def plans(capsys, *argv: str) -> list[dict]:
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_units_parse():
    assert parse_duration("50ms") == pytest.approx(0.05) and parse_duration("2s") == 2.0
    assert parse_duration("5us") == pytest.approx(5e-6) and parse_duration(0.1) == 0.1
    assert parse_bandwidth("200Gbps") == 25e9 and parse_bandwidth("200Gb/s") == 25e9
    assert parse_bandwidth("25GB/s") == 25e9 and parse_bandwidth("1GiB/s") == 2 ** 30
    assert parse_usd("$250,000") == 250_000 and parse_usd("1.5M") == 1.5e6
    for bad, fn in (("fast", parse_duration), ("5 parsecs", parse_duration), ("200Gbpm", parse_bandwidth)):
        with pytest.raises(ValueError):
            fn(bad)
    with pytest.raises(ValueError, match="max-devices"):
        Constraints(max_devices=0)


def test_config_only_folder_resolves(llama13b):
    m = resolve_model(llama13b)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.intermediate) == (40, 5120, 40, 40, 13824)
    assert m.params == PRESETS["llama-13b"].params


def test_gguf_metadata_only(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 30), ("embedding_length", 576), ("attention.head_count", 9),
                 ("attention.head_count_kv", 3), ("feed_forward_length", 1536), ("vocab_size", 49152)):
        w.add_uint32(f"llama.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = resolve_model(str(path))
    s = PRESETS["smollm2"]
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab) == \
        (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab)


def test_done_when_all_plans_within_limits(llama13b, capsys):
    out = plans(capsys, "--model", llama13b, "--context", "4096", "--tbt-slo", "100ms",
                "--max-devices", "64", "--nic", "200Gbps")
    assert out and all(KEYS <= set(p) for p in out)
    for p in out:
        assert sum(p["devices"].values()) <= 64 and p["tbt_ms"] <= 100
        assert p["bottleneck"] in NECKS
        avail = p["interconnect_available_gb_s"]
        assert avail is None or p["interconnect_used_gb_s"] <= avail + 1e-6
        years = p["usd"] / (p["throughput_tok_s"] * AMORTISATION_YEARS * 365 * 86400 / 1e6)
        assert p["usd_per_mtok"] == pytest.approx(years, rel=1e-3, abs=1e-4)
    homo = [p for p in out if p["homogeneous"]]
    assert len(homo) >= 1 and homo[0]["vs_homogeneous"] == pytest.approx(1.0)
    best = out[0]
    assert not best["homogeneous"] and best["vs_homogeneous"] > 1.5  # offloading wins at 4k context
    assert best["usd_per_mtok"] == min(p["usd_per_mtok"] for p in out)


def test_tighter_limits_change_the_plans(llama13b, capsys):
    base = ["--model", llama13b, "--context", "4096", "--nic", "200Gbps"]
    loose = plans(capsys, *base, "--tbt-slo", "100ms", "--max-devices", "64")
    few = plans(capsys, *base, "--tbt-slo", "100ms", "--max-devices", "16")
    fast = plans(capsys, *base, "--tbt-slo", "15ms", "--max-devices", "64")
    assert all(sum(p["devices"].values()) <= 16 for p in few)
    assert all(p["tbt_ms"] <= 15 for p in fast)
    assert few[0]["devices"] != loose[0]["devices"] and fast[0]["devices"] != loose[0]["devices"]
    # limits cost money: each tightened best is no cheaper per token than the loose best
    assert few[0]["usd_per_mtok"] > loose[0]["usd_per_mtok"]
    assert fast[0]["usd_per_mtok"] > loose[0]["usd_per_mtok"]
    assert any(p["bottleneck"] == "latency target" for p in fast)


def test_nodes_nic_and_budget_enforced(llama13b, capsys):
    base = ["--model", llama13b, "--context", "4096"]
    one_node = plans(capsys, *base, "--nodes", "1", "--devices-per-node", "8")
    assert all(p["nodes"] == 1 and sum(p["devices"].values()) <= 8 for p in one_node)
    assert all(p["interconnect_used_gb_s"] == 0 for p in one_node)  # nothing leaves the node
    cheap = plans(capsys, *base, "--budget-usd", "60k")
    assert all(p["usd"] <= 60_000 for p in cheap)
    slow = plans(capsys, *base, "--nic", "10Gbps", "--nic-latency", "5us", "--max-devices", "64")
    fast = plans(capsys, *base, "--nic", "400Gbps", "--nic-latency", "5us", "--max-devices", "64")
    for p in slow:
        if p["interconnect_available_gb_s"] is not None:  # uses the network: 10 Gbit/s each
            assert p["interconnect_available_gb_s"] % 1.25 == pytest.approx(0, abs=1e-6)
    assert slow[0]["usd_per_mtok"] >= fast[0]["usd_per_mtok"]
    shared = plans(capsys, *base, "--nic", "100Gbps", "--nic-shared", "--max-devices", "64")
    assert all(p["interconnect_available_gb_s"] is None or p["interconnect_available_gb_s"] <= 12.5 * p["nodes"]
               for p in shared)


def test_fixed_batch(llama13b, capsys):
    out = plans(capsys, "--model", llama13b, "--context", "4096", "--batch", "64", "--max-devices", "32")
    assert out and all(p["batch"] == 64 for p in out)


@pytest.mark.parametrize("args, flag, words", [
    (["--tbt-slo", "0.2ms"], "--tbt-slo", "fastest TBT reachable"),
    (["--budget-usd", "10000"], "--budget-usd", "cheapest plan costs"),
    (["--ttft-slo", "1ms"], "--ttft-slo", "fastest TTFT"),
    (["--max-devices", "8", "--batch", "4096"], "--max-devices", "needs"),
])
def test_impossible_target_names_binding_constraint(llama13b, capsys, args, flag, words):
    assert main(["--model", llama13b, "--context", "4096", *args]) == 1
    err = capsys.readouterr().err
    assert "no plan meets all constraints; binding:" in err and flag in err and words in err


def test_bad_arguments_exit_2(llama13b, capsys, tmp_path):
    assert main(["--model", str(tmp_path / "nope"), "--context", "4096"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["--model", llama13b, "--context", "4096", "--tbt-slo", "fast"]) == 2


def test_lamina_plan_subcommand(llama13b):
    r = subprocess.run([sys.executable, "-m", "lamina.cli", "plan", "--model", llama13b, "--context", "4096",
                        "--tbt-slo", "100ms", "--max-devices", "64", "--top", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "bottleneck" in lines[2] and "$/Mtok" in lines[2] and "*" in r.stdout


def test_search_api_homogeneous_baseline_present():
    cat = load_catalog(use_env=False)
    out = search(PRESETS["llama-13b"], [cat["H100"]], [cat["RTX-3090"]], 2048, Constraints(max_devices=32))
    assert out.baseline is not None and out.baseline.homogeneous
    assert {p.est.memory is None for p in out.plans} == {True, False}
