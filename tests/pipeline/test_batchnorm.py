"""DeferredBatchNorm on the nn toolkit: moments merged by ``combine_moments``, swapped by the conversion walk.

Its running statistics against the unpipelined BatchNorm, through a whole pipeline, are tested in
``tests/pipeline/test_pipeline.py``; here the layer alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_balanced.nn.moments import batch_moments, combine_moments
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm
from lightning_balanced.pipeline import DeferredBatchNorm, is_recomputing
from lightning_balanced.pipeline.recompute import recomputing


def _feed(bn: DeferredBatchNorm, x: torch.Tensor, sizes: list[int]) -> None:
    for part in x.split(sizes):
        bn(part)
    bn.commit()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_commit_is_combine_moments_of_the_micro_batches_moments(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(11, 3, 4, dtype=torch.float64) * 2 + 50).to(dtype)
    sizes = [3, 3, 3, 2]
    bn = DeferredBatchNorm(3, momentum=None, dtype=dtype)
    _feed(bn, x, sizes)
    parts = [batch_moments(part.to(dtype), [0, 2], dtype=torch.float64) for part in x.split(sizes)]
    total = combine_moments(
        torch.stack([p.count for p in parts]), torch.stack([p.mean for p in parts]), torch.stack([p.m2 for p in parts])
    )
    assert int(bn.num_batches_tracked) == 1
    assert torch.equal(bn.running_mean, total.mean.to(dtype))  # momentum None, first batch: the batch statistics
    assert torch.equal(bn.running_var, total.variance(unbiased=True).to(dtype))


def test_float32_running_variance_stays_accurate_far_from_zero() -> None:
    # |mean| / std ~ 3e3: an uncentered or float32 merge of the micro-batches loses the variance's leading digits.
    torch.manual_seed(0)
    x64 = torch.randn(64, 6, 5, dtype=torch.float64) * 3 + 1e4
    x = x64.float()
    bn = DeferredBatchNorm(6, momentum=None)
    _feed(bn, x, [1, 5, 17, 2, 39])
    reference = x.double().transpose(0, 1).reshape(6, -1)  # the float32 data, in float64
    torch.testing.assert_close(bn.running_var.double(), reference.var(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(bn.running_mean.double(), reference.mean(1), rtol=0, atol=2e-3)  # ~2 float32 ulps


def test_a_recomputation_is_not_tracked_and_commit_without_micro_batches_is_a_no_op() -> None:
    bn = DeferredBatchNorm(2)
    assert not is_recomputing()
    with recomputing():
        assert is_recomputing()
        bn(torch.randn(4, 2))
    assert not is_recomputing()
    bn.commit()
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(2))


def test_is_recomputing_is_still_importable_from_checkpoint() -> None:
    from lightning_balanced.gpipe import checkpoint
    from lightning_balanced.pipeline import recompute

    assert checkpoint.is_recomputing is recompute.is_recomputing is is_recomputing


class MyBatchNorm(nn.BatchNorm2d):
    """A subclass: its forward may differ, so it is left as it is."""


def test_convert_and_revert_give_the_users_own_layers_back_with_their_state_and_hooks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 1),
        nn.BatchNorm2d(3),
        nn.Sequential(nn.BatchNorm2d(3, momentum=None)),
        MyBatchNorm(3),
        SyncBatchNorm(3),
    )
    user = [model[1], model[2][0]]
    keys, params = list(model.state_dict()), dict(model.named_parameters())
    calls: list[str] = []
    user[0].register_forward_hook(lambda *_: calls.append("user's hook"))

    converted = DeferredBatchNorm.convert_deferred_batch_norm(model)
    assert converted is model
    assert [type(m) for m in model] == [nn.Conv2d, DeferredBatchNorm, nn.Sequential, MyBatchNorm, SyncBatchNorm]
    assert type(model[2][0]) is DeferredBatchNorm
    assert model[1]._original_class is nn.BatchNorm2d and model[1].weight is user[0].weight
    assert list(model.state_dict()) == keys and dict(model.named_parameters()) == params
    assert DeferredBatchNorm.convert_deferred_batch_norm(model[1]) is model[1]  # converting twice: nothing to do

    model[1].register_forward_hook(lambda *_: calls.append("hook added while converted"))
    model(torch.randn(4, 2, 3, 3))
    assert calls == ["user's hook", "hook added while converted"]  # the user's hooks run while converted
    model[1].commit()
    model.double()  # new buffer tensors on the stand-ins
    model[1].momentum = 0.5
    model[2][0].eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    reverted = DeferredBatchNorm.revert_deferred_batch_norm(model)
    assert reverted is model and reverted[1] is user[0] and reverted[2][0] is user[1]
    assert type(reverted[3]) is MyBatchNorm and type(reverted[4]) is SyncBatchNorm
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert reverted[1].running_mean.dtype == torch.float64 and int(reverted[1].num_batches_tracked) == 1
    assert reverted[1].momentum == 0.5 and reverted[1].training and not reverted[2][0].training
    calls.clear()
    reverted(torch.randn(4, 2, 3, 3, dtype=torch.float64))
    assert calls == ["user's hook", "hook added while converted"]


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(3), nn.BatchNorm3d(3, affine=False, track_running_stats=False)])
def test_a_single_layer_is_converted_to_a_stand_in_and_reverted_to_itself(layer: nn.Module) -> None:
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(layer)
    assert type(deferred) is DeferredBatchNorm and deferred._original_class is type(layer)
    assert DeferredBatchNorm.revert_deferred_batch_norm(deferred) is layer


def test_a_deferred_batchnorm_built_directly_reverts_to_a_new_batchnorm2d_holding_its_tensors() -> None:
    deferred = DeferredBatchNorm(4, eps=1e-3)
    seen: list[Any] = []
    deferred.register_forward_pre_hook(lambda *_: seen.append(True))
    reverted = DeferredBatchNorm.revert_deferred_batch_norm(nn.Sequential(deferred))[0]
    assert type(reverted) is nn.BatchNorm2d and reverted.eps == 1e-3
    assert reverted.weight is deferred.weight and reverted.running_var is deferred.running_var
    reverted(torch.randn(2, 4, 1, 1))
    assert seen == [True]
