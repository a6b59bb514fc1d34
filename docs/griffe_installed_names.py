"""Griffe extension for the reference: document resources/ and policies/ by their installed names.

pyproject.toml's ``[tool.setuptools.package-dir]`` installs the folder ``resources/`` as
``tiering.resources`` and ``policies/`` as ``tiering.policies``. Griffe reads a package
from its folder, so it would name them ``resources`` and ``policies``; this extension
loads each such folder and hangs it under the package it is installed in, so that
``::: tiering.resources.kv_cache.PagedKVCache`` resolves and the pages show the names a
user imports. mkdocs.yml names it under the python handler's ``extensions``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def mapped_folders(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Installed dotted name -> folder, for each package installed away from its own path."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return {name: folder for name, folder in table.items() if name.replace(".", "/") != folder}


class InstalledNames(griffe.Extension):
    """Attach each mapped folder to its parent package once that package is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self._mapped = mapped_folders()

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for name, folder in self._mapped.items():
            parent, _, leaf = name.rpartition(".")
            if parent != pkg.path or leaf in pkg.members:
                continue
            pkg.set_member(leaf, loader.load(folder))
