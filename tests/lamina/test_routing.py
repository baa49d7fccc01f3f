"""work_runs (a route's works in balanced runs), row runs, mini-batch ATTEND messages (communication-attention overlap) and
the merge of node results."""
import pytest
import torch

from lamina.kernels import merge_states
from lamina.computenode.attend import attend_messages, join_results, merge_results, work_runs
from lamina.types import AttendResult, NodeRoute, ShardWork


def _route(num_q: list[int]) -> NodeRoute:
    works = [ShardWork(i, 0, n, 0, n) for i, n in enumerate(num_q)]
    rows = torch.arange(sum(num_q))
    return NodeRoute(0, works, rows, rows)


@pytest.mark.parametrize("num_q, parts, want", [
    ([1] * 8, 1, [(0, 8)]),
    ([1] * 8, 2, [(0, 4), (4, 8)]),
    ([1] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ([1, 1, 1, 20], 2, [(0, 3), (3, 4)]),  # works are never cut; nearest boundary wins
    ([5, 1, 1, 1], 3, [(0, 1), (1, 4)]),
    ([3], 4, [(0, 1)]),
    ([1, 1], 5, [(0, 1), (1, 2)]),  # never more runs than works
])
def test_split_covers_every_work_once(num_q, parts, want):
    runs = work_runs(_route(num_q), parts)
    assert runs == want
    assert runs[0][0] == 0 and runs[-1][1] == len(num_q)
    assert all(a < b for a, b in runs) and all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))


def test_mini_batch_messages_carry_their_rows_and_join_back():
    num_q = [2, 1, 3, 1]
    route = _route(num_q)  # all T rows: sent as they are
    T = sum(num_q)
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    [whole] = attend_messages(5, 3, [route], q, k, v, reply_to=1)
    assert len(whole) == 1 and whole[0].works is None and whole[0].q is q
    [parts] = attend_messages(5, 3, [route], q, k, v, reply_to=1, parts=2)
    assert [m.works for m in parts] == [(0, 2), (2, 4)]
    assert all(m.reply_to == 1 and (m.step_id, m.layer) == (5, 3) for m in parts)
    assert torch.equal(torch.cat([m.q for m in parts]), q)
    assert torch.equal(torch.cat([m.k for m in parts]), k)
    results = [AttendResult(5, 3, m.q * 2, m.q[..., 0], span_ns=(10 * i, 10 * i + 5))
               for i, m in enumerate(parts)]
    joined = join_results(results)
    assert torch.equal(joined.o, q * 2) and torch.equal(joined.lse, q[..., 0])
    assert joined.span_ns == (0, 15)


def _rows(*rs: range) -> torch.Tensor:
    return torch.tensor([i for r in rs for i in r], dtype=torch.long)


def test_span_only_for_one_run_of_equal_q_and_kv_rows():
    w = [ShardWork(0, 0, 3, 0, 3)]
    assert NodeRoute(0, w, _rows(range(4, 7)), _rows(range(4, 7))).span == (4, 7)
    gap = _rows(range(0, 2), range(3, 4))
    assert NodeRoute(0, w, gap, gap).span is None
    assert NodeRoute(0, w, _rows(range(4, 7)), _rows(range(5, 7))).span is None  # kv differs
    assert NodeRoute(0, [], _rows(), _rows()).span is None


def test_span_routes_send_views_and_gather_routes_copies():
    T = 6
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    works = [ShardWork(0, 0, 3, 0, 3)]
    run = NodeRoute(1, works, _rows(range(3, 6)), _rows(range(3, 6)))
    gather = NodeRoute(0, works, _rows([0, 2, 4]), _rows([0, 2, 4]))
    [[m_run], [m_gather]] = attend_messages(1, 0, [run, gather], q, k, v)
    assert m_run.q.data_ptr() == q[3].data_ptr() and torch.equal(m_run.k, k[3:6])
    assert torch.equal(m_gather.q, q[[0, 2, 4]]) and torch.equal(m_gather.v, v[[0, 2, 4]])


def _result(o: torch.Tensor, lse: torch.Tensor) -> AttendResult:
    return AttendResult(0, 0, o, lse)


def test_merge_of_tiling_runs_is_their_concatenation():
    o = torch.randn(5, 2, 4)
    lse = torch.randn(5, 2)
    routes = [NodeRoute(0, [], _rows(range(0, 2)), _rows(range(0, 2))),
              NodeRoute(1, [], _rows(range(2, 5)), _rows(range(2, 5)))]
    merged = merge_results(routes, [_result(o[:2], lse[:2]), _result(o[2:], lse[2:])], 5)
    assert torch.equal(merged, o)


def test_merge_of_overlapping_rows_is_the_lse_merge():
    """A request whose KV spans both nodes: its row goes to both and is merged by LSE."""
    o0, o1 = torch.randn(3, 2, 4), torch.randn(2, 2, 4)
    l0, l1 = torch.randn(3, 2), torch.randn(2, 2)
    routes = [NodeRoute(0, [], _rows(range(0, 3)), _rows(range(0, 3))),
              NodeRoute(1, [], _rows(range(2, 4)), _rows(range(3, 4)))]
    merged = merge_results(routes, [_result(o0, l0), _result(o1, l1)], 4)
    both, _ = merge_states([o0[2:3], o1[:1]], [l0[2:3], l1[:1]])
    assert torch.equal(merged[:2], o0[:2]) and torch.equal(merged[3], o1[1])
    assert torch.allclose(merged[2], both[0])
