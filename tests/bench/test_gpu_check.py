"""scripts/gpu-check.sh and bench/gpu_report.py without a GPU: the script refuses clearly, and
the report reads what the script's steps write (synthetic files here; real ones on a GPU)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_report  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run the script itself")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin:" + str(Path(sys.executable).parent),
                                       "OUT": str(tmp_path)}, timeout=300)
    assert r.returncode == 2 and "no CUDA device" in r.stderr


def test_report_summarises_the_steps(tmp_path):
    (tmp_path / "environment.txt").write_text("device: H100 | torch 2.11")
    for step, rc in (("pytest_gpu", 0), ("kernels", 0), ("e2e_gpu_memory", 1)):
        (tmp_path / f"{step}.rc").write_text(f"{rc}\n")
        (tmp_path / f"{step}.log").write_text(f"line\n{step} summary\n")
    rows = [{"method": "triton", "batch": b, "ctx": str(c), "gbps": 2800.0, "frac_copy": 0.9,
             "mbu": m, "time_ms": 1.0} for b, c, m in ((1, 512, 0.3), (32, 2048, 0.86),
                                                       (64, 8192, 0.90), (256, 32768, 0.80))]
    rows.append({**rows[0], "method": "sdpa_padded"})
    rows += [{**rows[0], "method": "triton_graph", "ctx": "8192", "mbu": 0.62, "host_us": 21.0}]
    (tmp_path / "kernels_cuda.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    (tmp_path / "cpu_memory").mkdir()
    (tmp_path / "cpu_memory" / "e2e_cuda.json").write_text(json.dumps({"rows": [
        {"batch": 8, "system": "lamina-procs", "tok_per_s": 100.0, "ms_per_token": 80.0, "vs_hf": 0.9},
        {"batch": 8, "system": "lamina-graphs", "tok_per_s": 150.0, "ms_per_token": 53.0, "vs_hf": 1.3,
         "vs_lamina-inproc": 1.4},
        {"batch": 8, "system": "lamina-polling", "tok_per_s": 110.0, "ms_per_token": 72.0, "vs_hf": 1.0,
         "vs_lamina-procs": 1.1},
        {"batch": 8, "system": "lamina-procs-graphs", "tok_per_s": 140.0, "ms_per_token": 57.0,
         "vs_hf": 1.2, "vs_lamina-graphs": 0.93}]}))
    (tmp_path / "neo_cuda.json").write_text(json.dumps({
        "meta": {"fits_alone": 0.25}, "rows": [], "offload_vs_alone": 0.99, "ratios": [1.09, 0.89]}))
    (tmp_path / "prefix_cuda.json").write_text(json.dumps({"attention": {
        "uncached": 3.0, "shared, per request": 2.0, "cached": 0.5, "spread_ms": {}}}))
    assert gpu_report.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "gpu_check.json").read_text())
    assert s["prefix_attention"]["ratio"] == pytest.approx(6.0)
    assert s["steps"]["e2e_gpu_memory"]["rc"] == "1" and s["steps"]["e2e_cpu_memory"]["rc"] == "not run"
    tri, graph = s["kernels"]["triton"], s["kernels"]["triton_graph"]
    assert tri["mbu_median_large"] == pytest.approx(0.86)  # batch >= 32, ctx >= 2048 only
    assert tri["met"] is True and len(tri["cells"]) == 4
    assert graph["mbu_batch1_long"] == [0.62] and graph["mbu_median_large"] is None
    assert "e2e_gpu_memory" not in s and s["e2e_cpu_memory"][0]["vs_hf"] == 0.9
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Median MBU" in md and "86%" in md and "NEO" in md
    assert "read once per step 0.50: 6.00x less (target 5x)" in md
    assert "triton_graph" in md and "batch 1, ctx >= 8192: 62%" in md
    assert s["cuda_graph_gain_cpu_memory"] == {"8": 1.4}
    assert "cpu_memory: batch 8 1.40x" in md
    assert s["procs_vs_inproc_graphs_cpu_memory"] == {"8": 0.93}
    assert "Processes / in process, both with graphs (cpu_memory): batch 8 0.93x" in md
    assert s["neo"]["offload_vs_alone"] == 0.99
    assert "NEO's layout / the GPU alone, the GPU's pool holding 25 % of the KV: 0.99x (target 1.3x)" in md
    assert s["polling_gain_cpu_memory"] == {"8": 1.1} and "Device-side polling: cpu_memory: batch 8 1.10x" in md
    assert not math.isnan(tri["cells"][0]["mbu"])


def test_report_names_blocking_calls_and_dropped_setups(tmp_path):
    (tmp_path / "polling_probe_lazy.rc").write_text("0\n")
    (tmp_path / "polling_probe_lazy.log").write_text(
        "device: H100\nkernel launch (matmul) on stream B   2138.8 ms  BLOCKED by the wait\n"
        "torch.cuda.Stream()   0.0 ms  ok\n")
    (tmp_path / "gpu_memory").mkdir()
    (tmp_path / "gpu_memory" / "e2e_cuda.json").write_text(json.dumps({
        "meta": {"failed": {"lamina-polling": "RuntimeError: a wait gave up"}},
        "rows": [{"batch": 8, "system": "lamina-procs", "tok_per_s": 100.0, "ms_per_token": 80.0,
                  "vs_hf": 0.9}]}))
    (tmp_path / "neo_cuda.json").write_text(json.dumps({
        "meta": {"fits_alone": 0.25}, "rows": [], "offload_vs_alone": 0.99, "ratios": [1.09, 0.89]}))
    assert gpu_report.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "gpu_check.json").read_text())
    assert s["polling_probe_lazy"] == ["kernel launch (matmul) on stream B   2138.8 ms  BLOCKED by the wait",
                                       "torch.cuda.Stream()   0.0 ms  ok"]
    assert s["failed"] == ["gpu_memory lamina-polling: RuntimeError: a wait gave up"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "BLOCKED by the wait" in md and "Dropped from a decode run: gpu_memory lamina-polling" in md
