"""NodeRoute.split and mini-batch ATTEND messages (communication-attention overlap)."""
import pytest
import torch

from lamina.routing import NodeRoute, attend_messages, join_results
from lamina.types import AttendResult, ShardWork


def _route(num_q: list[int], identity: bool = False) -> NodeRoute:
    works = [ShardWork(i, 0, n, 0, n) for i, n in enumerate(num_q)]
    rows = torch.arange(sum(num_q))
    return NodeRoute(0, works, rows, rows, identity)


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
    runs = _route(num_q).split(parts)
    assert runs == want
    assert runs[0][0] == 0 and runs[-1][1] == len(num_q)
    assert all(a < b for a, b in runs) and all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))


def test_mini_batch_messages_carry_their_rows_and_join_back():
    num_q = [2, 1, 3, 1]
    route = _route(num_q, identity=True)
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
