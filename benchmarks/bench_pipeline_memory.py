"""strategy="pipeline": each rank's peak host memory while building, training and saving, against its own stage's bytes,
for a model built on the meta device against one built whole on every rank.

``--ranks`` CPU processes (4 by default, one torch thread each) joined by gloo form one pipeline,
``PipelineStrategy(schedule="1F1B", chunks=ranks, balance=[2n] * ranks)``, one stage per rank. The ``nn.Sequential``
is ``--ranks`` stages of ``n = --linears-per-stage`` (2) pairs ``Linear(w, w), Tanh`` in float32, ``w`` chosen so that a
stage holds about ``--stage-mb`` MiB of parameters (200 by default: ``w = 5120``); the batch is 2 samples per rank in
``--ranks`` micro-batches (1F1B takes no fewer micro-batches than stages), so the activations are a few hundred KiB; the
loss is
``F.mse_loss`` (``compute_loss``); the optimizer plain SGD (no momentum: no optimizer state). Two configurations,
each in its own spawn of the ranks, one after the other:

* ``meta`` (ours): the LightningModule builds the ``nn.Sequential`` under ``torch.device("meta")`` in
  ``configure_model``; each rank materializes only its own stage's layers, the others stay on meta;
* ``eager`` (the anchor, the behaviour before): the same layers built in ``__init__``, so every rank makes the whole
  model in host memory (``--ranks`` stages) and trains its own stage.

Each rank measures its resident memory (RSS) in four consecutive phases. Before each phase it resets the kernel's
high-water mark (``5`` into ``/proc/self/clear_refs``) and reads ``VmRSS``; at its end it reads ``VmHWM`` from
``/proc/self/status``. A phase's figure is its **peak growth**, ``VmHWM`` at its end minus ``VmRSS`` at its start
(MiB = 2**20 bytes), so it counts only what the phase adds on top of what it was handed:

* ``build``: from before the LightningModule and the Trainer are made to the ``on_train_start`` hook: the model's
  ``__init__``, ``trainer.fit``'s setup (``configure_model``, the strategy's materialization of this rank's stage,
  cutting the stages, the optimizer) and the loop's data setup;
* ``train``: ``on_train_start`` to ``on_train_end`` (callback hooks): ``--steps`` steps of the schedule (forward,
  backward, SGD step). The parameters are already there at its start, so its growth is what training adds: the
  stage's gradients (1x its bytes); from the second micro-batch on, one layer's new weight gradient before autograd
  adds it into ``.grad`` (a plain ``Linear`` accumulating two backward passes shows the same: 1 / n of the stage
  with ``--linears-per-stage n``, 0.5x at the default 2); and the schedule's buffers and activations (small). (Until
  2026-11-28 the strategy also kept the previous step's gradients while the schedule computed the new ones: 1x more.)
* ``end``: from ``on_train_end`` until ``trainer.fit`` returns (the strategy's ``on_train_end``, which for ``eager``
  broadcasts every stage's trained weights to every rank, and the teardown);
* ``save``: ``trainer.save_checkpoint`` of a sharded checkpoint (``torch.distributed.checkpoint``, each rank writes its
  own stage) into a temporary directory.

Beside them: ``stage MiB``, the parameter bytes of the rank's own stage (the denominator of every ratio); ``holds
MiB``, the parameters of the ``nn.Sequential`` that are not on the meta device after ``fit``; ``base MiB``, the RSS
before ``build`` (Python, torch, Lightning, gloo, the data); ``peak MiB``, the rank's total RSS at its highest
(``VmHWM``, the largest over the phases); ``held``, the training peak above ``base`` (parameters + gradients +
the rest), as a ratio to the stage's bytes and to its parameters + gradients (2x its bytes: the least any training
holds with SGD without momentum). The goal of the issue, "each rank's peak host memory while building, training and
saving is <= 1.5x its own stages' bytes", gets a verdict for ``build`` and ``save`` (peak growth / stage bytes);
training cannot meet it against the parameters alone (the gradients are 1x more), so its ratios are printed without
one. ``ckpt MiB`` is the size of the rank's own files in the checkpoint directory (``__<rank>_*.distcp``).

It models host memory on CPU ranks only: on GPUs each rank's stage goes to its device, and what the host keeps is
the eager model's other stages (the meta model keeps none). It does not model optimizer state (Adam's 2x more),
activations of a real batch, nor the page cache of the written files (not in RSS). RSS is what glibc's allocator holds:
tensors of these sizes are ``mmap``-ed and returned to the system when freed, so a freed temporary does not linger.

Ends with one line, each the worst over the ranks: ``meta_build_ratio=... meta_train_ratio=...
meta_train_held_over_params_grads=... meta_save_ratio=... eager_build_ratio=... eager_train_ratio=...
eager_save_ratio=...``.

Usage: ``python benchmarks/bench_pipeline_memory.py [--ranks 4] [--stage-mb 200] [--steps 3] [--quick]``
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.distributed

from lightning_balanced import PipelineStrategy
from tests.distributed import run_distributed

MIB = 2**20
SAMPLES_PER_CHUNK = 2
GOAL = 1.5
PHASES = ("build", "train", "end", "save")


def _width(stage_mb: float, linears: int) -> int:
    """The width ``w`` whose ``linears`` float32 ``Linear(w, w)`` weights hold ``stage_mb`` MiB."""
    return max(8, round(math.sqrt(stage_mb * MIB / (4 * linears))))


def _layers(width: int, stages: int, linears: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(stages * linears):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


class _Model(pl.LightningModule):
    """The pipelined MLP: built whole in ``__init__`` (``eager``), or on the meta device in ``configure_model``."""

    def __init__(self, width: int, stages: int, linears: int, on_meta: bool) -> None:
        super().__init__()
        self.width, self.stages, self.linears, self.on_meta = width, stages, linears, on_meta
        self.sequential_module: nn.Sequential | None = None
        if not on_meta:
            torch.manual_seed(0)
            self.sequential_module = _layers(width, stages, linears)

    def configure_model(self) -> None:
        if self.sequential_module is None:
            with torch.device("meta"):
                self.sequential_module = _layers(self.width, self.stages, self.linears)

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.sequential_module is not None
        return self.compute_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    found = {key: re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE) for key in ("VmRSS", "VmHWM")}
    return {key: 1024 * int(match.group(1)) for key, match in found.items() if match is not None}


class PhaseMemory(pl.Callback):
    """Each phase's peak RSS growth (``VmHWM`` at its end minus ``VmRSS`` at its start) and ``VmHWM`` itself."""

    def __init__(self) -> None:
        self.growth: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self._phase: str | None = None

    def start(self, phase: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.at_start[phase] = _status()["VmRSS"]
        self._phase = phase

    def end(self) -> None:
        assert self._phase is not None
        hwm = _status()["VmHWM"]
        self.peak[self._phase] = hwm
        self.growth[self._phase] = hwm - self.at_start[self._phase]
        self._phase = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.end()
        self.start("train")

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.end()
        self.start("end")


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # torch 2.13 on Lightning's pytree helper


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _rank(rank: int, world_size: int, on_meta: bool, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    _quiet()
    width = _width(args.stage_mb, args.linears_per_stage)
    g = torch.Generator().manual_seed(0)
    batch = SAMPLES_PER_CHUNK * world_size
    n = batch * args.steps
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    meter = PhaseMemory()
    meter.start("build")
    model = _Model(width, world_size, args.linears_per_stage, on_meta)
    per_stage = 2 * args.linears_per_stage  # Linear, Tanh, ...
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=PipelineStrategy(
            schedule="1F1B", chunks=world_size, balance=[2 * args.linears_per_stage] * world_size
        ),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
    )
    began = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=batch))
    meter.end()
    fitted = time.perf_counter() - began
    meter.start("save")
    trainer.save_checkpoint(Path(directory) / "pipeline.ckpt")
    meter.end()
    sequential = model.sequential_module
    assert sequential is not None
    per_stage = 2 * args.linears_per_stage
    own = list(sequential)[rank * per_stage : (rank + 1) * per_stage]
    return {
        "stage": _bytes(p for layer in own for p in layer.parameters()),
        "holds": _bytes(p for p in sequential.parameters() if not p.is_meta),
        "base": meter.at_start["build"],
        "growth": meter.growth,
        "peak": meter.peak,
        "train_held": meter.peak["train"] - meter.at_start["build"],
        "fit_s": fitted,
    }


