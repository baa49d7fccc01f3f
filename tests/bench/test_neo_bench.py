"""bench/neo.py: its pure parts (prompts, agreement) and, slow, the whole bench on two CPU cores
(the mechanics: a pool too small preempts, the offload setup does not)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.device import available_cores

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import neo  # noqa: E402


def test_prompts_are_seeded_and_sized():
    a = neo.make_prompts(4, 16, 1000)
    assert a == neo.make_prompts(4, 16, 1000) and a != neo.make_prompts(4, 16, 1000, seed=1)
    assert len(a) == 4 and all(len(p) == 16 and all(100 <= t < 1000 for t in p) for p in a)


def test_agreement_counts_equal_tokens_at_equal_positions():
    assert neo.agreement([[1, 2, 3], [4]], [[1, 9, 3], [4]]) == 0.75
    assert neo.agreement([], []) == 0.0


@pytest.mark.slow
@pytest.mark.skipif(len(available_cores()) < 2, reason="the offload setup's node needs a core of its own")
def test_the_bench_runs_on_cpu_and_the_small_pool_preempts(tmp_path):
    cores = available_cores()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "neo.py"), "--model",
                        "lamina.models:smollm2_shaped", "--device", f"cpu:{cores[0]}",
                        "--memory-device", f"cpu:{cores[1]}", "--memory", "1", "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "neo_cpu.json").read_text())
    rows = {x["setup"]: x for x in d["rows"]}
    assert rows["alone"]["preemptions"][0] > 0 and rows["offload"]["preemptions"] == [0]
    assert d["meta"]["fits_alone"] == 0.25 and d["greedy_agreement"] == 1.0  # float32, same kernels
    assert "offload / alone" in (tmp_path / "neo_cpu.md").read_text()
