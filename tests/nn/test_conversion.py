"""Both BatchNorm converters (process-group SyncBatchNorm and balanced_dp's replica BatchNorm) swap layers the same way.

They share one module-tree converter (``lightning_balanced.nn.conversion``): a user's layer, whatever its
subclass adds, is carried into the stand-in and back. The one difference they keep is what revert returns: the replica
converter the user's very object, SyncBatchNorm a new object of the user's class (as torch/mmcv's reverts do). The DDP
strategies' layer-sync plugin (``tests/nn/test_layer_sync.py``) and the pipeline's DeferredBatchNorm
(``tests/pipeline/test_batchnorm.py``) revert with the same walk to the user's very objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.data_parallel.replica_batchnorm import (
    ReplicaSyncBatchNorm,
    convert_replica_batchnorm,
    revert_replica_batchnorm,
)
from lightning_balanced.nn.conversion import convert_batchnorm, revert_batchnorm
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm

_CONVERTERS: dict[str, tuple[Callable[[nn.Module], nn.Module], Callable[[nn.Module], nn.Module], type[nn.Module]]] = {
    "SyncBatchNorm": (SyncBatchNorm.convert_sync_batchnorm, SyncBatchNorm.revert_sync_batchnorm, SyncBatchNorm),
    "replica": (convert_replica_batchnorm, revert_replica_batchnorm, ReplicaSyncBatchNorm),
}


class RichBatchNorm(nn.BatchNorm1d):
    """A user subclass with an extra parameter, an extra persistent and non-persistent buffer, and a child module."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.gain = nn.Parameter(torch.full((channels,), 2.0))
        self.register_buffer("seen", torch.zeros(channels))
        self.register_buffer("scratch", torch.ones(channels), persistent=False)
        self.probe = nn.Identity()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), RichBatchNorm(4), nn.Sequential(nn.BatchNorm1d(4, momentum=None)))


@pytest.mark.parametrize("converter", list(_CONVERTERS))
def test_a_subclass_keeps_its_extra_parameters_buffers_and_children_through_convert_and_revert(converter: str) -> None:
    convert, revert, stand_in_type = _CONVERTERS[converter]
    model = _model()
    user_layers = [model[1], model[2][0]]
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    hook_calls: list[Any] = []
    user_layers[0].register_forward_hook(lambda *args: hook_calls.append(args))

    converted = convert(model)
    assert converted is model
    assert [type(converted[1]), type(converted[2][0])] == [stand_in_type] * 2
    # The stand-in holds what the subclass added: same state-dict keys (checkpoints load into the user's model), the
    # same Parameter objects (optimizer references stay valid), the non-persistent buffer, the child module.
    assert list(converted.state_dict()) == keys
    assert dict(converted.named_parameters()) == params
    assert converted[1].scratch is user_layers[0].scratch
    assert converted[1].probe is user_layers[0].probe

    # Change state, hyperparameters and modes while converted; buffers replaced by .to() as in model_to_device.
    converted(torch.randn(6, 3))
    converted.double()
    with torch.no_grad():
        converted[1].seen.add_(5)
    converted[1].momentum = 0.5
    converted[2][0].eval()
    trained = {k: v.clone() for k, v in converted.state_dict().items()}
    scratch = converted[1].scratch

    reverted = revert(converted)
    assert reverted is model
    assert [type(reverted[1]), type(reverted[2][0])] == [RichBatchNorm, nn.BatchNorm1d]
    assert list(reverted.state_dict()) == keys
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert reverted[1].scratch is scratch and reverted[1].scratch.dtype == torch.float64
    assert type(reverted[1].probe) is nn.Identity
    assert reverted[1].momentum == 0.5
    assert reverted[1].training and not reverted[2][0].training
    # The user's hooks and attributes come back (on the user's object, or copied to the new one).
    reverted(torch.randn(6, 3, dtype=torch.float64))
    assert len(hook_calls) == 1
    # What each revert returns, kept as it was: the replica converter gives the user's objects back, SyncBatchNorm
    # (like torch's and mmcv's) new objects of the user's classes.
    same_objects = [reverted[1] is user_layers[0], reverted[2][0] is user_layers[1]]
    assert same_objects == ([True, True] if converter == "replica" else [False, False])


@pytest.mark.parametrize("converter", list(_CONVERTERS))
def test_converters_leave_each_others_stand_ins_alone_only_for_their_own_type(converter: str) -> None:
    convert, revert, stand_in_type = _CONVERTERS[converter]
    (other_name,) = set(_CONVERTERS) - {converter}
    other_convert, _, other_type = _CONVERTERS[other_name]
    # A stand-in of the other converter is a _BatchNorm like any other: converted, and reverted back to it.
    other = other_convert(nn.BatchNorm1d(3))
    assert type(other) is other_type
    converted = convert(nn.Sequential(other))
    assert type(converted[0]) is stand_in_type
    assert isinstance(converted[0], _BatchNorm)
    assert type(revert(converted)[0]) is other_type
    # Its own stand-ins are left as they are.
    own = convert(nn.BatchNorm1d(3))
    assert convert(own) is own


def test_convertible_picks_the_layers_and_carry_hooks_shares_the_hook_dicts() -> None:
    model = _model()
    user = model[2][0]
    calls: list[str] = []
    user.register_forward_pre_hook(lambda *_: calls.append("pre"))
    user.register_forward_hook(lambda *_: calls.append("post"))

    def build(layer: _BatchNorm) -> SyncBatchNorm:
        return SyncBatchNorm(layer.num_features, device="meta")

    converted = convert_batchnorm(
        model, build, SyncBatchNorm, convertible=lambda layer: type(layer) is nn.BatchNorm1d, carry_hooks=True
    )
    assert type(converted[1]) is RichBatchNorm  # not convertible: left as it is
    stand_in = converted[2][0]
    assert type(stand_in) is SyncBatchNorm and stand_in._forward_hooks is user._forward_hooks
    stand_in(torch.randn(4, 4))
    assert calls == ["pre", "post"]

    fresh = nn.BatchNorm1d(4, device="meta")
    reverted = revert_batchnorm(converted, lambda m: fresh if m is stand_in else None, carry_hooks=True)
    assert reverted[2][0] is fresh and fresh._forward_pre_hooks is user._forward_pre_hooks
    assert fresh.running_mean is stand_in.running_mean
    # Without carry_hooks (the default), neither direction shares them.
    other = convert_batchnorm(nn.BatchNorm1d(4), build, SyncBatchNorm)
    assert other._forward_hooks is not user._forward_hooks and not other._forward_hooks
