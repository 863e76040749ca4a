"""Lightning's ``LayerSync`` plugin for the DDP strategies: synchronized BatchNorm on any device, reverted by identity.

Lightning's own ``TorchSyncBatchNorm`` puts torch's :class:`torch.nn.SyncBatchNorm` in (which refuses CPU tensors in
training) and reverts by building new layers. :class:`DeviceSyncBatchNorm` uses torch's on CUDA and
:class:`~lightning_balanced.nn.sync_batchnorm.SyncBatchNorm` elsewhere, and gives the user's very BatchNorm objects
back through the conversion walk (:func:`~lightning_balanced.nn.conversion.revert_batchnorm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_balanced.nn.conversion import revert_batchnorm
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["DeviceSyncBatchNorm"]


class DeviceSyncBatchNorm(LayerSync):
    """Lightning ``LayerSync`` plugin: torch's ``SyncBatchNorm`` on CUDA, ours elsewhere; reverts to the user's layers.

    :meth:`revert` puts the very BatchNorm objects :meth:`apply` replaced back into the model (their class, hooks and
    attributes intact), wherever the synchronized layers are now, holding their current parameters, buffers,
    hyperparameters and training flag.

    Args:
        device_type (Callable[[], str]): returns the type of the strategy's root device when :meth:`apply` runs.
    """

    def __init__(self, device_type: Callable[[], str]) -> None:
        self._device_type = device_type
        self._originals: dict[Module, _BatchNorm] = {}

    @override
    def apply(self, model: Module) -> Module:
        """Replace every BatchNorm layer of ``model`` by a synchronized one sharing its parameters and buffers."""
        originals = {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}
        if self._device_type() == "cuda":
            converted: Module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            converted = SyncBatchNorm.convert_sync_batchnorm(model)
        # Each synchronized layer -> the user's layer it replaced (torch's converter keeps no link back).
        synced = {name: converted.get_submodule(name) for name in originals}
        self._originals = {synced[name]: m for name, m in originals.items() if synced[name] is not m}
        return converted

    @override
    def revert(self, model: Module) -> Module:
        """Put the user's BatchNorm layers back, with the trained state of the synchronized ones."""
        originals, self._originals = self._originals, {}
        return revert_batchnorm(model, originals.get)
