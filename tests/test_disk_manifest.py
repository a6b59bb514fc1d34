"""Manifest write faults (reattach mode) and the committed table: uncommit, reused ids."""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.disk import DiskConfig, DiskIOError, DiskPageStore, FaultPlan, FaultyStore
from tiering.disk.manifest import MANIFEST_KEY

PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4
CHUNK = 2 * PAGE_BYTES
KINDS = {"enospc_manifest": errno.ENOSPC, "erofs_manifest": errno.EROFS, "eio_manifest": errno.EIO}


def make(path: Path, plan: FaultPlan | None = None, *, capacity_chunks: int = 12) -> DiskPageStore:
    cfg = DiskConfig(
        path=path, capacity_bytes=capacity_chunks * CHUNK, chunk_bytes=CHUNK, on_start="reattach"
    )
    wrap = (lambda s: FaultyStore(s, plan)) if plan is not None else None
    return DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="m", wrap_store=wrap)


def pages(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((n, *PAGE_SHAPE)).astype(np.float32))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_failed_commit_raises_and_records_nothing(tmp_path, rng, kind):
    plan = FaultPlan(seed=1)
    s = make(tmp_path / "d", plan)
    keep, new = s.reserve("keep", 3), s.reserve("new", 3)
    data_keep, data_new = pages(rng, 3), pages(rng, 3)
    s.write(keep, data_keep)
    s.write(new, data_new)
    s.commit("keep", keep, {"v": 1})
    plan.arm(kind, next_n=1)
    with pytest.raises(DiskIOError) as info:
        s.commit("new", new, {"v": 2})
    assert info.value.errno == KINDS[kind] and "manifest" in str(info.value)
    assert plan.injected[kind] == 1
    st_ = s.stats()
    assert st_["committed"] == 1 and st_["manifest_faults"] == 1 and st_["extents"] == 2
    s.check_integrity()
    out = torch.empty_like(data_new)
    s.read(new, out)  # still reserved and written: the caller decides what to do with it
    assert torch.equal(out, data_new)
    s.close()
    again = make(tmp_path / "d")
    assert set(again.reattached()) == {"keep"}
    got = torch.empty_like(data_keep)
    again.read(again.reattached()["keep"][0], got)
    assert torch.equal(got, data_keep)
    again.check_integrity()
    again.close()


def test_failed_commit_of_a_superseding_extent_keeps_the_old_entry(tmp_path, rng):
    plan = FaultPlan(seed=2)
    s = make(tmp_path / "d", plan)
    old, new = s.reserve("r", 2), s.reserve("r", 2)
    s.write(old, pages(rng, 2))
    s.write(new, pages(rng, 2))
    s.commit("r", old, {"gen": "old"})
    plan.arm("eio_manifest", next_n=1)
    with pytest.raises(DiskIOError):
        s.commit("r", new, {"gen": "new"})
    s.check_integrity()
    s.close()
    again = make(tmp_path / "d")
    assert again.reattached()["r"][1] == {"gen": "old"}
    again.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_release_and_uncommit_never_raise_for_a_manifest_fault(tmp_path, rng, kind, caplog):
    plan = FaultPlan(seed=3)
    s = make(tmp_path / "d", plan, capacity_chunks=4)  # 8 pages
    a, b = s.reserve("a", 4), s.reserve("b", 4)  # four pages each: the whole tier
    s.write(a, pages(rng, 4))
    s.write(b, pages(rng, 4))
    s.commit("a", a)
    s.commit("b", b)
    plan.arm(kind, next_n=2)
    with caplog.at_level(logging.WARNING, logger="tiering.disk.store"):
        s.release(a)
        s.uncommit(b)
    assert caplog.text.count("will retry") == 2
    # a's chunks are still listed by the manifest on disk: counted, not reusable
    assert s.stats()["quarantined_chunks"] == 4 and s.reserve("c", 1) is None
    s.check_integrity()
    assert s.stats()["manifest_dirty"] and s.stats()["committed"] == 0
    assert s.retry_manifest()  # the fault is spent: the retry lands and frees a's chunks
    assert s.stats()["quarantined_chunks"] == 0 and not s.stats()["manifest_dirty"]
    c = s.reserve("c", 4)
    assert c is not None
    s.check_integrity()
    s.close()
    again = make(tmp_path / "d")
    assert again.reattached() == {}
    again.close()


def _committed(s, rid: str, n: int, rng, meta: dict):
    """Reserve ``n`` pages for ``rid``, write random pages there and commit them."""
    extent = s.reserve(rid, n)
    s.write(extent, pages(rng, n))
    s.commit(rid, extent, meta)
    return extent


