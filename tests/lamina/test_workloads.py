"""Synthetic traces and grids: seeded, documented distributions, Poisson arrivals, bounds."""
import math
import statistics

import pytest

from lamina.benchmark.workloads import LONG_FRACTION, GridCell, grid, synthetic_trace

V = 1000


def test_same_seed_same_trace_and_different_seed_differs():
    a = synthetic_trace("mixed", 50, 2.0, V, seed=3)
    assert a == synthetic_trace("mixed", 50, 2.0, V, seed=3)
    assert a != synthetic_trace("mixed", 50, 2.0, V, seed=4)


def test_arrivals_are_poisson_with_the_given_rate():
    tr = synthetic_trace("short", 4000, 5.0, V, seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(tr, tr[1:])]
    assert all(g >= 0 for g in gaps) and tr[0].arrival_s == 0
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.1)  # exponential: sd == mean


def test_infinite_rate_puts_everything_at_zero():
    assert {r.arrival_s for r in synthetic_trace("short", 10, math.inf, V)} == {0.0}


def test_length_distributions_match_their_documentation():
    short = synthetic_trace("short", 3000, 1.0, V, seed=1)
    long = synthetic_trace("long", 1000, 1.0, V, seed=1)
    assert 140 < statistics.median(r.prompt_len for r in short) < 220
    assert 120 < statistics.median(r.output_len for r in short) < 180
    assert all(4 <= r.prompt_len <= 2048 and 4 <= r.output_len <= 1024 for r in short)
    assert 5200 < statistics.median(r.prompt_len for r in long) < 6800
    assert all(2048 <= r.prompt_len <= 16384 and 16 <= r.output_len <= 512 for r in long)
    mixed = synthetic_trace("mixed", 3000, 1.0, V, seed=2)
    frac = sum(r.kind == "long" for r in mixed) / len(mixed)
    assert frac == pytest.approx(LONG_FRACTION, abs=0.02)


def test_scale_and_max_context_bound_lengths_and_ids_are_in_vocab():
    tr = synthetic_trace("long", 200, 1.0, 96, seed=0, scale=0.01, max_context=64)
    assert all(r.prompt_len + r.output_len <= 64 and r.output_len >= 1 for r in tr)
    assert all(48 <= t < 96 for r in tr for t in r.prompt_ids)
    scaled = synthetic_trace("short", 100, 1.0, V, seed=0, scale=0.5)
    full = synthetic_trace("short", 100, 1.0, V, seed=0)
    assert sum(r.prompt_len for r in scaled) == pytest.approx(0.5 * sum(r.prompt_len for r in full), rel=0.02)


@pytest.mark.parametrize("kwargs", [dict(kind="chat"), dict(num_requests=0), dict(rate=0.0),
                                    dict(scale=-1.0), dict(max_context=1)])
def test_bad_trace_arguments_raise(kwargs):
    args = dict(kind="short", num_requests=4, rate=1.0, vocab_size=V) | kwargs
    with pytest.raises(ValueError):
        synthetic_trace(**args)


def test_grid_cells_are_deterministic_and_sized():
    cells = grid([1, 4], [8, 16], 5)
    assert [(c.batch, c.context) for c in cells] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    reqs = cells[1].requests(V, seed=7)
    assert len(reqs) == 4 and all(r.prompt_len == 8 and r.output_len == 5 for r in reqs)
    assert reqs == cells[1].requests(V, seed=7)
    assert GridCell(4, 8, 5).kv_tokens == 4 * 13
    with pytest.raises(ValueError):
        grid([0], [8], 4)
    with pytest.raises(ValueError):
        grid([1], [8], 1)
