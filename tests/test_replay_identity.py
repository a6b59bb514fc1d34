"""benchmarks/replay_identity.py --before DIR runs all of DIR's code, not the installed one's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_root_imports_policies_and_resources_from_that_checkout(tmp_path):
    """The install maps tiering.policies and tiering.resources from its own folders, so
    a path entry alone would run the installed policies as the 'before' code."""
    copy = tmp_path / "checkout"
    for folder in ("tiering", "policies", "resources"):
        shutil.copytree(ROOT / folder, copy / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import replay_identity as r; "
        "r.use_root(sys.argv[2]); "
        "import tiering, tiering.policies.blocks.chain as c, tiering.resources.kv_prefix_rules as k; "
        "print(tiering.__file__); print(c.__file__); print(k.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT / "benchmarks"), str(copy)],
                         capture_output=True, text=True, check=True, timeout=120)
    files = out.stdout.split()
    assert len(files) == 3
    for f in files:
        assert Path(f).resolve().is_relative_to(copy.resolve()), f
    # the negative control: without use_root, only tiering itself comes from the copy
    plain = probe.replace("r.use_root(sys.argv[2]); ", "sys.path.insert(0, sys.argv[2]); ")
    out = subprocess.run([sys.executable, "-c", plain, str(ROOT / "benchmarks"), str(copy)],
                         capture_output=True, text=True, check=True, timeout=120)
    assert not all(Path(f).resolve().is_relative_to(copy.resolve()) for f in out.stdout.split())


def test_root_without_the_library_is_refused_naming_it(tmp_path):
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import replay_identity as r; "
             "r.use_root(sys.argv[2])")
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT / "benchmarks"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no policies/__init__.py" in out.stderr
