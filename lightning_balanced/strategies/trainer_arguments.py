"""Name the strategy class when one of its arguments is given to the ``Trainer`` instead.

``Trainer(strategy="balanced_dp", chunk_sizes=[6, 10])`` fails inside Lightning's ``Trainer.__init__`` with Python's
"unexpected keyword argument", before any strategy code runs. :func:`name_strategy_arguments` wraps
``Trainer.__init__`` once so that this one error, for an argument of one of the package's strategies, becomes a
``TypeError`` that says which class takes it and how to pass it. Every other call and error goes through unchanged,
and the signature Lightning, jsonargparse and ``inspect`` see stays the ``Trainer``'s (``functools.wraps``).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["name_strategy_arguments"]

_UNEXPECTED = re.compile(r"__init__\(\) got an unexpected keyword argument '(?P<name>\w+)'$")
_WRAPPED = "_lightning_balanced_names_strategy_arguments"


def name_strategy_arguments(trainer: type, strategies: Iterable[type], registry: dict[str, Any]) -> None:
    """Make ``trainer(strategy=..., <argument of a strategy>=...)`` raise a ``TypeError`` naming the strategy class.

    Idempotent: a ``trainer`` already wrapped is left as it is.

    Args:
        trainer (type): ``lightning.pytorch.Trainer`` or ``pytorch_lightning.Trainer``.
        strategies (Iterable[type]): the strategy classes whose ``__init__`` arguments are recognised.
        registry (dict[str, Any]): the ``StrategyRegistry`` that resolves a ``strategy`` string for ``trainer``.
    """
    classes = tuple(strategies)
    init: Callable[..., None] = vars(trainer)["__init__"]
    if getattr(init, _WRAPPED, False):
        return
    own = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError as err:
            match = _UNEXPECTED.search(str(err))
            name = match["name"] if match and match["name"] not in own and match["name"] in kwargs else None
            message = _message(name, kwargs.get("strategy"), classes, registry) if name else None
            if message is None:
                raise
            raise TypeError(message) from None

    setattr(__init__, _WRAPPED, True)
    trainer.__init__ = __init__  # type: ignore[misc]


def _message(name: str, strategy: Any, classes: tuple[type, ...], registry: dict[str, Any]) -> str | None:
    takers = [cls for cls in classes if name in inspect.signature(cls.__init__).parameters]  # type: ignore[misc]
    entry = dict.get(registry, strategy) if isinstance(strategy, str) else None  # the registry's get() builds one
    if entry is not None and entry["strategy"] in takers:
        cls, init_params = entry["strategy"], entry["init_params"]
        arguments = "".join(f"{key}={value!r}, " for key, value in init_params.items())
        return (
            f"Trainer(strategy={strategy!r}) got `{name}`, an argument of the strategy, not of the Trainer: pass it to"
            f" the strategy's class, Trainer(strategy={cls.__name__}({arguments}{name}=...)), with"
            f" `{_import(cls)}`"
        )
    if not takers:
        return None
    names = " or ".join(cls.__name__ for cls in takers)
    return (
        f"Trainer got `{name}`, which is not an argument of the Trainer but of the strategy {names}: pass it to the"
        f" strategy's class, Trainer(strategy={takers[0].__name__}({name}=...)), with"
        f" `{_import(takers[0])}`"
    )


def _import(cls: type) -> str:
    # The package exports its lightning.pytorch strategies at the top, the pytorch_lightning variants in their module.
    module = cls.__module__ if cls.__module__.endswith(".pytorch_lightning_compat") else "lightning_balanced"
    return f"from {module} import {cls.__name__}"
