"""bench/token_breakdown.py: a token's wall time is split by the timeline's spans, clipped to the
decode window, and the parts add up to it; the table has a row per round and the median."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import token_breakdown  # noqa: E402

from lamina.timeline import Timeline  # noqa: E402


class FakeClock:
    """perf_counter_ns for the bench: moved by the fake engine, not by the wall clock."""

    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def perf_counter_ns(self) -> int:
        return self.ns


class FakeLLM:
    """Three tokens 10 ms apart; the timeline holds spans stamped as a real step's, some of
    them (the first token's, the prefill) before the decode window."""

    def __init__(self, clock: FakeClock) -> None:
        self.timeline = Timeline()
        self.clock = clock

    def generate_stream(self, prompts, params):
        base = self.clock.ns
        ms = 1_000_000
        for i in range(3):
            t = base + i * 10 * ms
            self.timeline.add("compute", 0, "slice 0", t - 9 * ms, t - 4 * ms)
            self.timeline.add("compute", 0, "send", t - 4 * ms, t - 3 * ms)
            self.timeline.add("memory", 0, "attend 0", t - 3 * ms, t - 2 * ms)
            self.timeline.add("compute", 0, "recv", t - 2 * ms, t - 1 * ms)
            self.clock.ns = t
            yield object()


def test_the_parts_of_a_token_add_up_to_its_wall_time(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(token_breakdown.time, "perf_counter_ns", clock.perf_counter_ns)
    ms = token_breakdown.decode_split(FakeLLM(clock), [1, 2, 3], 3)
    parts = sum(ms[p] for p in token_breakdown.PARTS)
    assert abs(parts - ms["wall"]) < 1e-9
    # the window is the second token to the last: one 10 ms token, spans clipped to it
    assert 9.5 < ms["wall"] < 11.0
    assert abs(ms["slices"] - 5.0) < 0.3
    assert abs(ms["attention"] - 1.0) < 0.3
    assert abs(ms["hand-off"] - 2.0) < 0.3
    assert ms["engine"] >= 0.0


def test_the_table_has_a_row_per_round_and_the_median():
    r = {"wall": 30.0, "slices": 26.0, "attention": 2.0, "hand-off": 0.2, "engine": 1.8,
         "linear": 21.0, "copy_GBps": 25.0, "read_GBps": 26.0, "copy_floor": 21.5,
         "read_floor": 20.7}
    meta = {"machine": "cpu", "device": "cpu:0-1", "threads": 2, "prompt": 200,
            "new_tokens": 64, "weights_MB": 538.0, "simd": "avx2"}
    md = token_breakdown.markdown(meta, [r, r], r, ["--rounds", "2"])
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["0", "1", "median"]
    assert "1.40x" in rows[1]  # 30.0 / 21.5
    assert "python bench/token_breakdown.py --rounds 2" in md
