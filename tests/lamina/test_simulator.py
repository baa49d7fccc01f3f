"""The pipelining simulator: exact answers for simple cases, schedule invariants, Fig. 12 shape."""
import pytest

from lamina.costmodel.simulator import SimConfig, StageTimes, replica_for, simulate


def _cfg(schedule, n, N, times, M=1, L=4, iters=30):
    return SimConfig(schedule, n, N, M, L, times, iters)


def test_replica_for():
    assert [replica_for("rotational", 1, k, 3) for k in range(4)] == [1, 2, 0, 1]
    assert [replica_for("fixed", 4, k, 3) for k in range(3)] == [1, 1, 1]
    assert replica_for("none", 3, 5, 1) == 0
    with pytest.raises(ValueError):
        replica_for("zigzag", 0, 0, 1)


def test_none_is_serial_sum():
    t = StageTimes(slice_s=1.0, attn_s=2.0, send_s=0.5, recv_s=0.25, head_s=0.5, tokens=8)
    r = simulate(_cfg("none", 1, 1, t, M=2, L=4, iters=3))
    per_iter = 5 * 1.0 + 0.5 + 4 * (0.5 + 2.0 / 2 + 0.25)
    assert r.makespan_s == pytest.approx(3 * per_iter)
    assert r.token_latency_s == pytest.approx(per_iter)
    assert r.throughput == pytest.approx(8 * 3 / (3 * per_iter))
    assert r.replica_util[0] == pytest.approx(5.5 / per_iter)


def test_attn_parts_overlap_transfer_with_attention():
    """P mini-batches: the node starts after the first part arrives; per layer the critical
    path is send + attn / P + recv / P once sending is the bottleneck (send >= attn)."""
    t = StageTimes(slice_s=1.0, attn_s=1.0, send_s=1.0, recv_s=1.0, tokens=2)
    for P in (1, 2, 4):
        cfg = SimConfig("none", 1, 1, 1, 3, t, iterations=2, attn_parts=P)
        r = simulate(cfg, keep_spans=True)
        assert r.token_latency_s == pytest.approx(4 * 1.0 + 3 * (1.0 + 1.0 / P + 1.0 / P))
        assert len([s for s in r.spans if s[0] == "memory 0"]) == 2 * 3 * P
    with pytest.raises(ValueError):
        SimConfig("none", 1, 1, 1, 3, t, attn_parts=0)


def test_two_micro_batches_hide_balanced_attention():
    t = StageTimes(slice_s=1.0, attn_s=1.0, tokens=4)
    base = simulate(_cfg("none", 1, 1, t))
    rot = simulate(_cfg("rotational", 2, 1, t))
    assert rot.throughput / base.throughput == pytest.approx(2.0, rel=0.1)
    assert rot.compute_util > 0.9 and rot.memory_util > 0.75
    assert rot.token_latency_s == pytest.approx(base.token_latency_s, rel=0.15)


def test_resources_never_double_booked():
    t = StageTimes(slice_s=0.7, attn_s=1.3, send_s=0.1, recv_s=0.1, context_s=0.2)
    r = simulate(_cfg("rotational", 4, 3, t, M=2), keep_spans=True)
    by_res = {}
    for res, _, a, b in r.spans:
        by_res.setdefault(res, []).append((a, b))
    for spans in by_res.values():
        spans.sort()
        assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    assert all(0 < u <= 1 for u in r.replica_util + r.node_util)


def test_fig12_shape():
    """Rotational gains most when attention time is comparable to slice time (large batch)
    and costs latency at small batch, where attention is short and micro-batches queue."""
    big = StageTimes(slice_s=1.0, attn_s=1.0, tokens=256)
    small = StageTimes(slice_s=1.0, attn_s=0.1, tokens=8)
    gain_big = (simulate(_cfg("rotational", 3, 2, big)).throughput
                / simulate(_cfg("none", 1, 1, big)).throughput)
    gain_small = (simulate(_cfg("rotational", 3, 2, small)).throughput
                  / simulate(_cfg("none", 1, 1, small)).throughput)
    assert gain_big > gain_small
    lat_small = (simulate(_cfg("rotational", 2, 1, small)).token_latency_s
                 / simulate(_cfg("none", 1, 1, small)).token_latency_s)
    assert 1.6 < lat_small <= 2.0


def test_bad_config():
    t = StageTimes(1.0, 1.0)
    with pytest.raises(ValueError):
        SimConfig("none", 2, 1, 1, 4, t)
    with pytest.raises(ValueError):
        SimConfig("rotational", 0, 1, 1, 4, t)
    with pytest.raises(ValueError):
        StageTimes(1.0, 1.0, send_s=-0.1)
    with pytest.raises(ValueError):
        StageTimes(1.0, 1.0, tokens=0)
