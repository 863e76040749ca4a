"""Train a small BatchNorm CNN on scikit-learn's handwritten digits with ``strategy="balanced_dp"``.

The 1,797 8x8 digit images ship with scikit-learn, so this runs anywhere without a download. With the bundled config
the batch is split unevenly over two devices (device 0 takes ``gpu0_bsz`` samples, device 1 the rest); on a machine
without GPUs, ``accelerator: cpu, devices: 2`` runs the same split over two CPU replicas::

    python examples/digits.py fit --config examples/configs/digits_balanced_dp.yaml

which is the same as ``lightning-balanced fit --config ...`` (run from the repository root, where the configs name the
classes here as ``examples.digits.*``); ``examples/configs/digits_ddp_lr_sqrt.yaml`` runs the same job under LR-scaled
DDP. Any setting can be overridden on the command line, e.g. ``--trainer.max_epochs=3`` or
``--trainer.strategy.init_args.gpu0_bsz=24``; ``--print_config`` shows them all.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_balanced.cli import LightningBalancedCLI

NUM_CLASSES = 10


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 handwritten digits as ``(N, 1, 8, 8)`` float tensors, split into train and validation.

    Args:
        batch_size: samples per batch; with ``balanced_dp`` this is the whole batch that is split over the devices.
        val_fraction: share of the data held out for validation (stratified by class).
        split_seed: seed of the train/validation split, independent of the training seed.
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def setup(self, stage: str) -> None:
        """Load the images, split them, and standardize with the training set's mean and std."""
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8), pixel values 0..16
        y = torch.tensor(digits.target, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            range(len(y)), test_size=self.val_fraction, stratify=digits.target, random_state=self.split_seed
        )
        mean, std = x[train_idx].mean(), x[train_idx].std()
        x = (x - mean) / std
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches; ``drop_last`` so no device ever gets a chunk too small to batch-normalize."""
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Every validation sample exactly once (BatchNorm uses its running statistics here)."""
        return DataLoader(self.val_set, batch_size=self.batch_size)


def conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    """A 3x3 convolution that keeps the spatial size, then BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class DigitsClassifier(pl.LightningModule):
    """A small CNN for 8x8 digits: conv-BN-ReLU blocks, max pooling, global average pooling, a linear head.

    Args:
        channels: width of the first blocks; the last block has twice as many.
        lr: learning rate of AdamW.
        weight_decay: weight decay of AdamW.
    """

    def __init__(self, channels: int = 32, lr: float = 3e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            conv_bn_relu(1, channels),
            conv_bn_relu(channels, channels),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            conv_bn_relu(channels, 2 * channels),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * channels, NUM_CLASSES),
        )
        # Accumulates over the whole validation set and is computed once per epoch (micro average = plain accuracy).
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self._fit_started = 0.0

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of shape ``(N, 10)`` for images of shape ``(N, 1, 8, 8)``."""
        return self.net(x)

    def compute_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy of ``(N, 10)`` logits against ``(N,)`` class indices; ``strategy="pipeline"`` calls it
        on each micro-batch in the last stage."""
        return F.cross_entropy(logits, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Mean cross-entropy over the (chunk of the) batch; ``balanced_dp`` weights the chunks' losses by size."""
        x, y = batch
        loss = self.compute_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Log the validation loss and update the epoch's accuracy."""
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def on_fit_start(self) -> None:
        """Start the clock."""
        self._fit_started = time.perf_counter()

    def on_fit_end(self) -> None:
        """Print ``final: val_acc=... val_loss=... epochs=... wall_s=...`` on rank 0."""
        wall_s = time.perf_counter() - self._fit_started
        if self.trainer.is_global_zero:
            metrics = self.trainer.callback_metrics
            val_acc, val_loss = (float(metrics.get(name, math.nan)) for name in ("val_acc", "val_loss"))
            print(
                f"final: val_acc={val_acc:.4f} val_loss={val_loss:.4f} epochs={self.trainer.current_epoch}"
                f" wall_s={wall_s:.1f}",
                flush=True,
            )

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW, its learning rate annealed to zero over the run (cosine, per step) so the last epochs are stable."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(args: list[str] | None = None) -> LightningBalancedCLI:
    """``python examples/digits.py fit --config ...``: the same as ``lightning-balanced`` (``args`` instead of
    ``sys.argv[1:]`` when given); returns the CLI object."""
    return LightningBalancedCLI(seed_everything_default=42, args=args)


if __name__ == "__main__":
    main()
