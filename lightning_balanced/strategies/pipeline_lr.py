"""``strategy="pipeline_lr_linear"`` / ``"pipeline_lr_sqrt"``: pipelines x data parallel with ``ddp_lr_*``'s scaling."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_balanced.strategies.ddp_lr import LRScaledDDP
from lightning_balanced.strategies.pipeline import PipelineStrategy
from lightning_balanced.strategies.registration import register_variants

__all__ = ["LRScaledPipelineStrategy"]


class LRScaledPipelineStrategy(LRScaledDDP, PipelineStrategy):
    """:class:`PipelineStrategy` that scales the learning rate as ``ddp_lr_*`` do, in its data-parallel size.

    With ``pipeline_parallel_size=p`` and ``p x d`` processes, the effective batch size is ``per-device batch x d x
    accumulate_grad_batches``: the ``d`` pipelines each read their own data, the ``p`` ranks of a pipeline the same. The
    factor, its storage in the param groups (resume-safe), ``reference_batch_size`` and ``warmup_steps`` are those of
    :class:`~lightning_balanced.LRScaledDDPStrategy`; BatchNorm is not synchronized (``strategy="pipeline"`` does not
    take ``sync_batchnorm``).

    Args:
        lr_scaling: ``"linear"`` (Goyal et al. 2017), ``"sqrt"`` (Hoffer et al. 2017; Malladi et al. 2022 for Adam-like
            optimizers) or ``"none"``.
        reference_batch_size: the effective batch size the base learning rate was tuned for; ``None`` = the
            dataloader's batch size on one pipeline without accumulation.
        warmup_steps: optimizer steps of gradual warmup from the unscaled to the scaled learning rate.
        **kwargs: what :class:`PipelineStrategy` takes (``schedule``, ``chunks``, ``pipeline_parallel_size``, ...).

    Raises:
        ValueError: as :class:`~lightning_balanced.LRScaledDDPStrategy` and :class:`PipelineStrategy` raise.
        TypeError: as :class:`~lightning_balanced.LRScaledDDPStrategy` and :class:`PipelineStrategy` raise.
    """

    strategy_name = "pipeline_lr"

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``pipeline_lr_linear`` and ``pipeline_lr_sqrt``.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        described = "pipeline parallelism with {} learning-rate scaling in its data-parallel size"
        variants = [(f"pipeline_lr_{p}", described.format(p), {"lr_scaling": p}) for p in ("linear", "sqrt")]
        register_variants(cls, strategy_registry, variants)

    def __init__(self, **kwargs: Any) -> None:
        # LRScaledDDP's arguments but `sync_batchnorm` (the pipeline's BatchNorm is DeferredBatchNorm), then
        # PipelineStrategy's; LightningCLI and the package's helpers leave out what is set here.
        super().__init__(sync_batchnorm=False, **kwargs)
