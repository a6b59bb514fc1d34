"""One errors module: every exception the package defines lives in ``tiering.errors``.

The scan reads the source (no imports), so a module that needs an optional
dependency is checked as well; a negative control proves the scan finds an
exception defined anywhere else.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

import tiering
import tiering.errors as errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tiering", "resources", "policies")
ERRORS_FILE = ROOT / "tiering" / "errors.py"
BUILTIN_EXCEPTIONS = frozenset(
    name for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def exception_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """class name -> files defining it, for every class that derives from an exception.

    A class is an exception when one of its bases is a builtin exception, a name
    ending in Error/Exception, or (to a fixpoint) another class found here.
    """
    classes: list[tuple[str, str, list[str]]] = []
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in map(_base_name, node.bases) if b]
                classes.append((node.name, where, bases))
    known = set(BUILTIN_EXCEPTIONS)
    changed = True
    while changed:
        changed = False
        for name, _, bases in classes:
            if name not in known and any(
                b in known or b.endswith(("Error", "Exception")) for b in bases
            ):
                known.add(name)
                changed = True
    found: dict[str, list[str]] = {}
    for name, where, _ in classes:
        if name in known and name not in BUILTIN_EXCEPTIONS:
            found.setdefault(name, []).append(where)
    return found


def _package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for top in PACKAGES for path in sorted((ROOT / top).rglob("*.py"))
    }


def test_every_exception_is_defined_in_tiering_errors():
    found = exception_classes(_package_sources())
    assert "IllegalTransition" in found and "DiskIOError" in found  # the scan sees them
    elsewhere = {
        name: files for name, files in found.items()
        if not name.startswith("_") and files != ["tiering/errors.py"]
    }
    assert not elsewhere, f"exceptions defined outside tiering/errors.py: {elsewhere}"


def test_scan_finds_an_exception_defined_elsewhere():
    """Negative control: a module defining its own exception (directly, or through a
    class of its own that derives from one) is caught by the same scan."""
    sources = {
        "tiering/errors.py": ERRORS_FILE.read_text(),
        "tiering/x.py": "class Base(KeyError):\n    pass\nclass Sneaky(Base):\n    pass\n",
        "tiering/y.py": "class NotAnError:\n    pass\n",
    }
    found = exception_classes(sources)
    assert found["Sneaky"] == ["tiering/x.py"] and found["Base"] == ["tiering/x.py"]
    assert "NotAnError" not in found


def test_every_error_is_documented_exported_and_listed():
    defined = {
        value.__name__ for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
        and value.__module__ == "tiering.errors"
    }
    in_file = set(exception_classes({"tiering/errors.py": ERRORS_FILE.read_text()}))
    assert defined == in_file
    listed = set(errors.__all__)
    # every class is listed; the only listed name that is not a class of its own is the alias
    assert defined <= listed and listed - defined == {"UnknownRequestError"}
    assert errors.UnknownRequestError is errors.UnknownRequest
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert inspect.isclass(cls) and issubclass(cls, Exception), name
        assert cls.__module__ == "tiering.errors", name
        doc = cls.__dict__.get("__doc__")
        assert doc and doc.strip(), f"tiering.errors.{name} has no docstring of its own"
        assert name in tiering.__all__, f"tiering does not export {name}"
        assert getattr(tiering, name) is cls, name


OLD_HOMES = [
    ("tiering.types", "IllegalTransition"),
    ("tiering.resources.kv_records", "UnknownRequest"),
    ("tiering.resources.kv_records", "RequestLost"),
    ("tiering.resources.kv_records", "CacheClosed"),
    ("tiering.control.config", "UnknownRequestError"),
    ("tiering.control.controller", "UnknownRequestError"),
    ("tiering.core.pools", "PoolIntegrityError"),
    ("tiering.core.checksum", "ChecksumMismatch"),
    ("tiering.core.transfer", "CopyFault"),
    ("tiering.core.staging", "StagingTimeout"),
    ("tiering.core.pinning", "PinError"),
    ("tiering.disk", "DiskIOError"),
    ("tiering.disk", "DiskCorruptionError"),
    ("tiering.disk", "DiskIntegrityError"),
    ("tiering.disk", "DiskPathInUseError"),
    ("tiering.disk.store", "DiskIOError"),
    ("tiering.disk.ledger", "DiskIntegrityError"),
    ("tiering.disk.lock", "DiskPathInUseError"),
    ("tiering.disk.slotfile", "ChunkChecksumError"),
    ("tiering.disk.manifest", "ManifestError"),
    ("tiering.disk.backend", "StartRefused"),
    ("tiering.coldtier", "ColdTierError"),
    ("tiering.coldtier", "FrameRefused"),
    ("tiering.coldtier.errors", "LeaseLost"),
    ("tiering.apps.replay.traces", "TraceFormatError"),
    ("tiering.apps.replay.model_kv", "UnknownRequest"),
    ("tiering.apps.demo.worker", "WorkerStalled"),
]


@pytest.mark.parametrize(("module", "name"), OLD_HOMES)
def test_old_import_paths_name_the_same_class(module, name):
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # an optional extra is not installed here
        pytest.skip(f"{module} needs {exc.name}")
    assert getattr(mod, name) is getattr(errors, name)


def test_one_unknown_request_class_for_cache_and_controller(kv):
    from tiering.policies import make_policy

    from tiering.control.controller import EvictionController
    from tiering.control.pressure import PoolPressure

    assert issubclass(errors.UnknownRequest, KeyError)
    cache = kv(device_pages=4, host_pages=4)
    ctl = EvictionController({"kv": cache}, make_policy("lru"), PoolPressure(cache))
    with pytest.raises(errors.UnknownRequest) as from_cache:
        cache.read("nobody", 0)
    with pytest.raises(errors.UnknownRequest) as from_controller:
        ctl.touch("nobody")
    for raised in (from_cache.value, from_controller.value):
        assert type(raised) is errors.UnknownRequest
        assert "'nobody'" in str(raised) and not str(raised).startswith('"')
    cache.check_integrity()


def test_request_lost_carries_rid_and_reason():
    err = errors.RequestLost("r-7", "disk read failed")
    assert (err.rid, err.reason) == ("r-7", "disk read failed")
    assert str(err) == "request 'r-7' is lost: disk read failed"
    assert str(errors.UnknownRequest()) == "unknown request"


def test_errors_module_imports_nothing_of_the_package():
    tree = ast.parse(ERRORS_FILE.read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert all(m in ("__future__", "errno") for m in imported), imported  # the standard library only


def _id_checkers():
    """Every place a caller hands the package a request id it checks, built fresh."""
    from tiering import KVGeometry, PagedKVCache, TieredKV
    from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
    from tiering.testing import FakeTieredResource

    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=4)
    kv = PagedKVCache(g, "cpu", device_pages=8, host_pages=8)
    front = TieredKV.around(PagedKVCache(g, "cpu", device_pages=8, host_pages=8))
    model = ModeledKVCache(16, 4, 8, 8, 8, LinkRates.instant(), lambda: 0.0)
    return [("PagedKVCache.ingest_request", kv.ingest_request, kv),
            ("TieredKV.add", front.add, front),
            ("EvictionController.add_request", front.controller.add_request, None),
            ("EvictionController.touch", front.controller.touch, None),
            ("ModeledKVCache.ingest_request", model.ingest_request, None),
            ("FakeTieredResource.add", lambda rid: FakeTieredResource(1 << 20).add(rid, 64), None)]


@pytest.mark.parametrize("bad", [3, None, b"r", "", 2.5, ("r",)])
def test_a_bad_request_id_is_one_error_that_is_a_type_and_a_value_error(bad):
    """A request id that is not a non-empty str raises ``BadRequestId`` wherever it is
    handed in (a TypeError and a ValueError at once, so either ``except`` catches it),
    naming the id, with nothing registered. Before, the cache raised ValueError and the
    front door TypeError for the same id."""
    for where, call, owner in _id_checkers():
        with pytest.raises(errors.BadRequestId) as caught:
            call(bad)
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)
        assert repr(bad) in str(caught.value), where
        if owner is not None:
            assert owner.requests() == [], f"{where} registered {bad!r}"
            owner.close()


def _an_instance(cls: type) -> BaseException:
    """One instance of ``cls`` from the arguments its constructor takes."""
    if cls is errors.RequestLost:
        return cls("req-7", "reload from disk failed: checksum")
    if cls is errors.MissingExtra:
        return cls("matplotlib", "plots", "the demo's figure")
    if issubclass(cls, OSError):
        return cls(5, "disk store 'x': read failed")
    return cls("what went wrong, named")


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_pickles_and_copies_whole(name):
    """RequestLost and MissingExtra take several arguments but pickled only their message:
    unpickling raised TypeError (missing 'reason'; missing 'extra' and 'needed_for'), so
    one raised in a worker process (replay --jobs, a process pool) turned into that
    TypeError in the parent, hiding the real error."""
    import copy
    import pickle

    exc = _an_instance(getattr(errors, name))
    for back in (pickle.loads(pickle.dumps(exc)), copy.deepcopy(exc)):
        assert type(back) is type(exc) and str(back) == str(exc)
        assert vars(back) == vars(exc)  # rid and reason, extra and needed_for, ...
        assert back.args == exc.args
