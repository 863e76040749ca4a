"""The package's strategies for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` is a copy of ``lightning.pytorch`` with its own classes and its own ``StrategyRegistry``: a
``pytorch_lightning.Trainer`` accepts only strategies built on its own base classes. Each class here joins the
base-free implementation of one of our strategies to that package's base; importing this module needs
``pytorch_lightning``. ``import lightning_balanced`` registers these classes in ``pytorch_lightning``'s registry under
the same names, when that package is installed::

    import pytorch_lightning as pl
    from lightning_balanced.strategies.pytorch_lightning_compat import BalancedDataParallelStrategy

    trainer = pl.Trainer(strategy="balanced_dp", accelerator="cpu", devices=2)
    trainer = pl.Trainer(strategy=BalancedDataParallelStrategy(gpu0_bsz=14), accelerator="cuda", devices=4)
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, ParallelStrategy

from lightning_balanced.strategies import balanced_dp, ddp_lr
from lightning_balanced.strategies.balanced_dp import BalancedDataParallel
from lightning_balanced.strategies.ddp_lr import LRScaledDDP

__all__ = ["STRATEGIES", "BalancedDataParallelStrategy", "LRScaledDDPStrategy"]


class BalancedDataParallelStrategy(BalancedDataParallel, ParallelStrategy):  # type: ignore[misc]
    """``balanced_dp`` on ``pytorch_lightning``'s ``ParallelStrategy``; documented as the class below."""

    __doc__ = balanced_dp.BalancedDataParallelStrategy.__doc__


class LRScaledDDPStrategy(LRScaledDDP, DDPStrategy):  # type: ignore[misc]
    """``ddp_lr_*`` on ``pytorch_lightning``'s ``DDPStrategy``; documented as the class below."""

    __doc__ = ddp_lr.LRScaledDDPStrategy.__doc__
    _lightning_package = "pytorch_lightning"


#: The variants registered in ``pytorch_lightning``'s registry, in the order of
#: :data:`lightning_balanced.strategies.registration.STRATEGIES` (a strategy without a variant is left out).
STRATEGIES: tuple[type, ...] = (BalancedDataParallelStrategy, LRScaledDDPStrategy)
