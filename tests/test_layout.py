"""The package layout: layered imports without circles."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


import_graph = _load_tool()


def test_every_module_is_in_a_layer():
    placed = {name: import_graph.unit(name) for name in import_graph.modules()}  # LookupError: placed in no layer
    for name, (layer, unit) in placed.items():  # each in the unit of its longest prefix, at that unit's layer
        assert unit in import_graph.LAYERS[layer] and (name == unit or name.startswith(unit + ".")), name
    assert placed["lightning_balanced.rank_shares.engine"][1] == "lightning_balanced.rank_shares"


def test_no_import_goes_up_a_layer_or_sideways():
    assert import_graph.upward_imports(import_graph.graph()) == []


def test_no_import_circle():
    assert import_graph.circles(import_graph.graph()) == []


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    package = tmp_path / "lightning_balanced"
    for path, text in {
        "__init__.py": "",
        "ops/__init__.py": "from lightning_balanced.strategies import thing\n",  # ops -> strategies: upward
        "strategies/__init__.py": "thing = 1\n",
        "strategies/a.py": "def f():\n    from lightning_balanced.strategies import b\n",  # hidden in a function
        "strategies/b.py": "import lightning_balanced.strategies.a\n",
    }.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    edges = import_graph.graph(tmp_path)
    assert import_graph.upward_imports(edges) == ["lightning_balanced.ops -> lightning_balanced.strategies"]
    assert import_graph.circles(edges) == [["lightning_balanced.strategies.a", "lightning_balanced.strategies.b"]]


def test_a_module_in_no_layer_is_named(tmp_path):
    with pytest.raises(LookupError, match=r"^module lightning_balanced\.misc is in no layer of tools/import_graph\.py"):
        import_graph.unit("lightning_balanced.misc")
