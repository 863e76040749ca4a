"""Put this package's strategies in Lightning's ``StrategyRegistry`` so ``Trainer(strategy="<name>")`` finds them.

**One table.** The package's strategies are the entries of this distribution under
``[project.entry-points."lightning.pytorch.strategies"]`` in ``pyproject.toml`` (read from the installed metadata by
:func:`strategy_classes`); nothing else lists them. A new strategy is one module holding a ``Strategy`` class with the
:class:`RegisteredStrategy` mixin, plus one line in that table::

    # pyproject.toml
    [project.entry-points."lightning.pytorch.strategies"]
    my_dp = "lightning_balanced.strategies.my_dp:MyDataParallelStrategy"

**One method.** Lightning fills its registry only from its own modules; other packages' strategies register
themselves through the ``register_strategies(registry)`` classmethod of each ``Strategy`` class. Ours is
:meth:`RegisteredStrategy.register_strategies`, written once; a class declares only its names: ``strategy_name``
(registered alone, described by the first line of the class docstring) or ``registry_names`` (several names, each
with a description and preset arguments, like ``ddp_lr_sqrt``).

``import lightning_balanced`` calls :func:`register_strategies` once. The unified ``lightning`` package
(``lightning.pytorch``) and the standalone ``pytorch_lightning`` package keep separate registries and separate base
classes: the second gets, under the same names, the class that :func:`pytorch_lightning_variant` derives from each
of ours (:mod:`lightning_balanced.strategies.pytorch_lightning_compat` exposes them). Third-party strategies join
through the same entry-point group: see :mod:`lightning_balanced.entry_points`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import Strategy, StrategyRegistry

__all__ = [
    "DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "STRATEGIES",
    "RegisteredStrategy",
    "RegistryName",
    "StrategyNameConflict",
    "pytorch_lightning_variant",
    "register_strategies",
    "register_strategy",
    "strategy_classes",
]

#: The distribution whose entry points list the package's strategies.
DISTRIBUTION = "lightning-balanced"
#: The entry-point group of strategy classes, this package's and third parties'.
ENTRY_POINT_GROUP = "lightning.pytorch.strategies"
#: Where the ``pytorch_lightning`` variants live (their ``__module__``, so they pickle by reference).
COMPAT_MODULE = "lightning_balanced.strategies.pytorch_lightning_compat"

#: The package's strategies, as ``lightning.pytorch`` classes in table order (:func:`strategy_classes`, read at each
#: access; derived from the table, not a list to edit).
STRATEGIES: tuple[type, ...]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        return strategy_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StrategyNameConflict(ValueError):
    """A strategy registers a name that the registry already holds for something else."""


@dataclass(frozen=True)
class RegistryName:
    """One name a strategy class takes in a ``StrategyRegistry``.

    Args:
        name: the name, as given to ``Trainer(strategy=...)``.
        description: what the registry shows for it; ``None`` = the first line of the class docstring.
        init_params: the arguments the class is built with under this name.
    """

    name: str
    description: str | None = None
    init_params: Mapping[str, Any] = field(default_factory=dict)


class RegisteredStrategy:
    """Lightning's ``register_strategies`` classmethod, once for every strategy of the package.

    A base-free mixin (``SingleProcess`` and ``LRScaledDDP`` inherit it), so the ``lightning.pytorch`` class and its
    ``pytorch_lightning`` variant both have it, each registering itself. A class declares its names only:

    - ``strategy_name``: registered alone, without preset arguments, described by the first line of the class
      docstring (``balanced_dp``, ``gpipe``);
    - ``registry_names``: when set, the names registered instead, each a :class:`RegistryName` with its description
      and preset arguments (``ddp_lr_linear``, ``ddp_spawn_lr_sqrt``, ...).
    """

    #: The strategy's name (Lightning's convention); also used in messages.
    strategy_name: ClassVar[str]
    #: The names to register, if not ``strategy_name`` alone.
    registry_names: ClassVar[tuple[RegistryName, ...]] = ()

    @classmethod
    def registered_names(cls) -> tuple[RegistryName, ...]:
        """The names :meth:`register_strategies` gives ``cls``, descriptions filled in."""
        first_line = cls.__doc__.strip().splitlines()[0] if cls.__doc__ and cls.__doc__.strip() else ""
        names = cls.registry_names or (RegistryName(cls.strategy_name),)
        return tuple(
            RegistryName(n.name, first_line if n.description is None else n.description, dict(n.init_params))
            for n in names
        )

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register each of :meth:`registered_names` for ``cls``; a name already in the registry is left as it is."""
        for entry in cls.registered_names():
            if entry.name not in strategy_registry:
                strategy_registry.register(entry.name, cls, description=entry.description, **entry.init_params)


