"""Placement for the pipeline strategies: a model made in host memory, moved to a device all but its pipelined part.

``gpipe`` and ``pipeline`` never move the pipelined ``nn.Sequential`` as a whole: each partition (stage) goes to its
own device, and no device holds every layer. The rest of the LightningModule goes to the root device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn

__all__ = ["host_init_context", "to_device_but"]


@contextmanager
def host_init_context(precision_plugin: Any, empty_init: bool | None) -> Iterator[None]:
    """``Trainer.init_module()`` for a pipeline strategy: tensors made in host memory, with the precision's dtype.

    Then each partition (stage) moves to its own device, and no device ever holds the whole model.
    """
    with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"), precision_plugin.tensor_init_context():
        yield


def to_device_but(model: nn.Module, module: nn.Module, slot: str, kept: nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device``, except ``kept``, the child of ``module`` named ``slot``, which stays where it is.

    The slot is emptied while the rest moves (``Module._apply`` skips an empty slot) and filled again in place, so the
    order of the parameters (which an optimizer's ``state_dict`` refers to by position) and of the ``state_dict``
    keys does not change.
    """
    module._modules[slot] = None
    try:
        model.to(device)
    finally:
        module._modules[slot] = kept
