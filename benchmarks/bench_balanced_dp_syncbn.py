"""Per-step cost of balanced_dp's synchronized BatchNorm against its default per-chunk BatchNorm, on the digits job.

The model and data are the main job's (``examples/digits.py``: a conv-BN-ReLU CNN on scikit-learn's 8x8 digits, batch
64 split as ``gpu0_bsz=16`` over ``accelerator="cpu", devices=2``). Both configurations run in this process,
interleaved over several rounds; the per-step wall time (``on_train_batch_start`` to ``on_train_batch_end``: scatter,
replicate, forward, backward, optimizer step) is the median over all measured steps, the first steps of every fit
being warm-up. Printed ratios:

* ``synced / per_chunk``: ``BalancedDataParallelStrategy(gpu0_bsz=16, sync_batchnorm=True)`` against the same
  strategy without it, the cost of exact BatchNorm statistics;
* ``per_chunk_again / per_chunk``: an A/A control, the default against itself, which shows this run's noise floor.

Usage: ``python benchmarks/bench_balanced_dp_syncbn.py [--steps 60] [--rounds 4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench_ddp_overhead import StepTimer, timed_trainer
from digits import DigitsClassifier, DigitsDataModule

from lightning_balanced import BalancedDataParallelStrategy

WARMUP_STEPS = 5
CONFIGS = {"per_chunk": False, "synced": True, "per_chunk_again": False}


def _fit(sync_batchnorm: bool, steps: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = timed_trainer(
        timer,
        accelerator="cpu",
        devices=2,
        strategy=BalancedDataParallelStrategy(gpu0_bsz=16, sync_batchnorm=sync_batchnorm),
        max_steps=steps,
        limit_val_batches=0,
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=64))
    return timer.times[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per fit")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the configurations")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            times[name] += _fit(CONFIGS[name], args.steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:>16}: median step {median * 1e3:.2f} ms over {len(times[name])} steps")
    print(f"per_chunk_again / per_chunk = {medians['per_chunk_again'] / medians['per_chunk']:.3f}")
    print(f"ratio (synced / per_chunk) = {medians['synced'] / medians['per_chunk']:.3f}")


if __name__ == "__main__":
    main()
