"""``lamina bench`` on a tiny random llama: measurements, baselines, report files, planner."""
import json
import math
import os
import sys

import pytest

from lamina import LLM
from lamina.benchmark.measure import percentile, run_grid_cell, run_trace
from lamina.cli import main
from lamina.benchmark.workloads import GridCell, synthetic_trace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("llama", tmp_path_factory.mktemp("llama"))


def test_percentile():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_run_trace_serves_every_request_and_accounts_the_time(folder):
    trace = synthetic_trace("short", 6, 40.0, 96, seed=0, scale=0.05, max_context=64)
    with LLM(folder, memory=2, kv_cache_tokens=128) as llm:
        r = run_trace(llm, trace, "lamina", parallel_nodes=False, progress=False)
        assert not llm.deployment.instances[0].engine.requests  # the runner leaves nothing behind
    assert r.completed == 6 and not r.errors
    assert r.output_tokens == sum(t.output_len for t in trace)
    assert r.throughput == pytest.approx(r.output_tokens / r.wall_s)
    assert 0 < r.ttft_p50 <= r.ttft_p99 and 0 < r.tbt_p50 <= r.tbt_p99
    assert 1 <= r.max_batch <= 6
    b = r.breakdown
    assert min(b.compute_s, b.attention_s, b.network_s, b.idle_s) >= 0 and b.attention_s > 0
    assert b.compute_s + b.attention_s + b.network_s + b.idle_s == pytest.approx(r.wall_s, rel=0.05)


def test_run_trace_reports_requests_that_do_not_fit(folder):
    trace = synthetic_trace("short", 3, 100.0, 96, seed=0, scale=0.05, max_context=64)
    too_long = trace[0].__class__(trace[-1].arrival_s, (50,) * 40, 4, "long")
    with LLM(folder, memory=1, kv_cache_tokens=32) as llm:
        r = run_trace(llm, [*trace, too_long], "small", parallel_nodes=False, progress=False)
    assert r.completed == 3 and len(r.errors) == 1 and "does not fit" in r.errors[0]


def test_grid_cell_counts_decode_steps_and_skips_what_does_not_fit(folder):
    with LLM(folder, memory=1, kv_cache_tokens=64) as llm:
        cap = llm.deployment.instances[0].scheduler.total_capacity
        p = run_grid_cell(llm, GridCell(2, 8, 5), "lamina", cap)
        assert p.fits and p.throughput > 0 and p.token_latency_s > 0
        assert p.throughput == pytest.approx(2 / p.token_latency_s)
        q = run_grid_cell(llm, GridCell(4, 16, 5), "lamina", cap)  # 84 > 64 slots
        assert not q.fits and math.isnan(q.throughput)


def test_lamina_bench_cli_writes_report_with_baselines(folder, tmp_path, capsys):
    out = tmp_path / "rep"
    rc = main(["bench", "--model", folder, "--workload", "mixed", "--requests", "5", "--rate", "50",
               "--scale", "0.02", "--batches", "1", "2", "--contexts", "8", "--new-tokens", "3",
               "--placement", "inproc", "--kv-cache-gb", "2e-5", "--report", str(out),
               "--plan-model", "llama-13b", "--plan-context", "4096", "--cost-contexts", "1024", "8192",
               "--max-devices", "16", "--tbt-slo", "100ms"])
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "results.json", "throughput_vs_batch.png", "latency_breakdown.png",
            "throughput_per_dollar.png"} <= names
    res = json.loads((out / "results.json").read_text())
    assert [t["system"] for t in res["trace"]] == ["hf", "lamina", "homogeneous"]
    assert all(t["completed"] == 5 for t in res["trace"])
    assert {(g["system"], g["batch"]) for g in res["grid"]} == {
        (s, b) for s in ("lamina", "homogeneous", "hf") for b in (1, 2)}
    assert res["capacity"]["lamina"] == 2 * res["capacity"]["homogeneous"]  # 2 nodes vs 1
    ctx = res["cost"]
    assert {(c["context"], c["offloaded"]) for c in ctx} == {(1024, True), (1024, False), (8192, True),
                                                             (8192, False)}
    plans = res["plans"]  # the constrained planner's top plans, as `lamina plan --json`
    assert plans and any(p["homogeneous"] for p in plans) and any(not p["homogeneous"] for p in plans)
    for p in plans:
        assert sum(p["devices"].values()) <= 16 and p["tbt_ms"] <= 100 and p["bottleneck"]
    md = (out / "report.md").read_text()
    assert "| lamina | 5/5 |" in md and "Largest batch that fits" in md
    assert "## Top plans" in md and "at most 16 devices" in md and "Throughput per $ vs context" in md
    assert "wrote" in capsys.readouterr().out