def test_uncommit_lets_a_reused_id_commit_at_once_and_is_idempotent(tmp_path, rng):
    s = make(tmp_path / "d")
    first = _committed(s, "rid", 3, rng, {"turn": 1})
    s.uncommit(first)
    s.uncommit(first)  # idempotent
    assert s.stats()["committed"] == 0 and s.stats()["extents"] == 1  # still reserved
    second = s.reserve("rid", 2)
    data = pages(rng, 2)
    s.write(second, data)
    s.commit("rid", second, {"turn": 2})  # a reused id behaves like a fresh one
    s.check_integrity()
    s.release(first)  # the old copy's read finished: release it; the new entry stays
    assert s.stats()["committed"] == 1
    s.check_integrity()
    s.close()
    again = make(tmp_path / "d")
    ext, meta = again.reattached()["rid"]
    assert meta == {"turn": 2}
    out = torch.empty_like(data)
    again.read(ext, out)
    assert torch.equal(out, data)
    with pytest.raises(ValueError, match="not reserved"):
        again.uncommit(first)
    again.close()


def test_a_reused_id_is_never_wedged_by_a_leftover_entry(tmp_path, rng):
    s = make(tmp_path / "d")
    old = _committed(s, "rid", 2, rng, {"turn": 1})
    # no uncommit: the old copy is still held; the new one supersedes it (this used to
    # raise "already committed")
    new = _committed(s, "rid", 2, rng, {"turn": 2})
    assert s.stats()["committed"] == 1 and s.stats()["extents"] == 2
    s.write(old, pages(rng, 2))  # the old extent is no longer committed, so it may be rewritten
    s.check_integrity()
    s.release(old)
    s.release(new)
    assert s.stats()["committed"] == 0 and s.used_bytes() == 0
    s.check_integrity()
    s.close()


