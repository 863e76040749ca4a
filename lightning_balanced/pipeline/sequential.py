"""The ``nn.Sequential`` a pipeline strategy cuts, found on the LightningModule and checked (gpipe, pipeline)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["find_sequential"]


def find_sequential(module: Any, module_name: str, strategy: str) -> nn.Sequential:
    """The ``nn.Sequential`` at ``module.<module_name>``, unwrapped from a strategy's stand-in left by an earlier fit.

    Args:
        module (LightningModule): the module that holds the Sequential.
        module_name (str): the attribute that holds it.
        strategy (str): the strategy's registered name, for the messages.

    Raises:
        ValueError: ``module`` has no such attribute, or the Sequential has no layers.
        TypeError: the attribute is not an ``nn.Sequential``.
    """
    if not hasattr(module, module_name):
        raise ValueError(
            f"`module_name`={module_name!r}: {type(module).__name__} has no attribute {module_name!r};"
            f" strategy={strategy!r} pipelines the nn.Sequential it names"
        )
    sequential = getattr(module, module_name)
    while callable(getattr(sequential, "unwrap", None)):  # gpipe's Pipe, pipeline's stand-in: the user's Sequential
        sequential = sequential.unwrap()
    if not isinstance(sequential, nn.Sequential):
        raise TypeError(
            f"`module_name`={module_name!r}: {type(module).__name__}.{module_name} must be an nn.Sequential, got"
            f" {type(sequential).__name__}"
        )
    if len(sequential) == 0:
        raise ValueError(f"`module_name`={module_name!r}: the nn.Sequential has no layers")
    return sequential
