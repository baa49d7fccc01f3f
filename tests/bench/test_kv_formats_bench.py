"""bench/kv_formats.py runs and writes its table: every format of a cell, from memory and with
its pool in cache, against bfloat16 in the same rounds. Slow: several pools of every format."""
import json
import sys
from pathlib import Path

import pytest

from lamina.kernels import cpp_ext

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import kv_formats  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpp_ext.load() is None, reason="the C++ extension does not build")]


def test_one_round_writes_a_row_per_format_with_its_in_cache_ceiling(tmp_path):
    import torch
    threads = torch.get_num_threads()
    try:
        kv_formats.main(["--reps", "1", "--batches", "2", "--contexts", "256", "--budget-mib", "1",
                         "--cache-tokens", "128", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "kv_formats_cpu.json").read_text())["rows"]
    assert [r["format"] for r in rows] == kv_formats.FORMATS
    assert all(r["tokens_per_s"] > 0 and r["cache_tokens_per_s"] > 0 and r["of_cache"] > 0
               for r in rows)
    assert next(r for r in rows if r["format"] == "bfloat16")["vs_bf16"] == 1.0
    assert all(r["cache_ctx"] == 64 for r in rows)  # 128 tokens over 2 requests
    assert "| in cache, M tokens/s | of cache |" in (tmp_path / "kv_formats_cpu.md").read_text()