class ManifestMachine(RuleBasedStateMachine):
    """Random commits, uncommits and releases with manifest faults; a model of what
    should be committed and of what the last manifest that landed lists."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="disk-manifest-sm-"))
        self.plan = FaultPlan(seed=7)
        self.store = make(self.dir / "d", self.plan, capacity_chunks=8)
        self.rng = np.random.default_rng(5)
        self.live: dict[
            tuple[int, ...], tuple[str, object, bool]
        ] = {}  # chunks -> owner, ext, written
        self.committed: dict[str, tuple[int, ...]] = {}
        self.on_disk: dict[str, tuple[int, ...]] = {}
        self.dirty = False

    @rule(owner=st.sampled_from(["a", "b", "c"]), n=st.integers(1, 4))
    def reserve_and_write(self, owner, n):
        ext = self.store.reserve(owner, n)
        if ext is None:
            return
        self.store.write(ext, pages(self.rng, n))
        self.live[ext.chunks] = (owner, ext, True)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), fault=st.booleans())
    def commit(self, pick, fault):
        owner, ext, _ = self.live[sorted(self.live)[pick % len(self.live)]]
        if fault:
            self.plan.arm("enospc_manifest", next_n=1)
            with pytest.raises(DiskIOError):
                self.store.commit(owner, ext)
            self.plan.disarm("enospc_manifest")
            self.dirty = True
            return
        self.store.commit(owner, ext)
        self.committed[owner] = ext.chunks
        self.on_disk, self.dirty = dict(self.committed), False

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), fault=st.booleans(), release=st.booleans())
    def drop(self, pick, fault, release):
        key = sorted(self.live)[pick % len(self.live)]
        owner, ext, _ = self.live[key]
        if fault:
            self.plan.arm("eio_manifest", next_n=1)
        was_committed = self.committed.get(owner) == key
        if release:
            self.store.release(ext)
            del self.live[key]
        else:
            self.store.uncommit(ext)
        if was_committed:
            del self.committed[owner]
        wrote = was_committed or self.dirty
        if wrote and not fault:
            self.on_disk, self.dirty = dict(self.committed), False
        elif wrote:
            self.dirty = True
        self.plan.disarm("eio_manifest")

    @invariant()
    def consistent(self):
        self.store.check_integrity()
        assert self.store.stats()["committed"] == len(self.committed)
        assert self.store.stats()["manifest_dirty"] == self.dirty
        assert self.store.stats()["extents"] == len(self.live)

    def teardown(self):
        self.store.close()
        again = make(self.dir / "d", capacity_chunks=8)
        if not self.dirty:
            got = {o: e.chunks for o, (e, _) in again.reattached().items()}
            assert got == self.on_disk
        again.check_integrity()
        again.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestManifestMachine = ManifestMachine.TestCase
TestManifestMachine.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_close_retries_a_failed_manifest_write_and_nothing_is_written_after_it(tmp_path):
    """A release whose manifest write failed leaves the old manifest listing the extent;
    ``close`` retries that write while it still holds the path, so a restart does not bring
    the released extent back. After ``close`` the store writes nothing (the path is no
    longer held): ``retry_manifest`` is refused."""
    rng = np.random.default_rng(61)
    plan = FaultPlan(seed=9)
    s = make(tmp_path / "d", plan)
    keep, gone = s.reserve("keep", 2), s.reserve("gone", 2)
    for ext, owner in ((keep, "keep"), (gone, "gone")):
        s.write(ext, pages(rng, 2))
        s.commit(owner, ext)
    plan.arm("eio_manifest", next_n=1)
    s.release(gone)  # its manifest write fails: the manifest on disk still lists 'gone'
    assert s.stats()["manifest_dirty"] and s.stats()["quarantined_chunks"] == 2
    s.close()
    manifest = (tmp_path / "d" / MANIFEST_KEY).read_bytes()
    with pytest.raises(ValueError, match="closed"):
        s.retry_manifest()
    assert (tmp_path / "d" / MANIFEST_KEY).read_bytes() == manifest  # nothing written
    again = make(tmp_path / "d")
    assert sorted(again.reattached()) == ["keep"]  # the released extent stays released
    again.check_integrity()
    again.close()


# -- decode_manifest: every check it makes, on a manifest whose own checksum is intact --------

_LAYOUT = {"page_shape": [2, 4, 8], "dtype": "float32", "chunk_bytes": CHUNK}
_CAP, _PPC = 8, 2


def _encode(entries, *, layout=_LAYOUT, next_generation=10):
    from tiering.disk.manifest import encode_manifest

    return encode_manifest("m", layout, entries, store_id="s1", next_generation=next_generation)


def _decode(raw):
    from tiering.disk.manifest import decode_manifest

    return decode_manifest(raw, fingerprint="m", layout=_LAYOUT, capacity_chunks=_CAP,
                           pages_per_chunk=_PPC, store_id="s1")


def _good():
    from tiering.disk.manifest import ManifestEntry

    rng = np.random.default_rng(77)
    a = tuple(int(c) for c in rng.choice(_CAP, size=2, replace=False))
    rest = [c for c in range(_CAP) if c not in a]
    return {"a": ManifestEntry(a, 3, {"k": float(rng.random())}, 3),
            "b": ManifestEntry((rest[0],), 1, {}, 9)}


def test_decode_manifest_returns_every_entry_of_a_sound_manifest():
    entries = _good()
    got = _decode(_encode(entries))
    assert got.entries == entries and got.next_generation == 10


@pytest.mark.parametrize(("change", "what"), [
    ("layout", r"layout .* differs from ours"),
    ("generation_zero", r"entry 'a' has generation 0, outside \[1, 10\)"),
    ("generation_ahead", r"entry 'b' has generation 10, outside \[1, 10\)"),
    ("too_few_chunks", r"entry 'a': 1 chunks cannot hold exactly 3 pages of 2 per chunk"),
    ("too_many_chunks", r"entry 'b': 2 chunks cannot hold exactly 1 pages"),
    ("claimed_twice", r"entry 'b' claims chunks twice"),
    ("repeated_in_one", r"entry 'a' claims chunks twice"),
    ("out_of_range", r"entry 'b' names chunks out of range"),
])
def test_decode_manifest_refuses_each_inconsistency_and_names_it(change, what):
    from tiering.disk.manifest import ManifestEntry
    from tiering.errors import ManifestError

    entries, layout = _good(), _LAYOUT
    a, b = entries["a"], entries["b"]
    if change == "layout":
        layout = {**_LAYOUT, "chunk_bytes": 2 * CHUNK}
    elif change == "generation_zero":
        entries["a"] = a._replace(generation=0)
    elif change == "generation_ahead":
        entries["b"] = b._replace(generation=10)
    elif change == "too_few_chunks":
        entries["a"] = a._replace(chunks=a.chunks[:1])
    elif change == "too_many_chunks":
        spare = next(c for c in range(_CAP) if c not in a.chunks + b.chunks)
        entries["b"] = b._replace(chunks=(*b.chunks, spare))
    elif change == "claimed_twice":
        entries["b"] = b._replace(chunks=a.chunks[:1])
    elif change == "repeated_in_one":
        entries["a"] = a._replace(chunks=(a.chunks[0], a.chunks[0]))
    elif change == "out_of_range":
        entries["b"] = ManifestEntry((_CAP,), 1, {}, 9)
    raw = _encode(entries, layout=layout)  # its own checksum is intact: only the check can refuse
    with pytest.raises(ManifestError, match=what):
        _decode(raw)
