"""Micro-batches: plan their sizes, split a mini-batch into them, join their outputs, and walk their tensors.

A micro-batch is any structure Lightning batches have (a tensor, tuples, lists, dicts, namedtuples, dataclasses around
tensors); tensors with a batch dimension are split along dim 0, 0-dim tensors and other leaves go whole to every
micro-batch (the same rules as :func:`~lightning_balanced.data_parallel.scatter`, which does the split).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_balanced.data_parallel import gather, scatter

__all__ = ["flatten", "join", "plan_micro_batches", "split"]


def plan_micro_batches(batch_size: int, chunks: int, *, batchnorm_training: bool = False) -> list[int]:
    """The sizes of the micro-batches of a mini-batch of ``batch_size`` samples: as even as possible, in order.

    There are ``min(chunks, batch_size)`` micro-batches whose sizes differ by at most one (the first ones are larger),
    so a batch that ``chunks`` does not divide loses no sample. When a BatchNorm layer trains, a micro-batch of one
    sample (which BatchNorm cannot normalize) is avoided by using fewer micro-batches, of at least two samples each,
    unless ``chunks >= batch_size``: one sample per micro-batch is then what was asked for.

    Args:
        batch_size (int): samples in the mini-batch, >= 1.
        chunks (int): the number of micro-batches asked for, >= 1.
        batchnorm_training (bool): whether a BatchNorm layer of the pipeline is in training mode.

    Returns:
        list[int]: positive sizes summing to ``batch_size``.

    Raises:
        ValueError: ``batch_size`` or ``chunks`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}")
    if chunks < 1:
        raise ValueError(f"`chunks` must be at least 1, got {chunks}")
    count = min(chunks, batch_size)
    if batchnorm_training and chunks < batch_size < 2 * count:
        count = batch_size // 2
    base, extra = divmod(batch_size, count)
    return [base + 1] * extra + [base] * (count - extra)


def split(batch: Any, sizes: Sequence[int], device: torch.device) -> list[Any]:
    """Split ``batch`` along dim 0 into micro-batches of ``sizes``, all on ``device``; autograd-aware.

    Raises:
        ValueError: ``batch`` holds no tensor with a batch dimension, its tensors disagree on dim 0, or ``sizes`` do
            not sum to it.
    """
    return scatter(batch, sizes, [device] * len(sizes))


def join(outputs: Sequence[Any], sizes: Sequence[int], device: torch.device) -> Any:
    """Concatenate the micro-batches' outputs along dim 0 on ``device``, in order; the inverse of :func:`split`.

    The micro-batches are combined as balanced_dp combines its chunks
    (:func:`~lightning_balanced.data_parallel.gather`): batched tensors and per-sample lists concatenated, 0-dim
    floating tensors as their mean weighted by micro-batch size, 0-dim integer/bool tensors summed, other leaves equal
    in every output kept once.
    """
    return gather(outputs, device, list(sizes))


def flatten(value: Any) -> tuple[list[Tensor], Callable[[Sequence[Tensor]], Any]]:
    """The tensors of ``value`` in walk order, and a function that puts other tensors in their places."""
    tensors: list[Tensor] = []
    apply_to_collection(value, Tensor, tensors.append)

    def rebuild(replacements: Sequence[Tensor]) -> Any:
        if len(replacements) != len(tensors):
            raise ValueError(f"expected {len(tensors)} tensors, got {len(replacements)}")
        it = iter(replacements)
        return apply_to_collection(value, Tensor, lambda _: next(it))

    return tensors, rebuild
