"""The pipeline's precision plugin: the user's plugin copied into a subclass of its own class that clips by the
pipeline's global norm, the user's object untouched."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_balanced.pipelining.precision import GlobalNormClipping, with_global_norm_clipping


def test_the_copy_keeps_the_class_and_settings_and_clips_through_the_strategy() -> None:
    calls: list[tuple[Optimizer, float]] = []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for plugin in (Precision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", "cpu")):
        copy = with_global_norm_clipping(plugin, lambda o, c: calls.append((o, c)))
        assert isinstance(copy, type(plugin)) and isinstance(copy, GlobalNormClipping)
        assert type(plugin) in (Precision, HalfPrecision, MixedPrecision)  # the user's object keeps its class
        assert copy.precision == plugin.precision
        copy.clip_grad_by_norm(optimizer, 2)
        assert calls[-1] == (optimizer, 2.0)
        assert with_global_norm_clipping(copy, print) is copy  # a second fit: the same object, the new function
    scaled = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    assert with_global_norm_clipping(scaled, print).scaler is scaled.scaler  # one GradScaler, not a copy
