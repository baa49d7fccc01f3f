"""Planner: budget respected, the better option picked in constructed cases, CLI behaviour."""
from __future__ import annotations

import json

import pytest

from lamina.costmodel.model import Assumptions, ModelSpec
from lamina.costmodel.hardware import Device, load_catalog
from lamina.costmodel.planner import PlanError, plan, plan_main

# same made-up model and devices as test_costmodel_formulas.py (hand numbers there)
ROUND = ModelSpec("round", layers=10, hidden=1000, heads=10, kv_heads=5, head_dim=100,
                  intermediate=2000, vocab=1000, dtype_bytes=2)
C = Device("C", "gpu", 10_000, 10, 1000, 100, 400, roles=("compute",))
CHEAP = Device("Cheap", "gpu", 1_000, 4, 500, 10, 40, roles=("memory",))
PRICEY = Device("Pricey", "gpu", 2_000, 4, 500, 10, 40, roles=("memory",))
A = Assumptions(mfu=0.5, max_batch=100, usable_memory=1.0, microbatches=2)


def test_picks_cheaper_memory_device_by_hand():
    """Budget $30,000, context 1000. By hand (see the formulas test): one C replica runs 100
    tokens in 3.64e-4 s and needs 11 memory devices (attention 4e-3 s on one device).
    C + 11 Cheap = $21,000 -> 100/3.64e-4 = 274,725 tok/s. Pricey: only 10 fit the budget
    -> attention 4e-4 s -> 250,000 tok/s. C x2 + 10 Cheap: 200 tokens, attention 8e-3/10 =
    8e-4 s -> 250,000. Homogeneous C x3: 3 * 100 / (3.64e-4 + 2e-3) = 126,904."""
    p = plan(ROUND, 30_000, 1000, {d.name: d for d in (C, CHEAP, PRICEY)}, assumptions=A)
    b = p.best
    assert (b.compute.name, b.n_compute, b.memory.name, b.n_memory) == ("C", 1, "Cheap", 11)
    assert b.throughput == pytest.approx(100 / 3.64e-4) and b.cost_usd == 21_000
    pricey = next(e for e in p.alternatives if e.memory is not None and e.memory.name == "Pricey")
    assert pricey.n_memory == 10 and pricey.throughput == pytest.approx(250_000)
    assert p.baseline.throughput == pytest.approx(3 * 100 / (3.64e-4 + 2e-3))
    assert "Cheap" in p.why and p.bottleneck == "compute"


def test_equal_throughput_tie_goes_to_the_cheaper_deployment():
    """C at $20,000, budget $42,000: one replica + 11 memory units saturates it either way
    (274,725 tok/s): Cheap costs $31,000, Pricey $42,000. Two replicas leave $2,000 for memory
    (at best 200 tokens / (8e-3/2 s) = 50,000 tok/s)."""
    c = Device("C", "gpu", 20_000, 10, 1000, 100, 400, roles=("compute",))
    p = plan(ROUND, 42_000, 1000, {d.name: d for d in (c, CHEAP, PRICEY)}, assumptions=A)
    b = p.best
    assert (b.memory.name, b.n_memory, b.cost_usd) == ("Cheap", 11, 31_000)
    pricey = next(e for e in p.alternatives if e.memory is not None and e.memory.name == "Pricey")
    assert pricey.throughput == pytest.approx(b.throughput) and pricey.cost_usd == 42_000
    assert pricey.per_dollar < b.per_dollar


def test_homogeneous_wins_when_memory_devices_are_poor():
    slow = Device("Slow", "cpu", 1_000, 4, 1, 1, 10)  # 1 GB/s: attention takes seconds
    p = plan(ROUND, 30_000, 1000, {d.name: d for d in (C, slow)}, assumptions=A)
    assert p.best.memory is None and p.best.n_compute == 3 and p.baseline is p.best


@pytest.mark.parametrize("budget", [40_000, 100_000, 250_000])
def test_budget_respected_with_builtin_catalog(budget):
    p = plan("llama-13b", budget, 4096, load_catalog(use_env=False))
    assert all(e.cost_usd <= budget for e in [p.best, *p.alternatives])
    assert all(p.best.throughput >= e.throughput for e in p.alternatives)
    assert p.best.compute.can("compute")


def test_nothing_fits_the_budget():
    with pytest.raises(PlanError, match="fits \\$1,000"):
        plan("llama-13b", 1_000, 4096, load_catalog(use_env=False))


def test_plan_main_prints_recommendation(capsys, monkeypatch):
    monkeypatch.delenv("LAMINA_HARDWARE", raising=False)
    assert plan_main(["--model", "llama-13b", "--budget", "100000"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: H100" in out and "Why:" in out and "tok/s/$" in out
    assert len([ln for ln in out.splitlines() if ln[:2].strip().isdigit()]) == 6  # best + 5


def test_plan_main_hardware_file_and_hf_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LAMINA_HARDWARE", raising=False)
    hw = tmp_path / "hw.yaml"
    hw.write_text("devices:\n  - {name: MagicMem, kind: gpu, price_usd: 100, memory_gb: 48,"
                  " mem_bw_gbps: 2000, bf16_tflops: 10, nic_gbps: 400, roles: [memory]}\n")
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                               "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                               "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    assert plan_main(["--model", str(cfg.parent), "--budget", "60000", "--hardware", str(hw)]) == 0
    out = capsys.readouterr().out
    assert "Model tiny:" in out and "+ MagicMem" in out.splitlines()[2]


def test_plan_main_errors(tmp_path, capsys):
    assert plan_main(["--model", "gpt-9", "--budget", "1e5"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  - {name: X, kind: gpu}\n")
    assert plan_main(["--model", "llama-13b", "--budget", "1e5", "--hardware", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'X'" in err
    assert plan_main(["--model", "llama-13b", "--budget", "1e5", "--compute", "H300"]) == 2
    assert "unknown device 'H300'" in capsys.readouterr().err
    assert plan_main(["--budget", "1e5"]) == 2  # argparse usage error, no SystemExit
