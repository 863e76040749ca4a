"""One partition of the pipeline: consecutive layers of the ``nn.Sequential`` run on one device."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.gpipe.rng import draws_random_numbers
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.microbatch import flatten

__all__ = ["Partition"]


class Partition:
    """Consecutive layers ``layers[k] = (index in the Sequential, module)``, called in order like ``nn.Sequential``.

    Between layers the value must hold a tensor (a tensor, or tuples/lists/dicts of tensors): a layer that returns
    anything else, or that rejects with ``TypeError`` the non-tensor its predecessor returned, raises a ``TypeError``
    naming both layers. A first layer with ``inplace=True`` (``nn.ReLU(inplace=True)``, ...) gets a copy of the
    partition's input, which the pipeline keeps for recomputation and ordering.
    """

    def __init__(self, layers: Sequence[tuple[int, Module]], device: torch.device, module_name: str) -> None:
        self.layers = list(layers)
        self.device = device
        self.module_name = module_name

    def tensor_ids(self) -> frozenset[int]:
        """The ``id``s of the partition's parameters and buffers (for the CPU emulation's device rule)."""
        return frozenset(
            id(tensor) for _, layer in self.layers for tensor in itertools.chain(layer.parameters(), layer.buffers())
        )

    def _name(self, index: int) -> str:
        return f"`{self.module_name}[{index}]`"

    def __call__(self, value: Any) -> Any:
        """Run the layers on ``value`` in order and return the last one's output."""
        for k, (index, layer) in enumerate(self.layers):
            if k == 0 and getattr(layer, "inplace", False) is True:
                value = _clone(value)
            try:
                output = layer(value)
            except TypeError as err:
                if isinstance(value, Tensor) or index == 0:
                    raise
                raise TypeError(
                    f"{self._name(index)} ({type(layer).__name__}) cannot take the {type(value).__name__} that"
                    f" {self._name(index - 1)} returned: {err}. Make {self._name(index - 1)} return a Tensor, or put a"
                    " layer between them that picks the tensor out."
                ) from err
            if not flatten(output)[0]:
                raise TypeError(
                    f"{self._name(index)} ({type(layer).__name__}) returned {type(output).__name__}, which holds no"
                    f" tensor; the layers of `{self.module_name}` must pass a Tensor (or tuples/lists/dicts of"
                    " tensors) to the next layer"
                )
            value = output
        return value

    def draws_random_numbers(self) -> bool:
        """Whether a layer draws random numbers now (:func:`~lightning_balanced.gpipe.rng.draws_random_numbers`)."""
        return any(draws_random_numbers(layer) for _, layer in self.layers)

    @contextmanager
    def frozen_batchnorm_statistics(self) -> Iterator[None]:
        """Keep the running statistics of plain BatchNorm layers as they are (for a recomputation).

        The layers update copies, dropped afterwards; the buffers themselves are never written, so a graph that saved
        them stays valid.
        """
        swapped: list[tuple[_BatchNorm, dict[str, Tensor | None]]] = []
        for _, layer in self.layers:
            for m in layer.modules():
                deferred = isinstance(m, DeferredBatchNorm)  # tracks in its accumulator, told by the recompute mode
                if isinstance(m, _BatchNorm) and m.training and m.track_running_stats and not deferred:
                    names = ("running_mean", "running_var", "num_batches_tracked")
                    originals = {name: m._buffers[name] for name in names}
                    for name, buffer in originals.items():
                        m._buffers[name] = None if buffer is None else buffer.clone()
                    swapped.append((m, originals))
        try:
            yield
        finally:
            for m, originals in swapped:
                m._buffers.update(originals)


def _clone(value: Any) -> Any:
    tensors, rebuild = flatten(value)
    return rebuild([t.clone() for t in tensors])
