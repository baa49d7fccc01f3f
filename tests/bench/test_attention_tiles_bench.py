"""bench/attention_tiles.py runs and writes its table: every shape, both paths, outputs that
agree. Slow: it builds the per-query variant of the extension (~3 min the first time)."""
import json
import sys
from pathlib import Path

import pytest

from lamina.kernels import cpp_ext

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import attention_tiles  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")]


def test_one_round_writes_a_row_per_shape(tmp_path):
    import torch
    threads = torch.get_num_threads()
    try:
        attention_tiles.main(["--reps", "1", "--threads", "1", "--budget-mib", "4",
                              "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "attention_tiles_cpu.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == list(attention_tiles.SHAPES)
    assert all(r["ms_tile"] > 0 and r["ms_per_query"] > 0 and r["gflops_gemm"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)  # the two paths compute the same thing
    assert "| cascade group" in (tmp_path / "attention_tiles_cpu.md").read_text()
