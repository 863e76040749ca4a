"""Put the package's strategies in Lightning's ``StrategyRegistry`` so ``Trainer(strategy="<name>")`` finds them.

The package's strategies are this distribution's ``[project.entry-points."lightning.pytorch.strategies"]`` in
``pyproject.toml``, the one list of them (:func:`strategy_classes`). Each registers its names the way Lightning's own
strategies do, through its ``register_strategies(strategy_registry)`` classmethod: :class:`RegisteredStrategy`'s
registers ``strategy_name``; a class with several names writes its own, as Lightning's ``DDPStrategy`` does.
``import lightning_balanced`` calls :func:`register_strategies`, which also fills the standalone ``pytorch_lightning``
package's registry, when it is installed, with the variants of :func:`pytorch_lightning_variant`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import types
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_balanced.strategies.trainer_arguments import name_strategy_arguments

__all__ = [
    "DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "RegisteredStrategy",
    "StrategyNameConflict",
    "pytorch_lightning_variant",
    "register_strategies",
    "register_strategy",
    "register_variants",
    "strategy_classes",
]

#: The distribution whose entry points list the package's strategies.
DISTRIBUTION = "lightning-balanced"
#: The entry-point group of strategy classes, this package's and third parties'.
ENTRY_POINT_GROUP = "lightning.pytorch.strategies"


class StrategyNameConflict(ValueError):
    """A strategy registers a name that the registry already holds for something else."""


class RegisteredStrategy:
    """A base-free mixin giving a strategy class Lightning's ``register_strategies`` for its ``strategy_name``.

    The name is described by the first line of the class docstring. Base-free, so a ``lightning.pytorch`` class and
    its ``pytorch_lightning`` variant both have it.
    """

    #: The strategy's name (Lightning's convention).
    strategy_name: ClassVar[str]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``cls`` under ``strategy_name``.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        description = (cls.__doc__ or "").strip().partition("\n")[0]
        strategy_registry.register(cls.strategy_name, cls, description=description)


def register_variants(
    strategy: type, strategy_registry: _StrategyRegistry, variants: Iterable[tuple[str, str, dict[str, Any]]]
) -> None:
    """Register ``strategy`` under several names, each with preset arguments, as Lightning's ``DDPStrategy`` does.

    What a strategy's ``register_strategies`` calls when it has more than one name (``ddp_lr_linear``/``_sqrt`` and
    their launches, ``balanced_ddp_spawn``, ...).

    Args:
        strategy (type): the strategy class.
        strategy_registry (_StrategyRegistry): the registry to fill.
        variants: ``(name, description, init_params)`` for each name.
    """
    for name, description, init_params in variants:
        strategy_registry.register(name, strategy, description=description, **init_params)


def register_strategy(strategy: Any, registry: dict[str, Any]) -> list[str]:
    """Register the names of one ``Strategy`` class in ``registry``, idempotently.

    ``strategy.register_strategies`` fills an empty registry first; each of its names is then copied into ``registry``
    unless it is already there for the same class and arguments.

    Args:
        strategy (type): a ``Strategy`` class with the ``register_strategies(registry)`` classmethod.
        registry (dict[str, Any]): ``lightning.pytorch``'s or ``pytorch_lightning``'s ``StrategyRegistry``.

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
        if name not in registry:
            registry[name] = entry
            added.append(name)
            continue
        held = registry[name]
        if held["strategy"] is not entry["strategy"] or held["init_params"] != entry["init_params"]:
            conflicts.append(f"{name!r} (held by {held['strategy'].__qualname__})")
    if conflicts:
        raise StrategyNameConflict(
            f"{strategy.__qualname__} registers names already taken: {', '.join(conflicts)}; they were left as they are"
        )
    return added


