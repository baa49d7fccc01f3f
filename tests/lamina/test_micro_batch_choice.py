"""The engine's choice of micro-batches in flight, against a simulated clock."""
import pytest

from lamina.engine.micro_batch_choice import MicroBatchChoice


class _Clock:
    now = 0.0


def _serve(choice: MicroBatchChoice, step_s: dict[int, float], completions: int,
           batch: int = 8, prefill_at: frozenset = frozenset(), clock=_Clock()) -> list[int]:
    """Run ``completions`` micro-batch completions: with k in flight each completes every
    step_s[k] / k seconds with batch / k tokens. Returns the count in use before each."""
    used = []
    for i in range(completions):
        k = choice.current
        used.append(k)
        clock.now += step_s[k] / k
        choice.record(batch // k, i not in prefill_at, clock.now)
    return used


@pytest.mark.parametrize("step_s,best", [({2: 0.08, 1: 0.1}, 2), ({2: 0.15, 1: 0.1}, 1)])
def test_the_faster_count_wins_and_keeps_running(step_s, best):
    choice = MicroBatchChoice((2, 1), window=2, keep=4)
    used = []
    while len(choice.rates) < 2:
        used += _serve(choice, step_s, 1)
    assert used[0] == 2 and used[-1] == 1  # the configured count is timed first, then the other
    assert choice.rates[2] / choice.rates[1] == pytest.approx(step_s[1] / step_s[2], rel=1e-6)
    assert choice.current == best
    assert _serve(choice, step_s, 8) == [best] * 8


def test_both_are_timed_again_after_keep_windows():
    choice = MicroBatchChoice((2, 1), window=1, keep=2)
    used = _serve(choice, {2: 0.1, 1: 0.2}, 60)
    switches = sum(a != b for a, b in zip(used, used[1:]))
    assert switches >= 4  # 2 -> 1 -> 2, then again after keep windows


def test_prefill_runs_the_first_count_and_timing_resumes_after_two_decode_rounds():
    choice = MicroBatchChoice((2, 1), window=2, keep=4)
    used = []
    while 2 not in choice.rates:
        used += _serve(choice, {2: 0.1, 1: 0.1}, 1)
    assert choice.current == 1  # timing 1 now
    used = _serve(choice, {2: 0.1, 1: 0.1}, 3, prefill_at=frozenset({0, 1, 2}))
    assert choice.current == 2 and 1 not in choice.rates  # prefill: back to 2, nothing timed
    used = _serve(choice, {2: 0.1, 1: 0.1}, 4)  # two rounds of 2 decode-only completions
    assert used == [2] * 4 and choice.current == 1  # then the window of 1 starts again
    while 1 not in choice.rates:
        _serve(choice, {2: 0.1, 1: 0.1}, 1)
    assert choice.best == 2  # a tie goes to the first candidate


def test_keep_doubles_while_the_timing_confirms_the_choice():
    choice = MicroBatchChoice((2, 1), window=1, keep=2, max_keep=8)
    lefts = []
    for _ in range(200):
        queued = bool(choice._queue)
        _serve(choice, {2: 0.1, 1: 0.2}, 1)
        if queued and not choice._queue:
            lefts.append(choice._left)
    assert lefts[:4] == [4, 8, 16, 16]  # keep x window x 2 completions: 2, 4, 8, then capped


def test_rejects_counts_below_one():
    with pytest.raises(ValueError):
        MicroBatchChoice((2, 0))