def _same_entry(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["strategy"] is b["strategy"] and a["init_params"] == b["init_params"]


def register_strategy(strategy: Any, registry: _StrategyRegistry) -> list[str]:
    """Register the names of one ``Strategy`` class in ``registry``, idempotently.

    ``strategy.register_strategies`` runs on an empty registry of the same type first; then each name it registered is
    copied into ``registry``. A name already there with the same class and arguments is skipped, so calling this
    again, or for a class whose ``register_strategies`` does not guard against double registration, adds nothing.

    Args:
        strategy (type): a ``Strategy`` class with the ``register_strategies(registry)`` classmethod.
        registry (_StrategyRegistry): ``lightning.pytorch``'s or ``pytorch_lightning``'s ``StrategyRegistry``.

    Returns:
        list[str]: the names added to ``registry`` by this call.

    Raises:
        TypeError: ``strategy`` has no ``register_strategies`` classmethod.
        StrategyNameConflict: a name is already registered for another class or other arguments (the names that do
            not conflict are registered all the same).
    """
    register = getattr(strategy, "register_strategies", None)
    if not isinstance(strategy, type) or not callable(register):
        raise TypeError(
            f"`strategy` must be a Strategy class with a `register_strategies` classmethod, got {strategy!r}"
        )
    scratch = type(registry)()
    register(scratch)
    added, conflicts = [], []
    for name, entry in scratch.items():
        if name in registry:
            if not _same_entry(registry[name], entry):
                conflicts.append(f"{name!r} (held by {registry[name]['strategy'].__qualname__})")
            continue
        registry.register(name, entry["strategy"], description=entry["description"], **entry["init_params"])
        added.append(name)
    if conflicts:
        raise StrategyNameConflict(
            f"{strategy.__qualname__} registers names already taken: {', '.join(conflicts)}; they were left as they are"
        )
    return added


def strategy_classes() -> tuple[type, ...]:
    """The package's strategies: the classes of this distribution's ``lightning.pytorch.strategies`` entry points.

    Read from the installed metadata at each call, in the order of ``pyproject.toml``; an editable install sees a new
    entry after it is reinstalled (``pip install -e .``). Without the metadata (the package imported from a folder it
    was not installed from) no strategy is registered, with a ``UserWarning`` saying so.

    Returns:
        tuple[type, ...]: the ``lightning.pytorch`` ``Strategy`` classes.

    Raises:
        TypeError: an entry does not name a ``lightning.pytorch`` ``Strategy`` class with the
            :class:`RegisteredStrategy` mixin (the table is wrong).
    """
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        warnings.warn(
            f"lightning_balanced is not installed ({DISTRIBUTION!r} has no distribution metadata), so its strategies,"
            " listed in its entry points, are not registered: install it (`pip install -e .` in a checkout)",
            UserWarning,
            stacklevel=2,
        )
        return ()
    classes = []
    for entry_point in distribution.entry_points:
        if entry_point.group != ENTRY_POINT_GROUP:
            continue
        strategy = entry_point.load()
        if not (
            isinstance(strategy, type) and issubclass(strategy, Strategy) and issubclass(strategy, RegisteredStrategy)
        ):
            raise TypeError(
                f"entry point {entry_point.name!r} ({entry_point.value}) of {DISTRIBUTION} must name a"
                f" lightning.pytorch Strategy class with the RegisteredStrategy mixin, got {strategy!r}"
            )
        classes.append(strategy)
    return tuple(classes)


# ---- the standalone pytorch_lightning package's variants
# What a pure join (`class XStrategy(X, LightningBase)` with a docstring only) holds in its own namespace.
_JOIN_ATTRIBUTES = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__firstlineno__",
        "__static_attributes__",
        "__abstractmethods__",
        "_abc_impl",
        "__annotations__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__dict__",
        "__weakref__",
    }
)
_VARIANTS: dict[type, type | None] = {}


