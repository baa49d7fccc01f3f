"""bench/linear_groups.py runs and writes its table: both kernel families, per weight and
grouped, for every row count asked."""
import json
import sys
from pathlib import Path

import pytest

from lamina.kernels import cpp_ext

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import linear_groups  # noqa: E402

pytestmark = pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")


def test_one_round_writes_a_row_per_kernel_family(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(linear_groups, "LAYERS", 2)
    threads = torch.get_num_threads()
    try:
        linear_groups.main(["--rows", "1", "3", "--rounds", "1", "--threads", "1",
                            "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "linear_groups_cpu.json").read_text())["rows"]
    assert [(r["rows"], r["kernels"]) for r in rows] == [
        (1, "float32"), (1, "gguf-q8"), (3, "float32"), (3, "gguf-q8")]
    assert all(r["per_weight_ms"] > 0 and r["grouped_ms"] > 0 for r in rows)
    assert "| 3 | gguf-q8 |" in (tmp_path / "linear_groups_cpu.md").read_text()
