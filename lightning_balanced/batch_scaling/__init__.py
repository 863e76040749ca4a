"""How training hyperparameters follow the batch: the learning-rate scaling rules (``lr_scaling``),
:class:`ScaleInvariance` (learning rate, Adam's betas and epsilon, EMA, warmup in samples), the gradient noise scale
(``noise_scale``) and the check of a resumed run's scale factor (``factor_check``).
"""

from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheck
from lightning_balanced.batch_scaling.noise_scale import GradientNoiseScale
from lightning_balanced.batch_scaling.scale_invariance import ScaleInvariance

__all__ = ["GradientNoiseScale", "LRScaleFactorCheck", "ScaleInvariance"]
