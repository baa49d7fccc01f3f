"""The start-up profile measures both curves of the performance model for a real split model."""
import os
import sys

import pytest

from lamina.models import load_model
from lamina.deployment.profiling import profile_perf
from lamina.splitter import split_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402


def test_profile_perf_measures_both_curves(tmp_path):
    split = split_model(load_model(str(tiny_folder("llama", tmp_path))).model)
    perf = profile_perf(split, batches=(1, 4), contexts=(16, 64), reps=1)
    assert perf.batch_points == [1, 4] and perf.context_points == [16, 64]
    assert all(t > 0 for t in perf.compute_points_s + perf.attn_points_s)
    # the model interpolates between and extrapolates beyond the measured points
    assert perf.compute_s(2) == pytest.approx((2 * perf.compute_points_s[0]
                                               + perf.compute_points_s[1]) / 3)
    assert perf.layer_s(4, [16, 16]) == pytest.approx(perf.compute_points_s[1]
                                                      + 2 * perf.attn_points_s[0])
