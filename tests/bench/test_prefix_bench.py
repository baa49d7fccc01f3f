"""bench/prefix.py's attention trace runs at a small shape and writes its table: the three KV
layouts timed on one node (the cascade planned for the cached one); a GPU node it cannot have
is refused by name."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import prefix  # noqa: E402

LAYOUTS = ("uncached", "shared, per request", "cached")


def test_attention_trace_writes_the_three_layouts(tmp_path):
    threads = torch.get_num_threads()
    try:  # 8 x 640 shared positions: 7 x 640 >= cascade.MIN_SAVED key reads saved, a cascade
        prefix.main(["--traces", "attention", "--requests", "8", "--prefix", "640",
                     "--suffix", "10", "--reps", "1", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    a = json.loads((tmp_path / "prefix_cpu.json").read_text())["attention"]
    assert all(a[name] > 0 and len(a["spread_ms"][name]) == 2 for name in LAYOUTS)
    md = (tmp_path / "prefix_cpu.md").read_text()
    assert "`python bench/prefix.py --traces attention --requests 8" in md
    assert all(f"| {name} |" in md for name in LAYOUTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_gpu_node_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        prefix.main(["--traces", "attention", "--attention-device", "cuda", "--out", str(tmp_path)])
