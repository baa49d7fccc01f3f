"""Pipeline configuration, the scheduler's micro-batch rules and the timeline file."""
import json

import pytest

from lamina.config import PipelineConfig, resolve_pipeline
from lamina.engine.request import Request
from lamina.config import SchedulerConfig
from lamina.engine.scheduler import Scheduler
from lamina.timeline import Timeline
from lamina.types import SamplingParams


def test_resolve_defaults():
    assert resolve_pipeline(None, None, 1) == PipelineConfig("none", 1, 1)
    assert resolve_pipeline(None, None, 2) == PipelineConfig("rotational", 3, 2)
    assert resolve_pipeline(None, 2, 1) == PipelineConfig("rotational", 2, 1)
    assert resolve_pipeline("fixed", None, 3) == PipelineConfig("fixed", 3, 3)


@pytest.mark.parametrize("args", [("none", 2, 1), ("none", None, 2), ("fixed", 1, 2),
                                  ("diagonal", 2, 1), ("rotational", 0, 1)])
def test_resolve_rejects(args):
    with pytest.raises(ValueError):
        resolve_pipeline(*args)


def _req(i, n):
    return Request(i, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_schedule_skips_busy_and_never_preempts_them():
    s = Scheduler([10], SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    a, b = _req(0, 5), _req(1, 4)
    s.add(a)
    s.add(b)
    segs, _ = s.schedule(busy=set(), max_seqs=1)
    assert [x.req for x in segs] == [a]  # capped at one request per micro-batch
    segs2, pre = s.schedule(busy={a.req_id})
    assert [x.req for x in segs2] == [b] and not pre
    s.commit(segs)
    s.commit(segs2)
    # a grows while b is in flight: no room for a's next token, and b may not be preempted
    a.output_ids += [7, 8]
    segs3, pre3 = s.schedule(busy={b.req_id})
    assert b not in pre3 and b in s.running
    assert not segs3 and pre3 == [a]  # a waits (its KV is freed) instead


def test_timeline_chrome_json(tmp_path):
    tl = Timeline()
    tl.add("compute", 0, "slice 0", 1_000, 5_000, micro_batch=0)
    tl.add("memory", 1, "attend 0", 6_000, 8_000)
    path = tl.save(tmp_path / "t.json")
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in xs] == [(0, 0, 0.0, 4.0),
                                                                    (1, 1, 5.0, 2.0)]
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "memory", "replica 0", "memory node 1"} <= names
    assert tl.busy_fraction("compute", 0) == pytest.approx(4 / 7)
    with pytest.raises(ValueError):
        tl.add("gpu", 0, "x", 0, 1)
