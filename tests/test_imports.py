"""The read side imports on a GPU box that has only torch, pyarrow and numpy."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Packages a training job must not need, and the write side itself.
BLOCKED = ("apache_beam", "datasets", "transformers", "tokenizers", "pipeline")

IMPORT_EVERYTHING = textwrap.dedent(
    """
    import importlib, importlib.abc, json, pkgutil, sys

    BLOCKED = {blocked!r}
    attempts = []

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"{{name}} is not installed on a GPU box")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, {root!r})
    imported = []
    for package_name in {packages!r}:
        package = importlib.import_module(package_name)
        imported.append(package_name)
        for module in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
            importlib.import_module(module.name)
            imported.append(module.name)
    print(json.dumps({{"imported": imported, "attempts": attempts}}))
    """
)


def import_blocked(packages: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import ``packages`` and every module in them in a fresh interpreter where BLOCKED cannot be imported."""
    script = IMPORT_EVERYTHING.format(blocked=BLOCKED, root=str(ROOT), packages=packages)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_loaders_and_schemas_import_without_the_write_side() -> None:
    result = import_blocked(("schemas", "loaders"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    modules = {f"{package}.{path.stem}" for package in ("schemas", "loaders") for path in (ROOT / package).glob("*.py")}
    missed = modules - {"schemas.__init__", "loaders.__init__"} - set(report["imported"])
    assert not missed, f"not imported: {missed}"
    assert report["attempts"] == [], f"imported at module import time: {report['attempts']}"


def test_the_blocker_does_block() -> None:
    result = import_blocked(("pipeline",))
    assert result.returncode != 0 and "pipeline is not installed on a GPU box" in result.stderr


def test_scripts_import_nothing_from_tests() -> None:
    test_modules = {path.stem for path in (ROOT / "tests").glob("*.py")}
    for script in (ROOT / "scripts").glob("*.py"):
        tree = ast.parse(script.read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & (test_modules | {"tests"}), f"{script.name} imports {imported & test_modules} from tests/"
        assert '"tests"' not in script.read_text(encoding="utf-8"), f"{script.name} puts tests/ on sys.path"
