"""bench/e2e.py's step loop: an optional setup (CUDA graphs, device polling) that fails is
dropped and named, the others go on; a failing baseline still ends the run."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import e2e  # noqa: E402


class Stepper:
    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.steps = fail_at, 0

    def step(self) -> None:
        if self.steps == self.fail_at:
            raise RuntimeError("a wait gave up")
        self.steps += 1


def test_a_failing_optional_setup_is_dropped_and_named():
    failed: dict[str, str] = {}
    times = e2e.interleaved_steps({"hf": Stepper(), "lamina-polling": Stepper(fail_at=2),
                                   "lamina-procs": Stepper()}, rounds=4, warmup=1, failed=failed)
    assert sorted(times) == ["hf", "lamina-procs"] and all(len(t) == 4 for t in times.values())
    assert failed == {"lamina-polling": "RuntimeError: a wait gave up"}


def test_a_failing_baseline_ends_the_run():
    with pytest.raises(RuntimeError, match="gave up"):
        e2e.interleaved_steps({"hf": Stepper(), "lamina-procs": Stepper(fail_at=0)}, rounds=2,
                              warmup=0, failed={})
