"""benchmarks/tau_curve.py: the validation curve read from a train.log and the gain of its last quarter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tau_curve  # noqa: E402


def test_the_curve_is_read_from_train_log_and_the_last_quarter_interpolated(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("10:00:00 step 16/40  loss 9.1\n"
                   "10:04:00 step 10 validation at 4:00: val/loss 8.0  val/tau 1.20  val/tau_t1 1.1\n"
                   "10:08:00 step 20 validation at 8:00: val/loss 7.0  val/tau 1.40  val/tau_t1 1.3\n"
                   "10:12:00 step 30 validation at 12:00: val/loss 6.5  val/tau 1.50  val/tau_t1 1.4\n"
                   "10:16:00 step 40 validation at 16:00: val/loss 6.0  val/tau 1.52  val/tau_t1 1.5\n")
    points = tau_curve.read_curve(log)
    assert points == [(4.0, 10, 1.20), (8.0, 20, 1.40), (12.0, 30, 1.50), (16.0, 40, 1.52)]
    assert tau_curve.gain_last_quarter(points) == pytest.approx(0.02)  # 12 min is three quarters of 16
    # three quarters of 15 minutes fall between the validations at 8 and 12: τ̂ 1.40 + 0.10 · 3.25 / 4
    assert tau_curve.gain_last_quarter([*points[:3], (15.0, 40, 1.52)]) == pytest.approx(1.52 - 1.48125)
    assert tau_curve.gain_last_quarter([(20.0, 40, 1.5)]) == 0.0
    (tmp_path / "empty.log").write_text("no validation here\n")
    with pytest.raises(SystemExit, match="no validation lines"):
        tau_curve.read_curve(tmp_path / "empty.log")
