"""Name the strategy class when one of its arguments is given to the ``Trainer`` instead.

``Trainer(strategy="balanced_dp", chunk_sizes=[6, 10])`` fails inside Lightning's ``Trainer.__init__`` with Python's
"unexpected keyword argument", before any strategy code runs. :func:`name_strategy_arguments` wraps
``Trainer.__init__`` once so that this one error, for an argument of one of the package's strategies, becomes a
``TypeError`` that says which class takes it and how to pass it. Every other call and error goes through unchanged,
and the signature Lightning, jsonargparse and ``inspect`` see stays the ``Trainer``'s (``functools.wraps``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["init_parameters", "name_strategy_arguments"]

_UNEXPECTED = re.compile(r"__init__\(\) got an unexpected keyword argument '(?P<name>\w+)'$")
_WRAPPED = "_lightning_balanced_names_strategy_arguments"


def init_parameters(cls: type) -> list[inspect.Parameter]:
    """The arguments ``cls(...)`` takes by name: its ``__init__``'s and those its ``**kwargs`` pass on, in call order.

    Follows a cooperative chain as LightningCLI (jsonargparse) does: each ``__init__`` along ``cls.__mro__`` that takes
    ``**kwargs`` hands them to the next class's ``__init__`` (a mixin's, such as
    :class:`~lightning_balanced.split_policies.split_policy.SplitOptions`, then the Lightning base's); the walk stops at
    the first ``__init__`` without ``**kwargs``. An ``__init__`` that also passes ``*args`` on lists the next classes'
    arguments before its own (they take the positions). A name an ``__init__`` sets itself in its
    ``super().__init__(...)`` call is not the caller's (``LRScaledPipelineStrategy`` fixes ``sync_batchnorm=False``).
    Each name once; ``self``, ``*args`` and ``**kwargs`` left out.

    Args:
        cls (type): a strategy class.
    """
    inits = [vars(klass)["__init__"] for klass in cls.__mro__ if "__init__" in vars(klass) and klass is not object]
    found: dict[str, inspect.Parameter] = {}
    for parameter in _chain(inits, set()):
        found.setdefault(parameter.name, parameter)
    return list(found.values())


def _chain(inits: list[Callable[..., Any]], fixed: set[str]) -> list[inspect.Parameter]:
    if not inits:
        return []
    parameters = list(inspect.signature(inits[0]).parameters.values())[1:]
    kinds = {parameter.kind for parameter in parameters}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    own = [parameter for parameter in parameters if parameter.kind not in variadic and parameter.name not in fixed]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        return own
    rest = _chain(inits[1:], fixed | _set_in_super_call(inits[0]))
    return [*rest, *own] if inspect.Parameter.VAR_POSITIONAL in kinds else [*own, *rest]


def _set_in_super_call(init: Callable[..., Any]) -> set[str]:
    """The keyword arguments ``init`` passes by name in its ``super().__init__(...)`` call (none without source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        keyword.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
        for keyword in node.keywords
        if keyword.arg is not None
    }


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
    takers = [cls for cls in classes if name in {parameter.name for parameter in init_parameters(cls)}]
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