def test_lamina_bench_cli_errors(folder, tmp_path, capsys):
    assert main(["bench", "--model", folder, "--compute", "2", "--pipeline", "none",
                 "--report", str(tmp_path)]) == 2
    assert "pipeline 'none'" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path / "missing"), "--report", str(tmp_path)]) == 2
    assert "missing" in capsys.readouterr().err


def test_bench_report_says_which_constraint_binds_when_no_plan_fits(folder, tmp_path):
    out = tmp_path / "rep"
    assert main(["bench", "--model", folder, "--workload", "grid", "--batches", "1", "--contexts", "8",
                 "--new-tokens", "2", "--placement", "inproc", "--kv-cache-gb", "2e-5",
                 "--baselines", "--report", str(out), "--plan-model", "llama-65b",
                 "--cost-contexts", "1024", "--max-devices", "1"]) == 0
    md = (out / "report.md").read_text()
    assert "no plan meets all constraints; binding: --max-devices" in md


def test_lamina_bench_plan(capsys):
    assert main(["bench", "--plan", "--model", "llama-13b", "--budget", "100000"]) == 0
    out = capsys.readouterr().out
    assert "Recommended:" in out and "Why:" in out
    assert main(["bench", "--plan", "--model", "llama-13b", "--budget", "10"]) == 2


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """A tiny llama whose context holds the default grid's longest cell (512 + decode)."""
    import transformers
    from tiny_models import COMMON

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 2048},
                                   num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp("llama2k")
    model.save_pretrained(folder)
    return str(folder)


def test_lamina_bench_default_grid_measures_every_cell(long_folder, tmp_path):
    """The default grid (batches 1 8 32 x contexts 128 512, 16 new tokens, 512 tokens a step):
    32 prompts of 512 tokens take 32 prefill steps, longer than one request's 16 tokens, and
    every cell still gets a number on every system."""
    out = tmp_path / "rep"
    assert main(["bench", "--model", long_folder, "--placement", "inproc", "--requests", "3",
                 "--scale", "0.05", "--report", str(out)]) == 0
    assert {"report.md", "results.json", "throughput_vs_batch.png",
            "latency_breakdown.png"} <= {p.name for p in out.iterdir()}
    res = json.loads((out / "results.json").read_text())
    cells = {(g["system"], g["batch"], g["context"]): g for g in res["grid"]}
    assert set(cells) == {(s, b, c) for s in ("lamina", "homogeneous", "hf")
                          for b in (1, 8, 32) for c in (128, 512)}
    for g in cells.values():
        assert g["fits"] and not g["note"] and g["throughput"] > 0 and g["token_latency_s"] > 0
    assert not res["failures"] and "n/m [1]" not in (out / "report.md").read_text()


def test_a_cell_that_cannot_be_measured_keeps_its_reason_and_the_rest(folder, tmp_path):
    """On a 128-token model a 120-token prompt has room for 7 tokens: its cell is reported
    with the reason, and every other cell and the report are still written."""
    out = tmp_path / "rep"
    assert main(["bench", "--model", folder, "--workload", "grid", "--batches", "1", "2",
                 "--contexts", "8", "120", "--new-tokens", "9", "--placement", "inproc",
                 "--baselines", "--report", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    by_ctx = {(g["batch"], g["context"]): g for g in res["grid"]}
    assert all(by_ctx[(b, 8)]["throughput"] > 0 for b in (1, 2))
    for b in (1, 2):
        assert "ended (length)" in by_ctx[(b, 120)]["note"]
    md = (out / "report.md").read_text()
    assert "n/m [1]" in md and "1. lamina, batch 1, context 120: request" in md
