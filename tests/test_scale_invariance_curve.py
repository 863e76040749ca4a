"""ScaleInvariance on 1, 2 and 4 real gloo processes: the curves of benchmarks/bench_scale_invariance.py, measured.

The digits job (Adam, BatchNorm, float64), the config the same apart from ``devices``; what the runs measured is in
docs/lr_scaling.md, "Scale invariance".

* Per-device batch 2 (effective 2, 4 and 8, well below the gradient noise scale of 130 to 190: the regime the SDE rule
  assumes): ``adam_sde`` + ``ema`` keeps the 2- and 4-process curves inside the 1-process curve's 2-sigma band over 5
  seeds at every checkpoint, the issue's criterion.
* Per-device batch 32 (effective 64 and 128, near the noise scale of 76 to 107): no policy keeps the 4-process curve
  inside the band; ``adam_sde`` + ``ema`` keeps it much closer than plain ``sqrt``, at every checkpoint. At ``kappa``
  = 1 the policies change nothing, and the gradient noise scale ScaleInvariance measures under DDP on 4 processes
  (from each rank's and the all-reduced gradient) agrees with the one measured over the whole training set on 1
  process (76 to 107 there, 92 under DDP).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, *options: str) -> dict[str, Any]:
    out = tmp_path / "curves.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_scale_invariance.py"), *options, "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _mean(curves: list[list[float]], index: int) -> float:
    return statistics.fmean(curve[index] for curve in curves)


@pytest.mark.slow
def test_where_the_batch_is_well_below_the_noise_scale_adam_sde_with_ema_keeps_the_curve_in_the_band(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    measured = _bench(tmp_path, "--seeds", "5", "--per-device-batch", "2", "--policies", "adam_sde+ema")
    one = measured["curves"]["1"]["adam_sde+ema"]
    # The regime: the largest effective batch (8) at most a tenth of the noise scale at every checkpoint.
    noise = [statistics.fmean(run[i] for run in measured["noise_scale"]) for i in range(8)]
    assert min(noise) > 10 * 8, noise
    for world_size in ("2", "4"):
        curves = measured["curves"][world_size]["adam_sde+ema"]
        for index in range(8):
            spread = statistics.stdev(curve[index] for curve in one)
            distance = abs(_mean(curves, index) - _mean(one, index))
            assert distance <= 2 * spread, (world_size, index, distance / spread)


@pytest.mark.slow
def test_at_batch_32_adam_sde_with_ema_keeps_four_processes_closer_to_one_than_sqrt_does(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    measured = _bench(tmp_path, "--seeds", "2", "--world-sizes", "1", "4")
    curves = measured["curves"]
    one, four = curves["1"], curves["4"]
    assert one["adam_sde+ema"] == one["sqrt"]  # kappa = 1: both policies leave every value as it is
    for index in range(8):
        anchor = sum(seed[index] for seed in one["sqrt"]) / 2
        sde = sum(seed[index] for seed in four["adam_sde+ema"]) / 2
        sqrt = sum(seed[index] for seed in four["sqrt"]) / 2
        assert abs(sde - anchor) < abs(sqrt - anchor), (index, anchor, sde, sqrt)
    # Two estimators of B_simple, independent but for the job: within a factor of 2 of each other (each is noisy: the
    # DDP one averages about 100 steps of 4 ranks' batches of 32, the other one pass over the training set).
    whole_set = sum(run[-1] for run in measured["noise_scale"]) / len(measured["noise_scale"])
    ddp = measured["noise_scale_ddp"]["4"]
    assert all(0.5 * whole_set < value < 2 * whole_set for value in ddp), (whole_set, ddp)
