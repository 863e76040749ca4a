"""The package's import graph: its layers, checked, and printed folder by folder.

    python tools/import_graph.py          # the graph between folders; exit status 1 on a circle or an upward import

Every import statement of ``lightning_balanced`` counts, at module level or inside a function (a function-local import
must not hide a circle either). A module imports from its own unit or from a unit of a lower layer, never from a
higher layer or a sibling of its own layer; and no chain of imports leads from a module back to itself.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_balanced"

#: From the top down. A module belongs to the longest unit that is a prefix of its name (the package's own name holds
#: only its ``__init__``: a new top-level module must be placed here deliberately).
LAYERS: list[list[str]] = [
    ["lightning_balanced", "lightning_balanced.__main__"],
    ["lightning_balanced.cli"],
    ["lightning_balanced.entry_points"],
    ["lightning_balanced.strategies"],
    ["lightning_balanced.batch_scaling"],
    ["lightning_balanced.rank_shares"],
    ["lightning_balanced.gpipe", "lightning_balanced.pipelining"],
    ["lightning_balanced.pipeline"],
    ["lightning_balanced.data_parallel"],
    ["lightning_balanced.nn", "lightning_balanced.evaluation", "lightning_balanced.split_policies"],
    ["lightning_balanced.ops", "lightning_balanced.arguments", "lightning_balanced.ranks", "lightning_balanced.timing"],
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports; ``from a import b`` counts ``a.b`` if it is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from a import b` relies on module a.b if there is one, else on a's namespace (its __init__)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` executes a, a.b and a.b.c; keep the deepest module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def unit(name: str) -> tuple[int, str]:
    """The layer (0 = top) and the unit of module ``name``; raises ``LookupError`` for a module no layer holds."""
    best: tuple[int, str] | None = None
    for layer, units in enumerate(LAYERS):
        for candidate in units:
            inside = name == candidate or (candidate != PACKAGE and name.startswith(candidate + "."))
            if inside and (best is None or len(candidate) > len(best[1])):
                best = (layer, candidate)
    if best is None:
        raise LookupError(f"module {name} is in no layer of tools/import_graph.py: add it to LAYERS")
    return best


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import into a higher layer or a sibling unit of the same layer, as ``"a -> b"``."""
    bad = []
    for name, targets in sorted(edges.items()):
        layer, own = unit(name)
        for target in sorted(targets):
            target_layer, target_unit = unit(target)
            if target_unit != own and target_layer <= layer:
                bad.append(f"{name} -> {target}")
    return bad


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def unit_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between units (folders and top-level modules)."""
    between: dict[str, set[str]] = defaultdict(set)
    for name, targets in edges.items():
        for target in targets:
            if unit(target)[1] != unit(name)[1]:
                between[unit(name)[1]].add(unit(target)[1])
    return between


def main() -> int:
    edges = graph()
    for source, targets in sorted(unit_edges(edges).items(), key=lambda item: unit(item[0])):
        short = sorted(target.removeprefix(PACKAGE + ".") for target in targets)
        print(f"{source.removeprefix(PACKAGE + '.') or PACKAGE} -> {', '.join(short)}")
    problems = [f"upward import: {edge}" for edge in upward_imports(edges)]
    problems += [f"circle: {' <-> '.join(component)}" for component in circles(edges)]
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports between them", flush=True)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
