"""Name ``IndexedDataset`` when an evaluation step that expects ``(indices, sample)`` batches gets plain ones.

The mixin's pattern is ``indices, (x, y) = batch`` over ``IndexedDataset(dataset)``. Forget the wrapper and the
batch is ``[x, y]``: the unpacking "succeeds" with ``indices = x`` and fails somewhere inside the model, with an error
that says nothing about indices. :func:`naming_missing_indices` wraps a LightningModule's evaluation step so that an
error on the first batch of a loader whose batches carry no index becomes a ``ValueError`` that says so and what to
change, chained to the step's own error. Every other call and error goes through unchanged; the step's signature,
which Lightning inspects, is kept (``functools.wraps``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import lightning_balanced.evaluation.sample_order as sample_order
from lightning_balanced.evaluation.indexed_dataset import IndexedDataset

__all__ = ["EVALUATION_STEPS", "naming_missing_indices"]

#: The LightningModule steps whose batches come from evaluation dataloaders.
EVALUATION_STEPS = ("validation_step", "test_step", "predict_step")

_WRAPPED = "_lightning_balanced_names_missing_indices"


def naming_missing_indices(step: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Wrap an evaluation step so its error on a first batch without indices names ``IndexedDataset``.

    The step's error becomes a ``ValueError`` (from it) only when all hold: it is a ``ValueError``, ``TypeError``,
    ``IndexError`` or ``RuntimeError`` other than out-of-memory; ``batch_idx`` is 0; the batch is a list or tuple whose
    first element is not a 1-D integer tensor or a list of ints (the indices ``IndexedDataset`` puts there); and the
    current loader's dataset, where the trainer knows it, is not an ``IndexedDataset``.

    Args:
        step (Callable): ``validation_step``, ``test_step`` or ``predict_step`` of a LightningModule class.
        name (str): the step's name, for the message.

    Returns:
        Callable: the wrapped step (``step`` itself when already wrapped).
    """
    if getattr(step, _WRAPPED, False):
        return step

    @functools.wraps(step)
    def wrapped(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, batch, *args, **kwargs)
        except (ValueError, TypeError, IndexError, RuntimeError) as err:
            batch_idx = args[0] if args else kwargs.get("batch_idx")
            message = _message(self, name, batch, err) if batch_idx == 0 and not _out_of_memory(err) else None
            if message is None:
                raise
            named = ValueError(message)
            setattr(named, _WRAPPED, True)  # a subclass's step calling this one's: named once
            raise named from err

    setattr(wrapped, _WRAPPED, True)
    wrapped.__wrapped__ = inspect.unwrap(step)  # Lightning unwraps one level only
    return wrapped


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def _message(module: Any, name: str, batch: Any, err: BaseException) -> str | None:
    if getattr(err, _WRAPPED, False) or not isinstance(batch, (list, tuple)) or not batch or _indices(batch[0]):
        return None
    dataset = _current_dataset(module)
    if isinstance(dataset, IndexedDataset):
        return None
    source = f"{type(dataset).__name__} items" if dataset is not None else "the batch"
    return (
        f"{name} failed on its first batch ({type(err).__name__}: {err}), and that batch carries no sample indices:"
        f" {source}, whose first element is {_describe(batch[0])}. If the step unpacks `indices, sample = batch`"
        " (DistributedEvalMixin's example), wrap the evaluation dataset: DataLoader(IndexedDataset(dataset), ...),"
        " with `from lightning_balanced import IndexedDataset`. Indices are optional: add_eval_outputs(preds=...,"
        " target=...) without them is exact under DistributedSampler, balanced_dp and balanced_ddp"
    )


def _indices(value: Any) -> bool:
    if isinstance(value, Tensor):
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return value.dim() == 1 and integer
    return isinstance(value, (list, tuple)) and all(isinstance(item, int) for item in value)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _current_dataset(module: Any) -> Any:
    trainer = getattr(module, "_trainer", None)
    return None if trainer is None else getattr(sample_order.current_loader(trainer), "dataset", None)
