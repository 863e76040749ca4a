"""The ``lightning-balanced`` command: Lightning's CLI with the strategy plugins registered before parsing.

``lightning-balanced fit --config job.yaml`` (or ``python -m lightning_balanced ...``) is ``LightningCLI`` with any
``LightningModule`` and ``LightningDataModule`` given by ``class_path`` in the config, and every strategy of this
package and of the installed plugins (:mod:`lightning_balanced.entry_points`) available by name, e.g. ``strategy:
balanced_dp``, ``strategy: ddp_lr_sqrt`` or the ``class_path``/``init_args`` form.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_balanced.entry_points import load_strategy_plugins
from lightning_balanced.strategies.process_group import end_process_group
from lightning_balanced.strategies.trainer_arguments import init_parameters

__all__ = ["LightningBalancedCLI", "main"]


# Strategy arguments the Trainer fills in from its own (accelerator=, devices=, plugins=).
_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
_LIGHTNING = ("lightning.", "pytorch_lightning.")


def _strategy_help() -> str:
    names = sorted(StrategyRegistry)
    lines = [
        "A registered strategy name or a Strategy class (class_path and init_args).",
        f"Registered names: {', '.join(names)}.",
        "Arguments of the strategies registered from outside Lightning (--trainer.strategy.help CLASS shows more):",
    ]
    seen = set()
    for name in names:
        strategy = StrategyRegistry[name]["strategy"]
        if strategy in seen or strategy.__module__.startswith(_LIGHTNING):
            continue
        seen.add(strategy)
        parameters = init_parameters(strategy)
        # The Lightning base the arguments pass on to, named rather than listed (its own help shows them).
        base = next(c for c in strategy.__mro__ if c.__module__.startswith(_LIGHTNING) and "__init__" in vars(c))
        inherited = {p.name for p in init_parameters(base)}
        reached = inherited <= {p.name for p in parameters} and bool(inherited - _PLUMBING)
        own = [p for p in parameters if p.name not in _PLUMBING and p.name not in inherited]
        arguments = ", ".join(f"{p.name}={p.default!r}" for p in own if p.default is not p.empty)
        extra = f" and {base.__name__}'s arguments" if reached else ""
        lines.append(f"  {strategy.__module__}.{strategy.__qualname__}({arguments}){extra}")
    return "\n".join(lines)


# jsonargparse's words for an argument a class does not take: "Option 'x' is not accepted" (4.53), "No action for
# key "x" to check its value" (4.27).
_NOT_ACCEPTED = re.compile(
    r"class_path '(?P<path>[\w.]+)':\s*(?:Option '(?P<option>\w+)' is not accepted"
    r"|Validation failed: No action for key \"(?P<key>\w+)\")"
)


def _close_arguments(message: str) -> str:
    """``Did you mean ...?`` for an argument a class does not take, from the ``__init__`` arguments along its MRO."""
    found = _NOT_ACCEPTED.search(message)
    if found is None:
        return ""
    module_name, _, class_name = found["path"].rpartition(".")
    cls = getattr(sys.modules.get(module_name), class_name, None)
    if not isinstance(cls, type):
        return ""
    names = {
        name
        for klass in cls.__mro__
        if "__init__" in vars(klass)
        for name in inspect.signature(vars(klass)["__init__"]).parameters
        if name not in ("self", "args", "kwargs")
    }
    option = found["option"] or found["key"]
    close = difflib.get_close_matches(option, sorted(names), n=3, cutoff=0.6)
    if not close:
        return ""
    return f"\n{class_name} takes no {option!r}: did you mean {' or '.join(repr(c) for c in close)}?"


# jsonargparse's words for a class_path whose module does not import.
_NO_MODULE = re.compile(r"class_path '(?P<path>[\w.]+)':\s*No module named '(?P<module>[\w.]+)'")


def _import_hint(message: str, launch_dir: str) -> str:
    """Where a ``class_path`` is imported from, for one whose top-level module is not found.

    ``launch_dir`` is the directory the command ran in (jsonargparse parses a config from the config's own folder).
    """
    found = _NO_MODULE.search(message)
    if found is None or not found["path"].startswith(found["module"]):
        return ""
    top = found["module"].partition(".")[0]
    return (
        f"\n{found['path']!r} is imported from the directory the command ran in ({launch_dir}) and PYTHONPATH, not"
        f" from the config file's folder: run from the directory that holds the `{top}` package (for this repository's"
        " examples, the repository root), or add that directory to PYTHONPATH"
    )


def _concise_error(
    parser: LightningArgumentParser, message: str, ex: Exception | None = None, *, launch_dir: str = ""
) -> NoReturn:
    """A parser error as jsonargparse words it, without its usage block (50 lines for ``fit``).

    The message, a suggestion for a misspelt argument, and where the options are listed; with ``exit_on_error`` off
    or ``JSONARGPARSE_DEBUG`` set, jsonargparse's own behaviour.
    """
    if not parser.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
        LightningArgumentParser.error(parser, message, ex)
    prog = (getattr(ex, "subcommand_parser", None) or parser).prog.replace(" [options]", "")
    hints = _close_arguments(message) + _import_hint(message, launch_dir or os.getcwd())
    sys.stderr.write(f"error: {message}{hints}\ntip: `{prog} --help` lists every option\n")
    parser.exit(2)


class LightningBalancedCLI(LightningCLI):
    """``LightningCLI`` that loads the strategy plugins first and takes model and data by ``class_path``.

    Before the parser is built, :func:`~lightning_balanced.entry_points.load_strategy_plugins` registers the strategies
    of every installed plugin, so their names resolve in ``--trainer.strategy`` and in configs, and the working
    directory is appended to the import path (as ``python -m`` does), so a ``class_path`` can name a module of the
    project you run it from, e.g. ``examples.digits.DigitsClassifier`` from this repository's root.

    Args:
        model_class: the base of the accepted models; any ``LightningModule`` by default.
        datamodule_class: the base of the accepted datamodules; any ``LightningDataModule`` by default.
        subclass_mode_model: accept subclasses of ``model_class`` given by ``class_path`` (on by default).
        subclass_mode_data: accept subclasses of ``datamodule_class`` given by ``class_path`` (on by default).
        **kwargs: everything ``LightningCLI`` takes (``args``, ``seed_everything_default``, ``trainer_defaults``, ...).
    """

    def __init__(
        self,
        model_class: type[LightningModule] | None = None,
        datamodule_class: type[LightningDataModule] | None = None,
        *,
        subclass_mode_model: bool = True,
        subclass_mode_data: bool = True,
        **kwargs: Any,
    ) -> None:
        load_strategy_plugins()
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        super().__init__(
            model_class or LightningModule,
            datamodule_class or LightningDataModule,
            subclass_mode_model=subclass_mode_model,
            subclass_mode_data=subclass_mode_data,
            **kwargs,
        )

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's parser, whose errors leave out the usage block (see :func:`_concise_error`)."""
        parser = super().init_parser(**kwargs)
        parser.error = functools.partial(_concise_error, parser, launch_dir=os.getcwd())  # type: ignore[method-assign]
        return parser

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse an unknown strategy name in one line, with the closest registered names, before Lightning does."""
        trainer = self._get(self.config, "trainer")
        strategy = trainer.get("strategy") if trainer is not None else None
        if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
            close = difflib.get_close_matches(strategy, list(StrategyRegistry), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise SystemExit(
                f"lightning-balanced: error: unknown strategy {strategy!r}.{hint} Registered names:"
                f" {', '.join(sorted(StrategyRegistry))}."
            )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """List the registered strategy names and our strategies' arguments in ``--trainer.strategy``'s help."""
        for action in parser._actions:
            if action.dest == "trainer.strategy":
                action.help = _strategy_help()


def main(args: list[str] | None = None) -> None:
    """Run ``lightning-balanced`` on ``args`` (``sys.argv[1:]`` when ``None``).

    The console script calls ``sys.exit(main())``, so this returns ``None`` (exit status 0); errors propagate as
    exceptions or LightningCLI's own ``SystemExit``. Use :class:`LightningBalancedCLI` directly for the CLI object.
    """
    LightningBalancedCLI(args=args)
    # A DDP run leaves its default process group for interpreter exit, where torch's gloo backend sometimes aborts or
    # hangs the finished job; the command owns the process, so it ends the group while the interpreter is whole.
    end_process_group()
