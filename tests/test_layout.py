"""The package layout: layered imports without circles, and the 0.1 module paths still importable until 0.3."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
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
    for name in import_graph.modules():
        import_graph.unit(name)  # raises LookupError for a module placed in no layer


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


import lightning_balanced  # noqa: E402  (installs the finder of moved paths)
from lightning_balanced._moved_modules import MOVED, MOVED_NAMES, REMOVED_IN  # noqa: E402

# Old path -> a public name it held in 0.1, now the very object at the new path.
OLD_NAMES = {
    "lightning_balanced.parallel": ("plan_chunk_sizes", "lightning_balanced.data_parallel"),
    "lightning_balanced.parallel.scatter": ("scatter", "lightning_balanced.data_parallel.scatter"),
    "lightning_balanced.parallel.chunk_sizes": ("plan_chunk_sizes", "lightning_balanced.data_parallel.split_policy"),
    "lightning_balanced.parallel.sync_batchnorm": (
        "convert_replica_batchnorm",
        "lightning_balanced.data_parallel.replica_batchnorm",
    ),
    "lightning_balanced.plugins": ("load_strategy_plugins", "lightning_balanced.entry_points"),
    "lightning_balanced.lr_scale_check": ("callbacks", "lightning_balanced.callbacks"),
    "lightning_balanced.sync_batchnorm": ("SyncBatchNorm", "lightning_balanced.nn.sync_batchnorm"),
    "lightning_balanced.batchnorm_moments": ("combine_moments", "lightning_balanced.nn.moments"),
    "lightning_balanced.batchnorm_conversion": ("convert_batchnorm", "lightning_balanced.nn.conversion"),
    "lightning_balanced.store_all_gather": ("store_all_gather_object", "lightning_balanced.evaluation.store_gather"),
    "lightning_balanced.indexed_dataset": ("IndexedDataset", "lightning_balanced.evaluation.indexed_dataset"),
    "lightning_balanced.detection": ("coco_map", "lightning_balanced.evaluation"),
    "lightning_balanced.strategies.ddp": ("LRScaledDDPStrategy", "lightning_balanced.strategies.ddp_lr"),
    "lightning_balanced.strategies.standalone": (
        "BalancedDataParallelStrategy",
        "lightning_balanced.strategies.pytorch_lightning_compat",
    ),
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_module_path_warns_and_gives_the_same_objects(old):
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[name]
    attribute, new = OLD_NAMES[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(old)  # an import statement's own call: the warning must name this line, not importlib
    module = sys.modules[old]
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    expected = f"`{old}` moved to `{new}`; the old path works until lightning_balanced {REMOVED_IN}"
    assert expected in messages
    assert [w.filename for w in caught if str(w.message) == expected] == [__file__]  # names the importing line
    assert getattr(module, attribute) is getattr(importlib.import_module(new), attribute)


@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_an_old_name_warns_and_gives_the_same_object(old):
    module_name, _, name = old.rpartition(".")
    new_module, _, new_name = MOVED_NAMES[old].rpartition(".")
    module = importlib.import_module(module_name)
    assert name not in vars(module)  # only reachable through the module's __getattr__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    expected = f"`{old}` moved to `{MOVED_NAMES[old]}`; the old path works until lightning_balanced {REMOVED_IN}"
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [expected]
    assert [w.filename for w in caught] == [__file__]
    assert value is getattr(importlib.import_module(new_module), new_name)
    with pytest.raises(AttributeError, match=rf"^module '{module_name}' has no attribute 'no_such_name'$"):
        module.no_such_name  # noqa: B018


def test_every_moved_path_is_tested():
    assert set(MOVED) - {"lightning_balanced.strategies.replica_hooks"} <= set(OLD_NAMES)


def test_a_path_that_never_existed_still_fails():
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'lightning_balanced\.parallel\.nothing'$"):
        importlib.import_module("lightning_balanced.parallel.nothing")
    assert lightning_balanced.__name__ == "lightning_balanced"