def strategy_classes() -> tuple[type, ...]:
    """The package's strategies: the classes of this distribution's ``lightning.pytorch.strategies`` entry points.

    Read from the installed metadata at each call, in table order (an editable install sees a new entry once it is
    reinstalled). Without the metadata, a ``UserWarning`` and no strategies.

    Returns:
        tuple[type, ...]: the ``lightning.pytorch`` ``Strategy`` classes.

    Raises:
        TypeError: an entry does not name a ``lightning.pytorch`` ``Strategy`` class with the
            :class:`RegisteredStrategy` mixin.
    """
    try:
        entry_points = importlib.metadata.distribution(DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        warnings.warn(
            f"lightning_balanced is not installed ({DISTRIBUTION!r} has no distribution metadata), so its strategies,"
            " listed in its entry points, are not registered: install it (`pip install -e .` in a checkout)",
            UserWarning,
            stacklevel=2,
        )
        return ()
    classes = []
    for entry_point in entry_points.select(group=ENTRY_POINT_GROUP):
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


_VARIANTS: dict[type, type | None] = {}


def pytorch_lightning_variant(strategy: type) -> type | None:
    """The standalone ``pytorch_lightning`` package's class of one of our ``lightning.pytorch`` strategies.

    A strategy written as ``class XStrategy(X, LightningBase)``, ``X`` free of a Lightning base and the body a
    docstring only, has a variant: ``X`` joined to ``pytorch_lightning``'s class of the same name, with the same name
    and docstring, ``__module__`` :mod:`lightning_balanced.strategies.pytorch_lightning_compat` (so it pickles) and
    ``_lightning_package = "pytorch_lightning"`` where ``X`` has that attribute. Later calls return the same class.

    Args:
        strategy (type): a ``lightning.pytorch`` strategy class of the package.

    Returns:
        type | None: the variant; ``None`` when ``strategy`` is not such a join (``GPipeStrategy``).

    Raises:
        ModuleNotFoundError: ``pytorch_lightning`` is not installed.
    """
    if strategy in _VARIANTS:
        return _VARIANTS[strategy]
    variant = None
    own = {name for name in vars(strategy) if not name.startswith("__")} - {"_abc_impl"}
    if len(strategy.__bases__) == 2 and not own:
        implementation, base = strategy.__bases__
        if not issubclass(implementation, Strategy) and base.__module__.startswith("lightning.pytorch."):
            module = importlib.import_module("pytorch_lightning" + base.__module__.removeprefix("lightning.pytorch"))
            namespace = {
                "__doc__": strategy.__doc__,
                "__module__": f"{__package__}.pytorch_lightning_compat",
                "__qualname__": strategy.__name__,
            }
            if hasattr(implementation, "_lightning_package"):
                namespace["_lightning_package"] = "pytorch_lightning"
            variant = types.new_class(
                strategy.__name__,
                (implementation, getattr(module, base.__qualname__)),
                exec_body=lambda body: body.update(namespace),
            )
    _VARIANTS[strategy] = variant
    return variant


def register_strategies() -> list[str]:
    """Register every strategy of the package in ``lightning.pytorch``'s and ``pytorch_lightning``'s registries.

    ``pytorch_lightning``'s gets the variants (:func:`pytorch_lightning_variant`), when it is installed. Both packages'
    ``Trainer`` then name the strategy class when given one of its arguments (:func:`name_strategy_arguments`).
    Idempotent.

    Returns:
        list[str]: the names of this package's strategies now in ``lightning.pytorch``'s registry.
    """
    from lightning.pytorch import Trainer

    ours = strategy_classes()
    for strategy in ours:
        register_strategy(strategy, StrategyRegistry)
    name_strategy_arguments(Trainer, ours, StrategyRegistry)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning import Trainer as StandaloneTrainer
        from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry

        variants = [variant for variant in map(pytorch_lightning_variant, ours) if variant is not None]
        for variant in variants:
            register_strategy(variant, StandaloneRegistry)
        name_strategy_arguments(StandaloneTrainer, variants, StandaloneRegistry)
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"] in ours]