def _run(name: str, on_meta: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    directory = tempfile.mkdtemp(prefix=f"bench_pipeline_memory_{name}_")
    try:
        results = run_distributed(_rank, args.ranks, on_meta, args, directory, timeout_s=1800)
        checkpoint = Path(directory) / "pipeline.ckpt"
        for rank, result in enumerate(results):
            result["ckpt"] = sum(f.stat().st_size for f in checkpoint.glob(f"__{rank}_*.distcp"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return results


def _verdict(ratio: float) -> str:
    return "ok" if ratio <= GOAL else "OVER"


def _table(name: str, results: list[dict[str, Any]]) -> dict[str, float]:
    """Print one configuration's table; return its worst ratios over the ranks."""
    print(f"\n{name}: peak RSS growth per phase, MiB, and / the rank's stage bytes (goal <= {GOAL} for build, save)")
    header = (
        "rank", "stage", "holds", "build", "/stage", "", "train", "/stage", "held", "/stage", "/(p+g)",
        "end", "save", "/stage", "", "ckpt", "base", "peak", "fit s",
    )  # fmt: skip
    widths = (4, 7, 7, 7, 6, 4, 7, 6, 7, 6, 6, 6, 6, 6, 4, 7, 6, 7, 6)
    print(" ".join(f"{title:>{width}}" for title, width in zip(header, widths, strict=True)))
    worst = {"build": 0.0, "train": 0.0, "held": 0.0, "save": 0.0}
    for rank, r in enumerate(results):
        stage, growth = r["stage"], r["growth"]
        ratios = {phase: growth[phase] / stage for phase in ("build", "train", "save")}
        held = r["train_held"] / stage
        for key, value in (*ratios.items(), ("held", held / 2)):
            worst[key] = max(worst[key], value)
        print(
            f"{rank:>4} {stage / MIB:7.1f} {r['holds'] / MIB:7.1f}"
            f" {growth['build'] / MIB:7.1f} {ratios['build']:6.2f} {_verdict(ratios['build']):>4}"
            f" {growth['train'] / MIB:7.1f} {ratios['train']:6.2f}"
            f" {r['train_held'] / MIB:7.1f} {held:6.2f} {held / 2:6.2f}"
            f" {growth['end'] / MIB:6.1f} {growth['save'] / MIB:6.1f} {ratios['save']:6.2f}"
            f" {_verdict(ratios['save']):>4} {r['ckpt'] / MIB:7.1f} {r['base'] / MIB:6.0f}"
            f" {max(r['peak'].values()) / MIB:7.0f} {r['fit_s']:6.1f}"
        )
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo CPU processes, one pipeline stage each")
    parser.add_argument("--stage-mb", type=float, default=200.0, help="parameters per stage, MiB (float32)")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument(
        "--linears-per-stage",
        type=int,
        default=2,
        help="Linear(w, w) + Tanh pairs per stage (the transient grows as 1/n)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 60 s): --stage-mb 20 --ranks 2")
    args = parser.parse_args()
    if args.quick:
        args.stage_mb, args.ranks = 20.0, 2
    if args.ranks < 2 or args.steps < 1 or args.stage_mb <= 0:
        parser.error("--ranks must be >= 2, --steps >= 1, --stage-mb > 0")
    width = _width(args.stage_mb, args.linears_per_stage)
    print(
        f"{args.ranks} ranks x 1 stage of {args.linears_per_stage} x Linear({width}, {width}) float32,"
        f" batch {SAMPLES_PER_CHUNK * args.ranks} in {args.ranks} micro-batches, 1F1B, {args.steps} SGD steps, CPU,"
        f" torch {torch.__version__}, 1 thread per process"
    )
    began = time.perf_counter()
    worst = {}
    for name, on_meta in (("meta", True), ("eager", False)):  # one after the other: eager holds ranks x the model
        worst[name] = _table(name, _run(name, on_meta, args))
    print(
        "\nstage: the rank's own stage's parameters; holds: its non-meta parameters after fit; held: train peak above"
        " base (params + grads + rest), /(p+g) against 2x the stage; end: on_train_end to fit's return; ckpt: its"
        " .distcp files; base: RSS before build; peak: its largest VmHWM."
        f" Wall time {time.perf_counter() - began:.0f} s"
    )
    meta, eager = worst["meta"], worst["eager"]
    print(
        f"meta_build_ratio={meta['build']:.3f} meta_train_ratio={meta['train']:.3f}"
        f" meta_train_held_over_params_grads={meta['held']:.3f} meta_save_ratio={meta['save']:.3f}"
        f" eager_build_ratio={eager['build']:.3f} eager_train_ratio={eager['train']:.3f}"
        f" eager_save_ratio={eager['save']:.3f}"
    )


if __name__ == "__main__":
    main()
