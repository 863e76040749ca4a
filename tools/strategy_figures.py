"""The size of each strategy class and the longest function of ``lightning_balanced/strategies/``, at any revision.

    python tools/strategy_figures.py            # the working tree
    python tools/strategy_figures.py 2e26708    # a commit (read with `git show`, nothing checked out)

For each class of ``strategies/`` whose name ends in ``Strategy`` or that is a strategy's base-free implementation
(``BalancedDDP``, ``BalancedDataParallel``): its lines (the docstring included), methods, attributes assigned as
``self.<name>`` anywhere in its body, and its longest method. The figures of the "one house for five strategies"
issue; ``duplicates`` (run in ``lightning_balanced/``) gives the repeated code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "lightning_balanced/strategies"
#: Base-free implementations joined to a Lightning base in their module (the classes with the code).
IMPLEMENTATIONS = {"BalancedDDP", "BalancedDataParallel"}


def sources(revision: str | None) -> dict[str, str]:
    """The ``.py`` files of ``strategies/`` by name, from the working tree or from ``revision``."""
    if revision is None:
        return {path.name: path.read_text() for path in sorted((ROOT / FOLDER).glob("*.py"))}
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{revision}:{FOLDER}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return {
        name: subprocess.run(
            ["git", "show", f"{revision}:{FOLDER}/{name}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        for name in listing
        if name.endswith(".py")
    }


def span(node: ast.stmt) -> int:
    """Lines of a class or function, decorators left out."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def main(argv: list[str]) -> None:
    revision = argv[0] if argv else None
    longest = (0, "")
    for name, text in sources(revision).items():
        tree = ast.parse(text, name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Strategy") or node.name in IMPLEMENTATIONS):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                attributes = {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                }
                method = max(((span(m), m.name) for m in methods), default=(0, "-"))
                print(
                    f"{node.name:32s} lines={span(node):4d} methods={len(methods):3d} attributes={len(attributes):3d}"
                    f" longest={method[0]} ({method[1]})"
                )
        for found in ast.walk(tree):
            if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest = max(longest, (span(found), f"{name}:{found.name}"))
    print(f"longest function in {FOLDER}/: {longest[0]} lines ({longest[1]})")


if __name__ == "__main__":
    main(sys.argv[1:])
