"""The disk tier holds its location exclusively; a failed start leaves nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import disk_lock_held
from zarr.storage import MemoryStore

from tiering.disk import DiskConfig, DiskIOError, DiskPageStore, DiskPathInUseError
from tiering.disk.lock import LOCK_FILE_NAME, LocalDirLock
from tiering.disk.slotfile import SLOT_FILE_NAME

PAGE_SHAPE = (2, 4, 8)
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4
CHUNK = 4 * PAGE_BYTES


def make(path, *, on_start="clear", capacity_chunks=8, **kw) -> DiskPageStore:
    cfg = DiskConfig(
        path=path,
        capacity_bytes=capacity_chunks * CHUNK,
        chunk_bytes=CHUNK,
        on_start=on_start,
        **kw,
    )
    return DiskPageStore(cfg, PAGE_SHAPE, torch.float32, fingerprint="lock-test")



def random_pages(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(
        np.random.default_rng(seed).standard_normal((n, *PAGE_SHAPE)).astype(np.float32)
    )


def test_second_open_in_the_same_process_is_refused_and_changes_nothing(tmp_path):
    root = tmp_path / "disk"
    first = make(root, on_start="reattach")
    data = random_pages(5, 1)
    extent = first.reserve("r1", 5)
    first.write(extent, data)
    first.commit("r1", extent, {"n": 5})
    slot_before = (root / SLOT_FILE_NAME).read_bytes()
    for on_start in ("clear", "reattach"):
        with pytest.raises(DiskPathInUseError) as info:
            make(root, on_start=on_start)
        msg = str(info.value)
        assert str(root) in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    # the first store's data and manifest are untouched and it keeps working
    assert (root / SLOT_FILE_NAME).read_bytes() == slot_before
    out = torch.empty_like(data)
    first.read(extent, out)
    assert torch.equal(out, data)
    first.check_integrity()
    assert disk_lock_held(root)
    first.close()
    assert not disk_lock_held(root)
    again = make(root, on_start="reattach")  # released at close: a new open succeeds
    assert set(again.reattached()) == {"r1"}
    again.read(again.reattached()["r1"][0], out)
    assert torch.equal(out, data)
    again.check_integrity()
    again.close()


_HOLDER = """
import sys, time, torch
from tiering.disk import DiskConfig, DiskPageStore
cfg = DiskConfig(path=sys.argv[1], capacity_bytes=int(sys.argv[2]), chunk_bytes=int(sys.argv[3]))
store = DiskPageStore(cfg, (2, 4, 8), torch.float32, fingerprint="lock-test")
print("ready", flush=True)
sys.stdin.readline()
"""


def test_another_process_holding_the_path_is_named_and_its_death_frees_it(tmp_path):
    root = tmp_path / "disk"
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), str(8 * CHUNK), str(CHUNK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(DiskPathInUseError, match=rf"pid {child.pid} host"):
            make(root)
        assert (root / SLOT_FILE_NAME).exists()  # the holder's files are not touched
    finally:
        child.kill()  # no close(): the kernel drops the lock with the process
        child.wait(timeout=30)
    store = make(root)
    store.check_integrity()
    store.close()


def test_failed_start_leaves_no_lock_no_files_no_threads(tmp_path):
    root = tmp_path / "fresh"
    warm = make(tmp_path / "warm")  # start zarr's own loop thread before counting
    warm.close()
    threads_before = set(threading.enumerate())

    def refuse(store):
        raise RuntimeError("wrapper refused")

    cfg = DiskConfig(path=root, capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    with pytest.raises(RuntimeError, match="wrapper refused"):
        DiskPageStore(cfg, PAGE_SHAPE, torch.float32, wrap_store=refuse)
    assert not root.exists()  # it made the directory, so it removes all of it
    assert set(threading.enumerate()) <= threads_before

    # a directory that existed: only what this start added goes
    root.mkdir()
    (root / "keep.txt").write_text("user data")
    with pytest.raises(DiskIOError, match="did not write"):
        DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]
    assert set(threading.enumerate()) <= threads_before
    (root / "keep.txt").unlink()
    store = make(root)  # and no lock was left behind
    store.close()


def test_a_lock_file_replaced_under_a_holder_does_not_make_two_holders(tmp_path):
    root = tmp_path / "disk"
    first = LocalDirLock(root)
    first.acquire()
    (root / LOCK_FILE_NAME).unlink()  # someone removes the held lock file
    second = LocalDirLock(root)
    second.acquire()  # it locks a new file: the old holder is no longer on the path...
    third = LocalDirLock(root)
    with pytest.raises(DiskPathInUseError):  # ...and the new one excludes everyone else
        third.acquire()
    second.release()
    first.release()


def test_a_lock_file_replaced_between_open_and_lock_is_locked_again(tmp_path, monkeypatch):
    """The race the inode check is for: the file opened is unlinked and replaced before its
    flock lands (a failed start discarding its file). The lock must retry on the file now at
    the path, so whoever opens the path next is refused; locking the unlinked file alone
    would let a second holder in."""
    import tiering.disk.lock as lock_module

    root = tmp_path / "disk"
    root.mkdir()
    path = root / LOCK_FILE_NAME
    real_flock = lock_module.fcntl.flock
    calls = []

    def flock_then_replace(fd, op):
        real_flock(fd, op)
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:  # the racer: unlink the file we opened, another opener creates one
            path.unlink()
            path.write_text("")

    monkeypatch.setattr(lock_module.fcntl, "flock", flock_then_replace)
    first = LocalDirLock(root)
    first.acquire()
    monkeypatch.setattr(lock_module.fcntl, "flock", real_flock)
    assert len(calls) == 2 and calls[0] != calls[1], "the replaced file was not locked again"
    assert first.held and os.fstat(first._fd).st_ino == os.stat(path).st_ino
    with pytest.raises(DiskPathInUseError, match="in use by another live disk tier"):
        LocalDirLock(root).acquire()
    first.release()
    LocalDirLock(root).acquire()  # the control: once released, the path can be locked


def test_acquiring_a_held_lock_again_is_refused_and_keeps_it(tmp_path):
    lock = LocalDirLock(tmp_path / "disk")
    lock.acquire()
    with pytest.raises(ValueError, match="already held by this object"):
        lock.acquire()
    assert lock.held
    with pytest.raises(DiskPathInUseError):
        LocalDirLock(tmp_path / "disk").acquire()
    lock.release()
    lock.release()  # idempotent
    assert not lock.held


@pytest.mark.parametrize("existed", [False, True], ids=["created", "found"])
def test_discard_removes_the_lock_file_only_if_acquire_created_it(tmp_path, existed):
    root = tmp_path / "disk"
    if existed:
        root.mkdir()
        (root / LOCK_FILE_NAME).write_text("pid 1 host elsewhere\n")  # left by an earlier run
    lock = LocalDirLock(root)
    lock.acquire()
    assert lock.created_file is (not existed)
    lock.discard()
    assert not lock.held
    assert (root / LOCK_FILE_NAME).exists() is existed
    again = LocalDirLock(root)  # nothing is left locked either way
    again.acquire()
    again.release()


class RecordingLease:
    def __init__(self, *, busy: bool = False) -> None:
        self.calls: list[str] = []
        self.busy = busy

    def acquire(self) -> None:
        self.calls.append("acquire")
        if self.busy:
            raise DiskPathInUseError(16, "lease held by worker-7")

    def release(self) -> None:
        self.calls.append("release")


def test_lease_seam_is_acquired_before_use_and_released_at_close_or_failure():
    lease = RecordingLease()
    store_obj = MemoryStore()
    cfg = DiskConfig(store=store_obj, capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK, lease=lease)
    store = DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    assert lease.calls == ["acquire"]
    data = random_pages(3, 2)
    extent = store.reserve("a", 3)
    store.write(extent, data)
    store.close()
    assert lease.calls == ["acquire", "release"]
    busy = RecordingLease(busy=True)
    cfg = DiskConfig(store=MemoryStore(), capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK, lease=busy)
    with pytest.raises(DiskPathInUseError, match="worker-7"):
        DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    with pytest.raises(ValueError, match="DiskConfig.lease must have acquire"):
        DiskConfig(store=MemoryStore(), capacity_bytes=CHUNK, lease=object())


def test_clear_refuses_a_bucket_root_and_a_store_with_foreign_keys():
    cfg = DiskConfig(
        path="memory://tiering-test-bucket", capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK
    )
    with pytest.raises(DiskIOError, match="bucket root"):
        DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    mem = MemoryStore()
    sync(mem.set("their/data.bin", default_buffer_prototype().buffer.from_bytes(b"theirs")))
    cfg = DiskConfig(store=mem, capacity_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    with pytest.raises(DiskIOError, match=r"did not write: \['their/data.bin'\]"):
        DiskPageStore(cfg, PAGE_SHAPE, torch.float32)
    assert sync(mem.exists("their/data.bin"))
