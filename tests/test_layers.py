"""The layers the folders show: no module imports from a layer above its own.

Layers, lowest first (a module may import its own layer and any below):

0. ``tiering.types``, ``tiering.errors``, ``tiering._optional``, ``tiering.units``: the vocabulary
1. ``tiering.policies`` (folder ``policies/``): ranking, pure (no torch, no I/O)
2. ``tiering.core``, ``tiering.disk``, ``tiering.blocks``, ``tiering.coldtier``,
   ``tiering.control``: the mechanism and the controller
3. ``tiering.resources`` (folder ``resources/``): the engine's interface and the KV cache built on the core
4. ``tiering.tiered``, ``tiering.testing``: the front door and the helpers users test with
5. ``tiering.integrations``, ``tiering.apps``: what assembles the above
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("tiering.types", "tiering.errors", "tiering._optional", "tiering.units"),
    ("tiering.policies",),
    ("tiering.core", "tiering.disk", "tiering.blocks", "tiering.coldtier", "tiering.control"),
    ("tiering.resources",),
    ("tiering.tiered", "tiering.testing"),
    ("tiering.integrations", "tiering.apps"),
]
# the package front door re-exports lazily from every layer; `python -m tiering` runs the CLI
EXEMPT = {"tiering", "tiering.__main__"}


def _layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                return i
    return None


def _modules() -> list[tuple[str, Path]]:
    out = []
    for top, package in (("tiering", "tiering"), ("resources", "tiering.resources"),
                         ("policies", "tiering.policies")):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT / top).with_suffix("")
            parts = package.split(".") + list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append(name)
            found += [f"{name}.{a.name}" for a in node.names]
    return found


def test_every_module_has_a_layer():
    missing = [m for m, _ in _modules() if m not in EXEMPT and _layer(m) is None]
    assert not missing, f"modules outside every layer: {missing}"


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_no_import_goes_up_a_layer(module, path):
    if module in EXEMPT:
        return
    mine = _layer(module)
    bad = []
    for name in _imports(module, path):
        theirs = _layer(name)
        if theirs is not None and theirs > mine:
            bad.append(name)
    assert not bad, f"{module} (layer {mine}) imports from a layer above: {sorted(set(bad))}"


def test_the_check_catches_an_upward_import(tmp_path):
    """Negative control: a core module importing the KV cache is reported."""
    fake = tmp_path / "x.py"
    fake.write_text("from tiering.resources.kv_cache import PagedKVCache\n")
    names = _imports("tiering.core.x", fake)
    assert any(_layer(n) == 3 for n in names) and _layer("tiering.core.x") == 2
