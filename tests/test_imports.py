"""The import boundaries: the layers of scripts/import_graph.py (no circle, no upward or sideways
import, kernels at the bottom), the picture of them in docs/architecture.md, the engine never
importing Prefect, and flows/ and tasks/ keeping torch out of module level (the Prefect worker
must start fast and without a GPU)."""

import importlib.util
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatrain

ROOT = Path(__file__).resolve().parents[1]


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


import_graph = _import_graph()


def test_the_layers_hold():
    graph = import_graph.build_graph(ROOT)
    assert "megatrain.training.trainer" in graph.modules and "flows.pretrain" in graph.modules
    assert "megatrain.model.gpt" in graph.edges["megatrain.parallel.meta"]  # imports are read
    assert "megatrain.training.rank" in graph.edges["megatrain.cli"]  # and the command table's names
    assert import_graph.circles(graph) == []
    assert import_graph.violations(graph) == []


def test_the_picture_in_the_docs_is_the_code():
    """docs/architecture.md shows the graph of today's code (``scripts/import_graph.py --write``)."""
    graph = import_graph.build_graph(ROOT)
    assert import_graph.docs_section(graph) in (ROOT / "docs" / "architecture.md").read_text(), (
        "the dependency picture is stale: run python scripts/import_graph.py --write")


def _planted(tmp_path: Path, path: str, line: str) -> list[str]:
    """The violations of a copy of the tree with ``line`` added to ``path``."""
    for package in import_graph.PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / path
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {line}\n")
    return import_graph.violations(import_graph.build_graph(tmp_path))


@pytest.mark.parametrize("path, line, expected", [
    # upward: the model (parts) reaching into the trainer, even lazily inside a function
    ("megatrain/model/gpt.py", "from megatrain.training.trainer import Trainer", "is in a higher layer"),
    # sideways: two packages of one layer
    ("megatrain/data/loader.py", "import megatrain.observe.metrics", "is in the same layer"),
    # the ground floor importing a third party it should not
    ("megatrain/kernels/gelu.py", "import numpy", "kernels use only torch, triton and torchao"),
    # a circle inside one package, by importlib with a literal name
    ("megatrain/config/section.py", "importlib.import_module('megatrain.config.schema')", "import circle"),
    # the engine importing the orchestration above it
    ("megatrain/errors.py", "from tasks.stop import STOP", "is in a higher layer"),
])
def test_a_planted_violation_is_found(tmp_path, path, line, expected):
    found = _planted(tmp_path, path, line)
    assert any(expected in problem for problem in found), found


def test_a_new_package_needs_a_layer(tmp_path):
    found = _planted(tmp_path, "megatrain/errors.py", "pass")
    assert found == []
    (tmp_path / "megatrain" / "newthing").mkdir()
    (tmp_path / "megatrain" / "newthing" / "__init__.py").write_text("")
    found = import_graph.violations(import_graph.build_graph(tmp_path))
    assert found == ["megatrain.newthing has no layer: place it in LAYERS (scripts/import_graph.py)"]


def _engine_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(megatrain.__path__, "megatrain."))


@pytest.mark.slow
def test_megatrain_never_imports_prefect():
    modules = [m for m in _engine_modules() if "_triton" not in m and not m.endswith("flex_attention")]
    assert "megatrain.training.trainer" in modules and "megatrain.model.gpt" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "assert not bad, bad[:5]\n"
        "print('ok', len(sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("ok")


def test_config_launch_and_report_import_neither_torch_nor_prefect():
    code = ("import sys, megatrain.config, megatrain.config.campaign, megatrain.config.compat, megatrain.launch.ranks, "
            "megatrain.launch.lease, megatrain.report.status; "
            "assert 'torch' not in sys.modules and 'prefect' not in sys.modules, sorted(m for m in sys.modules if m in ('torch', 'prefect'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_flows_and_tasks_do_not_import_torch_at_module_level():
    packages = [ROOT / "flows", ROOT / "tasks"]
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in packages if package.exists() for path in package.rglob("*.py")
    ]
    if not modules:  # nothing to check yet is not a failure of the boundary
        return
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name.removesuffix('.__init__'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
