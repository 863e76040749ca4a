"""The package's strategies for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` is a copy of ``lightning.pytorch`` with its own classes and its own ``StrategyRegistry``: a
``pytorch_lightning.Trainer`` accepts only strategies built on its own base classes. Each class here joins the
base-free implementation of one of our strategies to that package's base; it is derived from the ``lightning.pytorch``
class of the same name (:func:`~lightning_balanced.strategies.registration.pytorch_lightning_variant`), for every
strategy of the package's table that is such a join (``gpipe`` is not, and has none). Importing this module needs
``pytorch_lightning``. ``import lightning_balanced`` registers these classes in ``pytorch_lightning``'s registry under
the same names, when that package is installed::

    import pytorch_lightning as pl
    from lightning_balanced.strategies.pytorch_lightning_compat import BalancedDataParallelStrategy

    trainer = pl.Trainer(strategy="balanced_dp", accelerator="cpu", devices=2)
    trainer = pl.Trainer(strategy=BalancedDataParallelStrategy(gpu0_bsz=14), accelerator="cuda", devices=4)

Names: ``BalancedDataParallelStrategy``, ``LRScaledDDPStrategy`` (one per strategy with a variant, named as the
``lightning.pytorch`` class) and ``STRATEGIES``, the variants in table order.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning.strategies  # noqa: F401  (this module is for pytorch_lightning: fail early without it)

from lightning_balanced.strategies.registration import pytorch_lightning_variant, strategy_classes


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    variants = {strategy.__name__: pytorch_lightning_variant(strategy) for strategy in strategy_classes()}
    present = {n: variant for n, variant in variants.items() if variant is not None}
    if name == "STRATEGIES":
        return tuple(present.values())
    if name == "__all__":
        return ["STRATEGIES", *present]
    if name in present:
        return present[name]
    if name in variants:
        raise AttributeError(
            f"{name} has no pytorch_lightning variant: its class is not a base-free implementation joined to a"
            f" lightning.pytorch base (see lightning_balanced.strategies.registration.pytorch_lightning_variant)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__getattr__("__all__")])
