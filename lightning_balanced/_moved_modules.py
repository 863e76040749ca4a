"""The module paths of release 0.1 that moved in the 0.2 layout, kept importable (with a warning) until 0.3.

Every moved public module is one row of :data:`MOVED`. ``import lightning_balanced`` puts :class:`MovedModuleFinder`
at the end of ``sys.meta_path``; importing an old path then gives a module that forwards every attribute to the new
module (the same functions and classes, so ``isinstance`` and identity checks hold) and warns once with a
``DeprecationWarning`` naming the new path. A moved package also maps its submodules (``parallel.scatter`` →
``data_parallel.scatter``) unless a row says otherwise.

A public name that moved out of a module that is still there is one row of :data:`MOVED_NAMES`: the old module's
``__getattr__`` gives the object at the new path and warns, every time, with a ``DeprecationWarning`` naming it. This
module sits above the rest of the package, so the modules that lost a name need not import it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "MOVED_NAMES", "REMOVED_IN", "MovedModuleFinder", "install"]

REMOVED_IN = "0.3"

#: Old module path -> new module path.
MOVED: dict[str, str] = {
    "lightning_balanced.parallel": "lightning_balanced.data_parallel",
    "lightning_balanced.parallel.chunk_sizes": "lightning_balanced.data_parallel.split_policy",
    "lightning_balanced.parallel.sync_batchnorm": "lightning_balanced.data_parallel.replica_batchnorm",
    "lightning_balanced.plugins": "lightning_balanced.entry_points",
    "lightning_balanced.lr_scale_check": "lightning_balanced.callbacks",
    "lightning_balanced.sync_batchnorm": "lightning_balanced.nn.sync_batchnorm",
    "lightning_balanced.batchnorm_moments": "lightning_balanced.nn.moments",
    "lightning_balanced.batchnorm_conversion": "lightning_balanced.nn.conversion",
    "lightning_balanced.store_all_gather": "lightning_balanced.evaluation.store_gather",
    "lightning_balanced.indexed_dataset": "lightning_balanced.evaluation.indexed_dataset",
    "lightning_balanced.detection": "lightning_balanced.evaluation",
    "lightning_balanced.strategies.ddp": "lightning_balanced.strategies.ddp_lr",
    "lightning_balanced.strategies.replica_hooks": "lightning_balanced.data_parallel.replica_context",
    "lightning_balanced.strategies.standalone": "lightning_balanced.strategies.pytorch_lightning_compat",
}


#: Old ``module.name`` -> new ``module.name``, for names that moved out of a module that still exists.
MOVED_NAMES: dict[str, str] = {
    "lightning_balanced.strategies.ddp_lr.DeviceSyncBatchNorm": "lightning_balanced.nn.layer_sync.DeviceSyncBatchNorm",
}


def new_path(old: str) -> str | None:
    """The module that now holds ``old``, or ``None`` if ``old`` did not move."""
    if old in MOVED:
        return MOVED[old]
    package, _, child = old.rpartition(".")
    if package in MOVED and importlib.util.find_spec(MOVED[package]) is not None:
        target = f"{MOVED[package]}.{child}"
        return target if importlib.util.find_spec(target) is not None else None
    return None


class _ForwardingLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"`{module.__name__}` moved to `{self.target}`; the old path works until lightning_balanced {REMOVED_IN}",
            DeprecationWarning,
            stacklevel=2,  # importlib's own frames are skipped: this names the importing line
        )
        target = importlib.import_module(self.target)

        def forward(name: str) -> Any:
            return getattr(target, name)

        module.__getattr__ = forward  # type: ignore[method-assign]
        module.__all__ = list(getattr(target, "__all__", ()))  # type: ignore[attr-defined]
        module.__doc__ = target.__doc__


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (and of their submodules) and forwards them to the new modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec whose loader forwards ``fullname`` to its new module; ``None`` for a path that did not move."""
        if not fullname.startswith("lightning_balanced."):
            return None
        new = new_path(fullname)
        if new is None:
            return None
        new_spec = importlib.util.find_spec(new)
        is_package = new_spec is not None and new_spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _ForwardingLoader(new), is_package=is_package)


def install() -> None:
    """Append :class:`MovedModuleFinder` to ``sys.meta_path`` once (after the real finders: real modules win).

    Also gives each module that lost a name of :data:`MOVED_NAMES` a ``__getattr__`` that forwards it.
    """
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
    moved: dict[str, dict[str, str]] = {}
    for old, new in MOVED_NAMES.items():
        module_name, _, name = old.rpartition(".")
        moved.setdefault(module_name, {})[name] = new
    for module_name, names in moved.items():
        module = importlib.import_module(module_name)
        if not isinstance(module.__dict__.get("__getattr__"), _NameForwarder):
            module.__getattr__ = _NameForwarder(module_name, names)  # type: ignore[method-assign]


class _NameForwarder:
    """A module's ``__getattr__`` for the names that moved out of it: the object at the new path, and a warning."""

    def __init__(self, module_name: str, names: dict[str, str]) -> None:
        self.module_name = module_name
        self.names = names

    def __call__(self, name: str) -> Any:
        if name not in self.names:
            raise AttributeError(f"module {self.module_name!r} has no attribute {name!r}")
        new = self.names[name]
        warnings.warn(
            f"`{self.module_name}.{name}` moved to `{new}`; the old path works until lightning_balanced {REMOVED_IN}",
            DeprecationWarning,
            stacklevel=2,  # names the line that reads the attribute (or imports it)
        )
        new_module, _, new_name = new.rpartition(".")
        return getattr(importlib.import_module(new_module), new_name)
