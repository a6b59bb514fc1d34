"""The core installs and imports without any extra; a missing extra is named where it is needed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from tiering._optional import EXTRAS, MissingExtra, require

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {"torch", "numpy", "zarr", "google-crc32c", "crc32c-rs", "nvidia-ml-py"}
# import names of every optional package (what a blocked import hides)
OPTIONAL_MODULES = ("matplotlib", "tqdm", "psutil", "obstore", "prometheus_client", "vllm",
                    "cupy")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_core_needs_only_torch_numpy_zarr_crc32c_and_nvml():
    assert _names(PROJECT["dependencies"]) == CORE


def test_every_extra_that_an_error_names_exists_with_the_same_packages():
    extras = PROJECT["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        assert extra in extras, f"tiering._optional names extra {extra!r}, pyproject lacks it"
        assert _names(extras[extra]) == set(packages), extra


def test_require_names_the_extra_and_lets_other_import_errors_through(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"the figures needs .*'matplotlib'.*"
                                           r"pip install 'tiering\[plots\]'") as info:
        require("matplotlib", "plots", "the figures")
    assert isinstance(info.value, ImportError) and info.value.extra == "plots"
    with pytest.raises(ValueError, match="unknown extra 'plot'"):
        require("json", "plot", "x")
    # a module that is there but imports something else that is missing: not its extra
    (tmp_path / "probe_present_mod.py").write_text("import probe_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as other:
        require("probe_present_mod", "plots", "x")
    assert not isinstance(other.value, MissingExtra)
    assert other.value.name == "probe_absent_dependency"


_BLOCKED = f"""
import sys
for name in {OPTIONAL_MODULES!r}:
    sys.modules[name] = None          # as if not installed: import raises ModuleNotFoundError
"""


def _run(body: str) -> str:
    code = _BLOCKED + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_every_module_imports_without_the_extras_and_each_site_names_its_extra():
    out = _run("""
        import importlib, io, pkgutil
        import tiering
        from tiering._optional import MissingExtra
        skipped = {"tiering.integrations.vllm._spec",    # imports vLLM by design
                   "tiering.__main__"}                   # runs the command
        for mod in pkgutil.walk_packages(tiering.__path__, "tiering."):
            if mod.name not in skipped:
                importlib.import_module(mod.name)
        for name in tiering.__all__:
            getattr(tiering, name)

        def named(extra, call):
            try:
                call()
            except MissingExtra as exc:
                assert f"pip install 'tiering[{extra}]'" in str(exc), exc
                print("named", extra)
            else:
                raise AssertionError(f"{call} ran without its extra {extra}")

        import tiering.integrations.vllm as v
        named("vllm", lambda: v.TieredOffloadingSpec)
        from tiering.control.metrics import PrometheusExporter
        named("metrics", lambda: PrometheusExporter(object()))
        from tiering.apps.stress.memory import RssTracker
        named("apps", RssTracker)
        from tiering.apps.replay import plots
        named("plots", plots._plt)
        from tiering.apps.replay.progress import Progress
        named("apps", lambda: Progress(1, 1, stream=io.StringIO(), tty=True))
    """)
    assert out.split() == ["named", "vllm", "named", "metrics", "named", "apps", "named", "plots",
                           "named", "apps"]
