"""Swapping the BatchNorm layers of a module tree for stand-ins, and back.

Every BatchNorm stand-in of the package enters a user's model this way:
:meth:`~lightning_balanced.nn.sync_batchnorm.SyncBatchNorm.convert_sync_batchnorm` / ``revert_sync_batchnorm`` (the
ranks of a process group), :func:`~lightning_balanced.data_parallel.replica_batchnorm.convert_replica_batchnorm` /
``revert_replica_batchnorm`` (the replicas of one balanced_dp step), the DDP strategies' layer-sync plugin
(:class:`~lightning_balanced.nn.layer_sync.DeviceSyncBatchNorm`) and the pipeline's
:meth:`~lightning_balanced.pipeline.DeferredBatchNorm.convert_deferred_batch_norm` / ``revert_deferred_batch_norm``
(the micro-batches of one mini-batch). This module holds what they share: the walk that swaps a module in its parent,
which layers are converted, a stand-in that shares the user's layer's parameters, buffers and training flag (and, if
asked, its forward hooks), and the state carried back when the user's layer returns. They differ only in which layers
they take, in how the stand-in is built and in what gives the user's layer back (the very object, or a new one of its
class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = ["convert_batchnorm", "revert_batchnorm", "swap_modules"]

# Hyperparameters that live on the layer (and may be changed on the stand-in while converted), carried back on revert.
_HYPERPARAMETERS = ("num_features", "eps", "momentum", "affine", "track_running_stats")
# The hook dicts of ``Module.__call__``'s forward pass, shared with the stand-in with ``carry_hooks=True``.
_FORWARD_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)

StandInT = TypeVar("StandInT", bound=_BatchNorm)


def swap_modules(module: Module, swap: Callable[[Module], Module | None]) -> Module:
    """Replace every module of ``module``'s tree for which ``swap`` returns a replacement, depth first.

    A replaced module's children move to its replacement (each swapped in turn); a kept module's children are swapped in
    place, in its own ``_modules``. As in :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`, a module registered
    twice under one parent is visited once (``named_children``).

    Args:
        module (Module): the root of the tree.
        swap (Callable[[Module], Module | None]): the replacement of a module, or ``None`` to keep it.

    Returns:
        Module: ``module``'s replacement, or ``module`` itself with its subtree swapped in place.
    """
    replacement = swap(module)
    output = module if replacement is None else replacement
    for name, child in list(module.named_children()):
        output._modules[name] = swap_modules(child, swap)
    return output


def convert_batchnorm(
    module: Module,
    build: Callable[[_BatchNorm], StandInT],
    stand_in_type: type[StandInT],
    *,
    convertible: Callable[[_BatchNorm], bool] | None = None,
    carry_hooks: bool = False,
) -> Module:
    """Replace every ``_BatchNorm`` layer of ``module`` that is not a ``stand_in_type`` by ``build(layer)``.

    ``build`` makes the stand-in (on the ``meta`` device: its own parameters and buffers are dropped) and records what
    its revert needs. The stand-in then takes the layer's parameter and buffer dicts (the same ``Parameter`` and tensor
    objects, so ``requires_grad``, optimizer references and a subclass's extra parameters or buffers carry over, and the
    state-dict keys stay the layer's), its non-persistent buffer names and its training flag.

    Args:
        module (Module): a model, or a single BatchNorm layer.
        build (Callable[[_BatchNorm], _BatchNorm]): the stand-in for one layer.
        stand_in_type (type): layers of this type are already converted and left as they are.
        convertible (Callable[[_BatchNorm], bool], optional): which of the other ``_BatchNorm`` layers are converted;
            default all of them.
        carry_hooks (bool): the stand-in also shares the layer's forward (pre-)hook dicts (the same dict objects), so
            the hooks registered on the layer run while it is converted. Default: ``False``.

    Returns:
        Module: ``module`` with its BatchNorm layers replaced in place, or the stand-in if ``module`` is one.

    Raises:
        ValueError: a lazy BatchNorm layer that has not been initialized yet (run one forward pass first).
    """

    def swap(layer: Module) -> Module | None:
        if not isinstance(layer, _BatchNorm) or isinstance(layer, stand_in_type):
            return None
        if convertible is not None and not convertible(layer):
            return None
        if isinstance(layer, LazyModuleMixin) and layer.has_uninitialized_params():
            raise ValueError(
                f"cannot convert the uninitialized lazy module {type(layer).__name__}; run a forward pass first"
            )
        stand_in = build(layer)
        stand_in._parameters = dict(layer._parameters)
        stand_in._buffers = dict(layer._buffers)
        stand_in._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
        stand_in.training = layer.training
        if carry_hooks:
            _share_forward_hooks(layer, stand_in)
        return stand_in

    return swap_modules(module, swap)


def revert_batchnorm(
    module: Module, original: Callable[[Module], _BatchNorm | None], *, carry_hooks: bool = False
) -> Module:
    """Undo :func:`convert_batchnorm`: put ``original(stand_in)`` in place of every stand-in that has one.

    The original layer gets the stand-in's current parameters and buffers (whatever training, ``.to()`` or loading a
    checkpoint made of them), its hyperparameters (``num_features``, ``eps``, ``momentum``, ``affine``,
    ``track_running_stats``) and its training flag.

    Args:
        module (Module): a converted model, or a single stand-in.
        original (Callable[[Module], _BatchNorm | None]): the layer to put back for a module, ``None`` for a module that
            is not a stand-in (or has nothing to revert to).
        carry_hooks (bool): the original layer also takes the stand-in's forward (pre-)hook dicts (for a layer
            converted with ``carry_hooks=True`` they are its own already; a new layer gets the stand-in's hooks).
            Default: ``False``.

    Returns:
        Module: ``module`` with its stand-ins reverted in place, or the original layer if ``module`` is a stand-in.
    """

    def swap(stand_in: Module) -> Module | None:
        layer = original(stand_in)
        if layer is None:
            return None
        layer._parameters.update(stand_in._parameters)
        layer._buffers.update(stand_in._buffers)
        for name in _HYPERPARAMETERS:
            setattr(layer, name, getattr(stand_in, name))
        layer.training = stand_in.training
        if carry_hooks:
            _share_forward_hooks(stand_in, layer)
        return layer

    return swap_modules(module, swap)


def _share_forward_hooks(source: Module, target: Module) -> None:
    """``target`` takes ``source``'s forward hook dicts, the same objects (hooks registered later reach both)."""
    for name in _FORWARD_HOOKS:
        if hasattr(source, name):  # older torch versions lack some of them
            setattr(target, name, getattr(source, name))
