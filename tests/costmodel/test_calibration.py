"""Cost-model calibration: the stage fits recover known parameters, and the planner's own
prediction (offloaded + evaluate) reproduces the stage times it was fitted to."""
import re

import pytest

from lamina.cli import main
from lamina.costmodel.calibration import (Calibration, StagePoint, device_kind, error_rows, fit,
                                          fit_line, predict, with_dtype)
from lamina.costmodel.model import PRESETS

MODEL = with_dtype(PRESETS["smollm2"], 4)
# a made-up machine: 100 GFLOP/s peak, 15 GB/s copy; stage lines chosen below
PEAK, COPY = 100e9, 15e9
D0, D1 = 0.040, 0.004  # dense: 40 ms + 4 ms per request
A0, ATT_BW = 0.003, 7.5e9  # attention: 3 ms + KV bytes at 7.5 GB/s
R0, NET_BW = 0.010, 0.5e9  # rest: 10 ms + transfer bytes at 0.5 GB/s


def synthetic(batch: int, kv_len: float) -> StagePoint:
    dense = D0 + D1 * batch
    attention = A0 + batch * kv_len * MODEL.kv_bytes_per_token / ATT_BW
    other = R0 + batch * MODEL.transfer_bytes_per_token / NET_BW
    return StagePoint(batch, kv_len, 10, dense + attention + other, dense, attention)


def calibrated() -> Calibration:
    pts = [synthetic(b, c) for b, c in ((1, 44), (4, 44), (16, 44), (32, 44), (2, 1036), (4, 2060))]
    return fit(MODEL, pts, kind="cpu-test-2c", machine="test", peak_flops=PEAK, copy_bw=COPY,
               memory_gb=24.0)


def test_fit_line_is_exact_on_a_line_and_keeps_the_intercept_non_negative():
    assert fit_line([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    a, b = fit_line([1, 2, 3], [1.0, 3.0, 5.0])  # y = -1 + 2x: refit through the origin
    assert a == 0 and b > 0
    assert fit_line([2, 2], [1.0, 3.0]) == pytest.approx((1.5, 0.0), rel=0.2)  # one x: flat
    with pytest.raises(ValueError):
        fit_line([1], [0.0])


def test_fit_recovers_the_stage_parameters():
    cal = calibrated()
    n2 = 2 * MODEL.active_params
    assert cal.mfu_max == pytest.approx(n2 / (PEAK * D1))
    assert cal.b_half == pytest.approx(D0 / D1)
    assert cal.bw_efficiency == pytest.approx(ATT_BW / COPY)
    assert cal.net_bw == pytest.approx(NET_BW)
    assert 2 * MODEL.layers * cal.latency == pytest.approx(A0 + R0)


@pytest.mark.parametrize("batch,kv_len", [(1, 140), (8, 524), (32, 140), (3, 2060)])
def test_the_planner_predicts_the_stage_sum(batch, kv_len):
    """The prediction goes through offloaded() and evaluate(): with the fitted parameters it
    must equal dense + attention + rest of the synthetic machine, also off the fitted points."""
    tbt, tok = predict(calibrated(), MODEL, batch, kv_len)
    assert tbt == pytest.approx(synthetic(batch, kv_len).tbt, rel=1e-3)
    assert tok == pytest.approx(batch / tbt)


def test_fit_refuses_a_grid_without_two_batch_sizes():
    with pytest.raises(ValueError, match="two batch sizes"):
        fit(MODEL, [synthetic(4, 44), synthetic(4, 1036)], kind="k", machine="m", peak_flops=PEAK,
            copy_bw=COPY, memory_gb=1.0)


def test_a_slice_rate_above_the_matmul_probe_raises_the_peak():
    cal = fit(MODEL, [synthetic(1, 44), synthetic(8, 44)], kind="k", machine="m", peak_flops=1e9,
              copy_bw=COPY, memory_gb=1.0)
    assert cal.mfu_max == 1.0 and cal.peak_flops == pytest.approx(2 * MODEL.active_params / D1)


def test_error_rows_are_signed_relative_errors():
    cal = calibrated()
    true = synthetic(8, 524)
    rows = error_rows(cal, MODEL, [{"batch": 8, "context": 512, "kv_len": 524,
                                    "tbt_s": true.tbt * 1.25, "tok_s": 8 / (true.tbt * 1.25)}])
    assert rows[0]["tbt_err"] == pytest.approx(1 / 1.25 - 1, rel=1e-3)
    assert rows[0]["tok_err"] == pytest.approx(0.25, rel=1e-3)


def test_save_and_load_round_trip(tmp_path):
    cal = calibrated()
    cal.validation = [{"batch": 1, "context": 128, "tbt_err": 0.1}]
    path = cal.save(tmp_path)
    assert path.name == "cpu-test-2c.yaml" and path.read_text().startswith("# Lamina")
    back = Calibration.load(path)
    assert back.to_dict() == cal.to_dict()
    assert back.device().can("compute") and back.device().mem_bw == pytest.approx(COPY)


def test_device_kind_is_a_file_name():
    k = device_kind("avx2")
    assert re.fullmatch(r"cpu-[a-z0-9-]+-avx2-\d+c", k), k


def test_plan_calibrate_rejects_bad_cells_before_loading_anything(capsys):
    assert main(["plan", "--calibrate", "--fit-cells", "4by32"]) == 2
    assert "BATCHxCONTEXT" in capsys.readouterr().err
