"""bench/offload.py's no-wait ceiling: homogeneous ms per step over what lamina's compute role
is busy per step (dense + transfer; the busiest compute role); waits and memory roles do not
count."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import offload  # noqa: E402


def test_ceiling_counts_compute_dense_and_transfer_only():
    # 10 steps; role times are seconds over the whole window
    lamina = {"roles": [{"role": "compute 0", "dense": 1.0, "transfer": 0.2, "idle": 0.5},
                        {"role": "memory 0", "attention": 0.7, "idle": 1.0}]}
    homogeneous = {"ms_per_step": 180.0}
    assert offload.no_wait_ceiling(lamina, homogeneous, steps=10) == pytest.approx(1.5)


def test_ceiling_takes_the_busiest_compute_role_and_is_none_without_busy_time():
    lamina = {"roles": [{"role": "compute 0", "dense": 0.5}, {"role": "compute 1", "dense": 0.8}]}
    assert offload.no_wait_ceiling(lamina, {"ms_per_step": 200.0}, steps=10) == pytest.approx(2.5)
    idle = {"roles": [{"role": "compute 0", "idle": 1.0}]}
    assert offload.no_wait_ceiling(idle, {"ms_per_step": 200.0}, steps=10) is None
