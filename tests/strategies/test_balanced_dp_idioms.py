"""Common Lightning idioms under balanced_dp equal the single-device run: a manual-optimization GAN, a torchmetrics
metric updated in the step.

float64 throughout. The runs differ only in how the per-chunk sums are ordered (~1e-16 relative per step); over a
dozen Adam steps that stays far below the tolerances (weights 1e-9, losses and metrics rel 1e-6), which a stale
parameter copy or a lost metric update exceeds by orders of magnitude.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer

WEIGHTS = {"rtol": 0, "atol": 1e-9}
VALUES = {"rel": 1e-6}


class BasicGAN(pl.LightningModule):
    """Lightning's basic-GAN recipe: two Adam optimizers, toggled, stepped one after the other in one step."""

    def __init__(self, clip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.automatic_optimization = False
        self.clip = clip

    def _step(self, optimizer: Any, loss: torch.Tensor) -> None:
        self.manual_backward(loss)
        if self.clip:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        self.untoggle_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        valid = torch.ones(len(real), 1, dtype=real.dtype, device=real.device)
        fake = torch.zeros_like(valid)
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), valid)
        self._step(opt_g, g_loss)
        # The discriminator's passes come after the generator's step, and must see the updated generator.
        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), valid)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self._step(opt_d, d_loss)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999)),
        ]


def _gan_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(24, 4, generator=g, dtype=torch.float64), torch.randn(24, 3, generator=g, dtype=torch.float64)
    )


def _fit_gan(strategy: Any, devices: Any, clip: bool, **kwargs: Any) -> tuple[dict[str, float], dict[str, Any]]:
    model = BasicGAN(clip)
    trainer = quiet_trainer(strategy, devices, max_epochs=2, **kwargs)
    trainer.fit(model, DataLoader(_gan_data(), batch_size=8))  # 3 steps per epoch, 2 optimizer steps each
    logged = {name: trainer.callback_metrics[name].item() for name in ("g_loss", "d_loss")}
    # On the host: Lightning's teardown moves the module there after fit.
    return logged, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "gradient-clipping"])
@pytest.mark.parametrize("devices", [2, 3])
def test_manual_optimization_gan_equals_the_single_device_run(devices: int, clip: bool) -> None:
    expected_logged, expected_weights = _fit_gan("auto", 1, clip)
    logged, weights = _fit_gan("balanced_dp", devices, clip)
    assert logged == pytest.approx(expected_logged, **VALUES)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_weights[name], **WEIGHTS, msg=name)


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_manual_optimization_gan_equals_the_single_device_run_on_cuda(devices: list[torch.device]) -> None:
    # Replicas on their own streams: each lockstep call runs on the root's stream between them, and the parameter
    # copies (of replicas on other GPUs, or after the first on a shared GPU) are refreshed there after each step.
    expected_logged, expected_weights = _fit_gan("auto", 1, clip=True)
    strategy = BalancedDataParallelStrategy(parallel_devices=devices)
    logged, weights = _fit_gan(strategy, gpu_ids(devices), clip=True, accelerator="cuda")
    assert logged == pytest.approx(expected_logged, **VALUES)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_weights[name], **WEIGHTS, msg=name)


class R2Regressor(pl.LightningModule):
    """A torchmetrics metric (its states are neither parameters nor buffers) updated in the step, logged as such."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(5, 3).double()
        # torchmetrics before 1.5 sizes its states by `num_outputs` (default 1); later releases infer it.
        accepts = "num_outputs" in inspect.signature(torchmetrics.R2Score.__init__).parameters
        self.r2 = torchmetrics.R2Score(multioutput="uniform_average", **({"num_outputs": 3} if accepts else {}))

    def _evaluate(self, batch: Any, name: str) -> None:
        x, y = batch
        self.r2.update(self.layer(x), y)
        self.log(name, self.r2)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val_r2")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test_r2")


class R2ByForward(R2Regressor):
    """The metric called as a module: ``forward`` updates it and returns the value of the replica's chunk alone (the
    global states are set aside and restored inside). So no chunk may have a single sample, which R2 refuses."""

    def _evaluate(self, batch: Any, name: str) -> None:
        x, y = batch
        self.r2(self.layer(x), y)
        self.log(name, self.r2)


@pytest.mark.parametrize(
    ("module_class", "samples", "batch_size"),
    [(R2Regressor, 37, 8), (R2ByForward, 36, 9)],  # 37: a last batch of 5, one chunk of 1 on 3 devices
    ids=["update", "forward"],
)
@pytest.mark.parametrize("devices", [2, 3])
def test_a_metric_updated_in_the_step_equals_the_single_device_value(
    devices: int, module_class: type, samples: int, batch_size: int
) -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(samples, 5, generator=g, dtype=torch.float64),
        torch.randn(samples, 3, generator=g, dtype=torch.float64),
    )
    model = module_class()
    x, y = data[:]
    expected = torchmetrics.functional.r2_score(model.layer(x).detach(), y).item()
    trainer = quiet_trainer("balanced_dp", devices)
    loader = DataLoader(data, batch_size=batch_size)
    validated = trainer.validate(model, loader, verbose=False)[0]["val_r2"]
    tested = trainer.test(model, loader, verbose=False)[0]["test_r2"]
    assert (validated, tested) == pytest.approx((expected, expected), **VALUES)


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_a_metric_updated_in_the_step_equals_the_single_device_value_on_cuda(devices: list[torch.device]) -> None:
    # Every replica's update runs on the root's stream, one at a time: no race on the states across streams.
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(37, 5, generator=g, dtype=torch.float64), torch.randn(37, 3, generator=g, dtype=torch.float64)
    )
    model = R2Regressor()
    x, y = data[:]
    expected = torchmetrics.functional.r2_score(model.layer(x).detach(), y).item()
    strategy = BalancedDataParallelStrategy(parallel_devices=devices)
    trainer = quiet_trainer(strategy, gpu_ids(devices), accelerator="cuda")
    tested = trainer.test(model, DataLoader(data, batch_size=8), verbose=False)[0]["test_r2"]
    assert tested == pytest.approx(expected, **VALUES)
