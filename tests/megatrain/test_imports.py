"""The import boundaries: the engine never imports Prefect; flows/ and tasks/ keep torch out of
module level (the Prefect worker must start fast and without a GPU)."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import megatrain

ROOT = Path(__file__).resolve().parents[2]


def _engine_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(megatrain.__path__, "megatrain."))


def test_megatrain_never_imports_prefect():
    modules = [m for m in _engine_modules() if "_triton" not in m and not m.endswith("flex_attention")]
    assert "megatrain.trainer" in modules and "megatrain.model.gpt" in modules
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


def test_config_imports_neither_torch_nor_prefect():
    code = ("import sys, megatrain.config, megatrain.config_load; "
            "assert 'torch' not in sys.modules and 'prefect' not in sys.modules")
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
