"""The DDP strategies' layer-sync plugin: synchronized BatchNorm while fitting, the user's very layers back after."""

from __future__ import annotations

import torch
from torch import nn

from lightning_balanced.nn import DeviceSyncBatchNorm as exported
from lightning_balanced.nn.layer_sync import DeviceSyncBatchNorm
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm
from tests.nn.test_conversion import _model


def test_the_ddp_layer_sync_gives_the_users_layers_back_wherever_the_synchronized_ones_are() -> None:
    layer_sync = DeviceSyncBatchNorm(lambda: "cpu")
    model = _model()
    user_layers = [model[1], model[2][0]]
    converted = layer_sync.apply(model)
    assert [type(converted[1]), type(converted[2][0])] == [SyncBatchNorm] * 2
    converted(torch.randn(6, 3))
    converted[1].momentum = 0.5
    converted[2][0].eval()
    converted[2] = nn.Sequential(nn.Identity(), converted[2][0])  # moved while fitting (a name lookup would miss it)
    trained = {k: v.clone() for k, v in converted.state_dict().items()}

    reverted = layer_sync.revert(converted)
    assert reverted[1] is user_layers[0] and reverted[2][1] is user_layers[1]
    assert type(reverted[2][0]) is nn.Identity
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert reverted[1].momentum == 0.5
    assert reverted[1].training and not reverted[2][1].training
    # A model that is a single layer comes back as that layer.
    bn = nn.BatchNorm2d(2)
    assert layer_sync.revert(layer_sync.apply(bn)) is bn


def test_torchs_syncbatchnorm_on_cuda_is_reverted_to_the_users_layers_too() -> None:
    layer_sync = DeviceSyncBatchNorm(lambda: "cuda")  # converting needs no GPU; running it would
    model = _model()
    user_layers = [model[1], model[2][0]]
    converted = layer_sync.apply(model)
    assert [type(converted[1]), type(converted[2][0])] == [nn.SyncBatchNorm] * 2
    reverted = layer_sync.revert(converted)
    assert reverted[1] is user_layers[0] and reverted[2][0] is user_layers[1]


def test_the_nn_package_exports_the_layer_sync() -> None:
    assert exported is DeviceSyncBatchNorm
