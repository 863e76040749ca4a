"""Write a tiny installed distribution (a ``*.dist-info`` folder and its modules) for entry-point tests.

``importlib.metadata`` finds a distribution by its ``<name>-<version>.dist-info`` folder on ``sys.path``; the folder
needs only ``METADATA`` (name and version) and, for entry points, ``entry_points.txt``. Put the returned folder on
``sys.path`` with ``monkeypatch.syspath_prepend`` (which also invalidates the import caches). A distribution earlier
on ``sys.path`` shadows an installed one of the same name, entry points included.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["write_distribution"]


def write_distribution(
    root: Path, name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str] | None = None
) -> Path:
    """Write ``<name>-0.0.1.dist-info`` with ``entry_points`` (group -> {entry name: "module:attr"}) and ``modules``.

    Returns:
        Path: ``root``, the folder to put on ``sys.path``.
    """
    dist_info = root / f"{name.replace('-', '_')}-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    sections = []
    for group, entries in entry_points.items():
        lines = "\n".join(f"{entry} = {target}" for entry, target in entries.items())
        sections.append(f"[{group}]\n{lines}\n")
    (dist_info / "entry_points.txt").write_text("\n".join(sections))
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root
