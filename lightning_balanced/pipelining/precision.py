"""``strategy="pipeline"``'s precision plugin: the user's, whatever it is, clipping by the pipeline's global norm.

Each rank holds its own stages' gradients only, so Lightning's ``clip_grad_by_norm`` (``clip_grad_norm_`` over this
rank's parameters) would clip each stage by its own norm. :func:`with_global_norm_clipping` returns a copy of the
plugin as an instance of a subclass of its own class (as Lightning subclasses its plugins for FSDP and DeepSpeed) whose
``clip_grad_by_norm`` is the strategy's: the norm over every stage. The settings (precision, device, the
``GradScaler``) are the plugin's own; nothing of the user's object is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["GlobalNormClipping", "with_global_norm_clipping"]

_SUBCLASSES: dict[type, type] = {}


class GlobalNormClipping:
    """A precision-plugin mixin: ``clip_grad_by_norm`` by the norm over every stage of the pipeline."""

    _clip_by_global_norm: Callable[[Optimizer, float], None]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Scale this rank's gradients so the pipeline's global gradient norm is at most ``clip_val``."""
        self._clip_by_global_norm(optimizer, float(clip_val))


def with_global_norm_clipping(plugin: Any, clip_by_global_norm: Callable[[Optimizer, float], None]) -> Any:
    """``plugin`` as an instance of ``GlobalNormClipping`` + its own class, with the same settings.

    Args:
        plugin: a Lightning precision plugin (``lightning.pytorch`` or ``pytorch_lightning``).
        clip_by_global_norm: ``(optimizer, clip_val)``: clips the pipeline's gradients by their global norm.

    Returns:
        A new plugin object of the subclass (``plugin`` itself if it already is one, given the new function).
    """
    if isinstance(plugin, GlobalNormClipping):
        plugin._clip_by_global_norm = clip_by_global_norm
        return plugin
    kind = type(plugin)
    subclass = _SUBCLASSES.get(kind)
    if subclass is None:
        subclass = _SUBCLASSES[kind] = type(f"Pipeline{kind.__name__}", (GlobalNormClipping, kind), {})
    copy: Any = object.__new__(subclass)
    copy.__dict__.update(plugin.__dict__)
    copy._clip_by_global_norm = clip_by_global_norm
    return copy