def _implementation_and_base(strategy: type) -> tuple[type, type] | None:
    if len(strategy.__bases__) != 2 or set(vars(strategy)) - _JOIN_ATTRIBUTES:
        return None
    implementation, base = strategy.__bases__
    if issubclass(implementation, Strategy) or not base.__module__.startswith("lightning.pytorch."):
        return None
    return implementation, base


def pytorch_lightning_variant(strategy: type) -> type | None:
    """The standalone ``pytorch_lightning`` package's class of one of our ``lightning.pytorch`` strategies.

    ``pytorch_lightning`` is a copy of ``lightning.pytorch`` with its own classes: its ``Trainer`` accepts only
    strategies built on its own bases. A strategy written as a base-free implementation joined to a Lightning base,
    ``class XStrategy(X, ParallelStrategy)`` with a docstring and nothing else in its body, has a variant: ``X`` joined
    to ``pytorch_lightning``'s class of the same name (``pytorch_lightning.strategies.ParallelStrategy``), with the same
    name and docstring, ``__module__`` :mod:`lightning_balanced.strategies.pytorch_lightning_compat` and
    ``_lightning_package = "pytorch_lightning"`` where the implementation reads it. One class per strategy: later calls
    return the same object. A strategy whose class holds its own code (``GPipeStrategy``) has none.

    Args:
        strategy (type): a ``lightning.pytorch`` strategy class of the package.

    Returns:
        type | None: the variant; ``None`` when ``strategy`` is not such a join.

    Raises:
        ModuleNotFoundError: ``pytorch_lightning`` is not installed.
    """
    if strategy in _VARIANTS:
        return _VARIANTS[strategy]
    parts = _implementation_and_base(strategy)
    variant = None
    if parts is not None:
        implementation, base = parts
        module = importlib.import_module("pytorch_lightning" + base.__module__.removeprefix("lightning.pytorch"))
        standalone_base = getattr(module, base.__qualname__)
        namespace: dict[str, Any] = {
            "__doc__": strategy.__doc__,
            "__module__": COMPAT_MODULE,
            "__qualname__": strategy.__name__,  # found by that name in the module, so it pickles
        }
        if hasattr(implementation, "_lightning_package"):
            namespace["_lightning_package"] = "pytorch_lightning"
        variant = types.new_class(
            strategy.__name__, (implementation, standalone_base), exec_body=lambda body: body.update(namespace)
        )
    _VARIANTS[strategy] = variant
    return variant


def _registries() -> list[tuple[Any, tuple[type, ...]]]:
    ours = strategy_classes()
    registries: list[tuple[Any, tuple[type, ...]]] = [(StrategyRegistry, ours)]
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry

        variants = tuple(v for v in map(pytorch_lightning_variant, ours) if v is not None)
        registries.append((StandaloneRegistry, variants))
    return registries


def register_strategies() -> list[str]:
    """Register every strategy of the package in each installed Lightning registry; idempotent.

    Returns:
        list[str]: the names of this package's strategies now in ``lightning.pytorch``'s registry.
    """
    registries = _registries()
    for registry, strategies in registries:
        for strategy in strategies:
            register_strategy(strategy, registry)
    ours = registries[0][1]
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"] in ours]
