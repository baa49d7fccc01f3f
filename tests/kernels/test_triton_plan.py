"""The Triton launch plan's host-side choices (no kernel runs: plain CPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from lamina.kernels import triton_plan as ta  # noqa: E402
from lamina.kernels.triton_merge import merge_blocks  # noqa: E402

GPU = torch.device("cuda:7")  # a device object only; its SM count is seeded below


@pytest.fixture(autouse=True)
def _sms(monkeypatch):
    monkeypatch.setitem(ta._SMS, str(GPU), 132)


def test_kv_chunk_spreads_few_requests_over_the_device():
    # batch 1, 8 kv heads: 8 base programs; 4 x 132 wanted -> 66 splits of a 32k context
    chunk = ta._kv_chunk(None, 32768, 8, 64, GPU)
    assert chunk % 64 == 0 and 32768 / chunk >= 60
    assert ta._kv_chunk(None, 512, 8, 64, GPU) == ta.MIN_KV_CHUNK  # never finer than the floor


def test_kv_chunk_does_not_split_a_large_batch():
    assert ta._kv_chunk(None, 2048, 256 * 8, 64, GPU) >= 2048


def test_kv_chunk_given_or_on_cpu():
    assert ta._kv_chunk(40, 32768, 8, 64, GPU) == 40
    assert ta._kv_chunk(None, 32768, 8, 64, torch.device("cpu")) == ta.DEFAULT_KV_CHUNK


def test_plan_covers_rows_unless_a_request_has_no_keys():
    def plan(qo, kv, T):
        return ta._launch_plan(torch.tensor(qo), torch.tensor(kv), T, 2, 2, 16, 100000, 16,
                               torch.device("cpu"))
    assert plan([0, 1, 2], [0, 5, 9], 2).cover
    assert not plan([0, 1, 2], [0, 0, 9], 2).cover  # request 0 sees nothing: zero-filled
    assert not plan([0, 1, 2], [0, 5, 9], 3).cover  # a row past qo_indptr's end
    split = ta._launch_plan(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 90]), 2, 2, 2, 16, 16,
                            16, torch.device("cpu"))
    assert split.max_ch > 1 and split.cover and split.o_part is not None


def test_merge_blocks():
    assert merge_blocks(32, 66, 128) == (128, 1, 16)  # a decode step's few rows: one each
    assert merge_blocks(32, 3, 128) == (128, 1, 4)
    d, r, p = merge_blocks(300 * 32, 3, 128)
    assert r > 1 and r * p * d <= 8192
