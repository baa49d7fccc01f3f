"""bench/pipeline_sim.py: the CLI runs in both input modes and Fig. 12's qualitative result
holds on the cost model's H100 + Arc-A770 times."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "pipeline_sim.py"
sys.path.insert(0, str(SCRIPT.parent))
import pipeline_sim  # noqa: E402


def test_fig12_rotational_gains_at_large_batch_and_costs_latency_at_small():
    rows = {r["batch"]: r for r in pipeline_sim.fig12()}
    small, large = rows[8], rows[1024]
    assert large["t_a/t_m"] == pytest.approx(1.0, abs=0.1)  # the pool is balanced at B=1024
    assert large["N1_throughput_gain"] > 1.8  # attention hidden under the other micro-batch
    assert large["N2_throughput_gain"] > 1.1
    assert 1.6 < small["N1_latency_ratio"] < 2.0  # weight-bound slices: ~2x per-token latency
    assert small["N1_throughput_gain"] < 1.0
    gains = [rows[b]["N1_throughput_gain"] for b in sorted(rows)]
    assert gains[-1] > gains[0]


@pytest.mark.parametrize("args", [
    ["--slice-ms", "2", "--attn-ms", "3", "--send-ms", "0.2", "--recv-ms", "0.2", "--layers", "4",
     "--tokens", "8", "--memory-nodes", "2", "--attn-parts", "2"],
    ["--model", "llama-13b", "--memory-nodes", "8", "--batch", "64", "-N", "2"],
])
def test_cli_prints_each_schedule(args):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         check=True).stdout
    lines = out.strip().splitlines()
    schedules = [line.split()[0] for line in lines]
    assert schedules == (["none", "fixed", "rotational"] if "-N" not in args
                         else ["fixed", "rotational"])
    assert all("tok/s" in line and "memory util" in line for line in lines)


def test_cli_needs_stage_times():
    r = subprocess.run([sys.executable, str(SCRIPT), "--slice-ms", "1"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--attn-ms" in r.stderr
