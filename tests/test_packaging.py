"""The installed names: resources/ and policies/ install as tiering.resources and
tiering.policies, and pyproject's package list names every package folder of the tree."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"tiering": "tiering", "resources": "tiering.resources", "policies": "tiering.policies"}


def _tree_packages() -> set[str]:
    found = set()
    for top, package in FOLDERS.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([package, *rel.parts]))
    return found


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_is_the_tree():
    listed = set(_pyproject()["packages"])
    tree = _tree_packages()
    assert listed == tree, (f"missing from pyproject: {sorted(tree - listed)}; "
                            f"listed but not in the tree: {sorted(listed - tree)}")


def test_the_folders_map_under_the_product():
    assert _pyproject()["package-dir"] == {p: f for f, p in FOLDERS.items()}


@pytest.mark.parametrize("name", ["resources", "policies"])
def test_the_old_top_level_names_are_gone(name, tmp_path):
    """Outside the source tree (where the folders themselves are on sys.path) the bare
    names do not import: they would collide with other distributions."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "ModuleNotFoundError" in run.stderr, run.stderr
    ok = subprocess.run([sys.executable, "-c", f"import tiering.{name}"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_the_new_names_are_the_folders():
    for folder, package in FOLDERS.items():
        module = importlib.import_module(package)
        assert Path(module.__file__).resolve().parent == ROOT / folder


def test_no_module_imports_the_old_names():
    bad = []
    for path in [*ROOT.glob("tiering/**/*.py"), *ROOT.glob("resources/**/*.py"),
                 *ROOT.glob("policies/**/*.py"), *ROOT.glob("tests/*.py"),
                 *ROOT.glob("benchmarks/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            s = line.strip()
            if s.startswith(("from resources", "import resources", "from policies",
                             "import policies")):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {s}")
    assert not bad, "imports of the old top-level names:\n" + "\n".join(bad)
