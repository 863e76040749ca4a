"""What ``strategy="pipeline"`` takes as a training batch: ``(input, target)``, cut into ``chunks`` equal micro-batches.

``input`` is the first stage's (a tensor, or a tuple of tensors: its arguments), ``target`` goes to the last stage's
``compute_loss``. A LightningModule with other batches defines ``pipeline_batch(self, batch) -> (input, target)``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_balanced.pipelining.p2p_forward import Activation

__all__ = ["BATCH_HOOK", "check_batch_size", "check_loader_batch_sizes", "input_and_target", "to_device"]

#: The optional LightningModule hook that splits a training batch into the first stage's input(s) and the target.
BATCH_HOOK = "pipeline_batch"


def input_and_target(module: pl.LightningModule, batch: Any) -> tuple[Activation, Tensor]:
    """The first stage's input(s) and the target: ``pipeline_batch(batch)`` where ``module`` defines it, else ``batch``.

    Raises:
        TypeError: the batch (or what ``pipeline_batch`` returned) is not ``(input, target)`` with ``input`` a tensor or
            a tuple of tensors and ``target`` a tensor.
    """
    hook = getattr(module, BATCH_HOOK, None)
    split = hook(batch) if callable(hook) else batch
    if (
        isinstance(split, (tuple, list))
        and len(split) == 2
        and isinstance(split[1], Tensor)
        and (isinstance(split[0], Tensor) or _is_tensor_tuple(split[0]))
    ):
        return (split[0] if isinstance(split[0], Tensor) else tuple(split[0])), split[1]
    if callable(hook):
        raise TypeError(
            f"`{type(module).__name__}.{BATCH_HOOK}(batch)` must return `(input, target)`: `input` a tensor or a"
            f" tuple of tensors (the first stage's arguments), `target` a tensor; got {_described(split)}"
        )
    raise TypeError(
        "strategy='pipeline' takes batches of `(input, target)` tensors: the first stage reads `input`, the last"
        f" stage's `compute_loss` gets `target`; got {_described(batch)}. For other batches define"
        f" `{BATCH_HOOK}(self, batch) -> (input, target)` on the LightningModule"
    )


def check_batch_size(batch_size: int, chunks: int) -> None:
    """Raise a ``ValueError`` unless a batch of ``batch_size`` samples splits into ``chunks`` equal micro-batches."""
    if batch_size % chunks:
        raise ValueError(
            f"strategy='pipeline' splits each batch into `chunks`={chunks} equal micro-batches, but a batch"
            f" has {batch_size} samples: use a batch size that is a multiple of {chunks} (and"
            " `drop_last=True` for a short last batch)"
        )


def check_loader_batch_sizes(trainer: pl.Trainer, chunks: int) -> None:
    """Before the first step: every training batch that will run splits into ``chunks`` equal micro-batches.

    Checked where the training DataLoader tells its ``batch_size`` and its sampler's length (this rank's share under
    ``DistributedSampler``); else each step checks its batch (:func:`check_batch_size`).

    Raises:
        ValueError: the ``batch_size``, or the last batch of an epoch that will run, is not a multiple of ``chunks``.
    """
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader) or not isinstance(loader.batch_size, int):
        return
    if loader.batch_size % chunks:
        raise ValueError(
            f"strategy='pipeline' splits each batch into `chunks`={chunks} equal micro-batches, but the"
            f" DataLoader's `batch_size` is {loader.batch_size}: use a multiple of {chunks}"
        )
    try:
        samples = len(loader.sampler)  # type: ignore[arg-type]  # this rank's: DistributedSampler's share
    except TypeError:
        return
    last = samples % loader.batch_size
    reached = trainer.num_training_batches >= len(loader)
    if last and last % chunks and not loader.drop_last and reached:
        raise ValueError(
            f"strategy='pipeline' splits each batch into `chunks`={chunks} equal micro-batches, but the last"
            f" training batch of each epoch would have {last} samples ({samples} samples per data-parallel rank in"
            f" batches of {loader.batch_size}): set `drop_last=True` on the DataLoader, or choose sizes that leave"
            f" a multiple of {chunks}"
        )


def to_device(x: Activation, device: torch.device) -> Activation:
    """``x`` (a tensor or a tuple of tensors) on ``device``."""
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


def _is_tensor_tuple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(t, Tensor) for t in value)


def _described(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
