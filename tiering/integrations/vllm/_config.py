"""The vLLM backend's settings (``TieredConfig``, read from vLLM's
``kv_connector_extra_config``), the shared host slab both processes map
(``HostSlab``) and the disk tier it opens (``open_disk``). Nothing here imports
vLLM; ``tiering.integrations.vllm._core`` re-exports these."""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import secrets
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiering.disk import DiskConfig, DiskPageStore
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, default_block_registry

log = logging.getLogger("tiering.integrations.vllm._core")

# ----------------------------------------------------------------------------- config


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_THREADS = 64  # io_threads and copy_threads: each is a thread of its own

OUR_KEYS = frozenset(
    {
        "host_bytes",
        "disk_path",
        "disk_bytes",
        "policy",
        "host_dir",
        "state_path",
        "demote_headroom",
        "io_threads",
        "copy_threads",
        "test_corrupt_loads",
        "load_wait_s",
        "staging_dir",
        "shared",
    }
)

# the keys of ``shared`` (the cold tier shared by every engine of a deployment)
SHARED_KEYS = frozenset({"url", "storage_options", "secret", "trust"})

# Keys vLLM's OffloadingConnector and its OffloadingSpec base read from the same
# mapping (vLLM 0.32); they are vLLM's, never checked here.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
    }
)


def unknown_keys(extra: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Keys of ``extra`` that are neither ours nor vLLM's: (misspelt, other).

    A key close to one of ours (``difflib``, ratio >= 0.75) is a misspelling of
    ours; any other unknown key may be a vLLM key newer than this list."""
    misspelt, other = [], []
    for k in extra:
        if k in OUR_KEYS or k in VLLM_KEYS:
            continue
        if isinstance(k, str) and difflib.get_close_matches(k, OUR_KEYS, n=1, cutoff=0.75):
            misspelt.append(k)
        else:
            other.append(str(k))
    return misspelt, other


@dataclass(frozen=True)
class TieredConfig:
    """Our part of ``kv_connector_extra_config``; validated on construction.

    ``host_bytes``: bytes of host slots per rank (required, > 0). ``disk_path`` and
    ``disk_bytes``: the disk tier (both or neither; host only without them).
    ``policy``: a registered block policy name (``tiering.policies.blocks``: adaptive,
    arc, chain, lirs, lru, s3fifo; default ``DEFAULT_BLOCK_POLICY``), used for both tiers. ``host_dir``: where
    the shared slab files live (default /dev/shm when present). ``state_path``: a
    JSON file the manager rewrites (off the step path) with its counters and disk
    table, for tests and monitoring. ``demote_headroom``: host slots the manager
    keeps free or backed by disk by writing cold blocks down early (default: all
    of them, i.e. write-through). ``load_wait_s``: the longest a request's lookup
    answers "pending" (a block being promoted or stored); after it, blocks not on
    host answer "miss" and vLLM recomputes them. ``staging_dir``: where a store
    batch larger than the free host slots is written by the workers on its way
    to the disk tier (default ``<disk_path>.staging``). ``shared``: the cold
    tier every engine of a deployment shares (needs the disk tier): ``url``
    (``s3://bucket/prefix``), ``storage_options`` (``tiering.coldtier.open_s3_store``'s),
    ``secret`` (the deployment secret; default: the environment variable
    ``TIERING_COLDTIER_SECRET``) or ``trust: "unauthenticated"``. ``io_threads``/``copy_threads``: threads for disk I/O in
    the scheduler and for copies in each worker. ``test_corrupt_loads``: TEST ONLY,
    the worker flips bytes of every block it loads (a negative control).
    """

    host_bytes: int
    disk_path: str | None = None
    disk_bytes: int | None = None
    policy: str = DEFAULT_BLOCK_POLICY
    host_dir: str | None = None
    state_path: str | None = None
    demote_headroom: int | None = None
    io_threads: int = 2
    copy_threads: int = 2
    test_corrupt_loads: bool = False
    load_wait_s: float = 2.0
    staging_dir: str | None = None
    shared: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.host_bytes) or self.host_bytes <= 0:
            raise ValueError(
                f"kv_connector_extra_config.host_bytes must be a positive int, got {self.host_bytes!r}"
            )
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError(
                "kv_connector_extra_config.disk_path and disk_bytes must be given together "
                f"(got disk_path={self.disk_path!r}, disk_bytes={self.disk_bytes!r})"
            )
        if self.disk_path is not None and (
            not isinstance(self.disk_path, str) or not self.disk_path
        ):
            raise ValueError(
                f"kv_connector_extra_config.disk_path must be a non-empty str, got {self.disk_path!r}"
            )
        if self.disk_bytes is not None and (not _is_int(self.disk_bytes) or self.disk_bytes <= 0):
            raise ValueError(
                f"kv_connector_extra_config.disk_bytes must be a positive int, got {self.disk_bytes!r}"
            )
        names = default_block_registry().names
        if not isinstance(self.policy, str) or self.policy not in names:
            raise ValueError(
                "kv_connector_extra_config.policy must be one of the registered block "
                f"policies {', '.join(names)}; got {self.policy!r}"
            )
        for name in ("host_dir", "state_path", "staging_dir"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"kv_connector_extra_config.{name} must be a non-empty str, got {v!r}")
        if self.host_dir is not None and not os.path.isdir(self.host_dir):
            raise ValueError(
                f"kv_connector_extra_config.host_dir must be an existing directory, "
                f"got {self.host_dir!r}"
            )
        if self.state_path is not None:
            parent = os.path.dirname(os.path.abspath(self.state_path))
            if os.path.isdir(self.state_path) or not os.path.isdir(parent):
                raise ValueError(
                    "kv_connector_extra_config.state_path must be a file path in an existing "
                    f"directory, got {self.state_path!r}"
                )
        if self.disk_path is not None and os.path.exists(self.disk_path) and not os.path.isdir(
            self.disk_path
        ):
            raise ValueError(
                f"kv_connector_extra_config.disk_path must be a directory, got {self.disk_path!r} "
                "(an existing file)"
            )
        if self.demote_headroom is not None and (
            not _is_int(self.demote_headroom) or self.demote_headroom < 0
        ):
            raise ValueError(
                "kv_connector_extra_config.demote_headroom must be an int >= 0, "
                f"got {self.demote_headroom!r}"
            )
        for name in ("io_threads", "copy_threads"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= MAX_THREADS:
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be an int from 1 to {MAX_THREADS}, "
                    f"got {v!r}"
                )
        if (
            isinstance(self.load_wait_s, bool)
            or not isinstance(self.load_wait_s, (int, float))
            or not math.isfinite(self.load_wait_s)
            or self.load_wait_s < 0
        ):
            raise ValueError(
                "kv_connector_extra_config.load_wait_s must be a finite number of seconds "
                f">= 0, got {self.load_wait_s!r}"
            )
        if self.staging_dir is not None and self.disk_path is None:
            raise ValueError(
                "kv_connector_extra_config.staging_dir needs a disk tier (disk_path and "
                f"disk_bytes); got staging_dir={self.staging_dir!r} without one"
            )
        if self.staging_dir is not None and os.path.exists(self.staging_dir) and not (
            os.path.isdir(self.staging_dir)
        ):
            raise ValueError(
                f"kv_connector_extra_config.staging_dir must be a directory, got "
                f"{self.staging_dir!r} (an existing file)"
            )
        if self.shared is not None:
            self.shared_config()  # checked here; opened (and probed) by the spec
        if not isinstance(self.test_corrupt_loads, bool):
            raise ValueError(
                "kv_connector_extra_config.test_corrupt_loads must be a bool, "
                f"got {self.test_corrupt_loads!r}"
            )

    def shared_config(self):
        """``shared`` as a ``tiering.coldtier.SharedTierConfig`` (no I/O), or None."""
        if self.shared is None:
            return None
        if not isinstance(self.shared, Mapping):
            raise ValueError("kv_connector_extra_config.shared must be a mapping (url, "
                             f"storage_options, secret, trust), got {self.shared!r}")
        bad = sorted(str(k) for k in self.shared if k not in SHARED_KEYS)
        if bad:
            raise ValueError(f"kv_connector_extra_config.shared: unknown key(s) {bad}; its keys "
                             f"are {', '.join(sorted(SHARED_KEYS))}")
        if self.disk_path is None:
            raise ValueError("kv_connector_extra_config.shared needs the disk tier (disk_path "
                             "and disk_bytes): shared blocks are fetched into it")
        url = self.shared.get("url")
        if not isinstance(url, str) or not url.startswith(("s3://", "s3a://")):
            raise ValueError("kv_connector_extra_config.shared.url must be an s3:// URL, "
                             f"got {url!r}")
        from tiering.coldtier import SharedTierConfig, TrustConfig

        trust = self.shared.get("trust", "authenticated")
        secret = self.shared.get("secret")
        try:
            tc = TrustConfig(secret=secret, trust=trust)
            return SharedTierConfig(url, self.shared.get("storage_options"), trust=tc)
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config.shared: {exc}") from None

    @property
    def staging(self) -> str | None:
        """The staging directory in use (None without a disk tier)."""
        if self.disk_path is None:
            return None
        return self.staging_dir or self.disk_path.rstrip(os.sep) + ".staging"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> TieredConfig:
        """Ours from vLLM's extra config. vLLM's own keys are left alone; a key that
        looks like a misspelling of ours is a ValueError listing our keys; any other
        unknown key is logged (it may be a newer vLLM's) and left to vLLM."""
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        misspelt, other = unknown_keys(extra)
        if misspelt:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, misspelt))}; "
                f"the keys of TieredOffloadingSpec are {', '.join(sorted(OUR_KEYS))} "
                f"(vLLM's own: {', '.join(sorted(VLLM_KEYS))})"
            )
        if other:
            log.warning("tiering: kv_connector_extra_config key(s) %s are not ours; left to vLLM",
                        ", ".join(sorted(other)))
        if "host_bytes" not in extra:
            raise ValueError("kv_connector_extra_config.host_bytes is required (bytes of host slots)")
        return cls(**{k: extra[k] for k in OUR_KEYS if k in extra})


# ----------------------------------------------------------------------------- host slab


def default_host_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def slab_path(host_dir: str, engine_id: str, rank: int) -> str:
    """The slab file of one engine's rank. Distinct engine ids give distinct names
    (the id's readable part, at most 64 characters, then a hash of the whole id), and
    the name fits any filesystem however long the id is."""
    if not _is_int(rank) or rank < 0:
        raise ValueError(f"host slab: rank must be an int >= 0, got {rank!r}")
    eid = str(engine_id)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in eid)[:64]
    digest = hashlib.sha256(eid.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(host_dir, f"tiering-vllm-{safe}-{digest}-r{rank}.slab")


class HostSlab:
    """``num_slots`` slots of ``slot_bytes`` in a shared file, mapped as a uint8 tensor.

    Both the manager (scheduler process) and a worker open the same file. The first
    creates it at its full size under a private name, takes an exclusive ``flock``
    on it, holds that lock while it is open, and then publishes the file under
    ``path`` (``created``). The second finds the file locked (a live creator),
    maps it, and removes its name (``unlink_if_second``): both mappings stay. A
    file under ``path`` that nobody holds locked is a leftover of a process that
    ended before its partner came: it is removed and a fresh slab is created, so a
    side never pairs with a dead one (it would read bytes the other side never
    sees). ``close`` removes the name whenever it still names this slab, so nothing
    is left behind after shutdown. Two live engines must not share an engine id
    in one ``host_dir`` (vLLM's default engine id is random).
    """

    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        for name, v in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"host slab {path}: {name} must be an int >= 1, got {v!r}")
        d = os.path.dirname(path) or "."
        if not os.path.isdir(d):
            raise ValueError(
                f"kv_connector_extra_config.host_dir {d!r} is not a directory (host slab {path})"
            )
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._ino: tuple[int, int] | None = None
        size = num_slots * slot_bytes
        for _ in range(8):  # bounded: another process may create or replace it meanwhile
            fd = self._join(path, size)
            if fd is None:
                fd = self._create(path, size, d)
            if fd is not None:
                break
        else:
            raise ValueError(f"host slab {path}: the file keeps being replaced; not opened")
        try:
            st = os.fstat(fd)
            self._ino = (st.st_dev, st.st_ino)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if self.created:  # the creator's descriptor holds the lock until close (or collection)
            self._finalizer = weakref.finalize(self, os.close, fd)
        else:
            os.close(fd)
            self._finalizer = None
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8).view(num_slots, slot_bytes)

    def _join(self, path: str, size: int) -> int | None:
        """The descriptor of a live creator's file (``created`` False), or None when
        there is none (a leftover nobody holds is removed)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its creator is alive
            have = os.fstat(fd).st_size
            if have != size:
                os.close(fd)
                raise ValueError(
                    f"host slab {path} exists with {have} bytes, expected {size} "
                    "(another engine with the same id and a different host_bytes?)"
                ) from None
            self.created = False
            return fd
        except BaseException:
            os.close(fd)
            raise
        if _remove_unheld(fd, path):  # nobody holds it: a leftover of a process that is gone
            log.warning("tiering: removed a leftover host slab %s (no live process held it)",
                        path)
        return None

    def _create(self, path: str, size: int, d: str) -> int | None:
        """A new file at its full size, locked, published under ``path`` (``created``);
        None when another process published one first."""
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize < size:
            raise ValueError(
                f"host_bytes: {size} bytes do not fit in {d} "
                f"({st.f_bavail * st.f_frsize} bytes free); lower host_bytes or set host_dir"
            )
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(6)}.new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            try:
                os.link(tmp, path)  # atomic: fails if another side published first
            except FileExistsError:
                os.close(fd)
                fd = -1
                return None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self.created = True
        return fd

    def unlink_if_second(self) -> None:
        """Remove the file's name if the other side created it (it has mapped it already)."""
        if not self.created:
            self._unlink_if_ours()

    def _unlink_if_ours(self) -> None:
        try:
            st = os.stat(self.path)
            if self._ino == (st.st_dev, st.st_ino):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap the slab and drop the creator's lock; the file's name goes if it still
        names this slab (a partner that has not mapped it by now never will).
        Idempotent."""
        self.tensor = None  # type: ignore[assignment]
        self._unlink_if_ours()
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if self._finalizer is not None:
            self._finalizer()  # closes the creator's descriptor (once), dropping the lock


def remove_leftover_slabs(host_dir: str) -> list[str]:
    """Remove the slab files in ``host_dir`` that no live process holds (left by
    processes that died before their partner mapped the file); the paths removed.
    A slab being paired is held by its creator's lock and stays; files with other
    names are never touched."""
    removed = []
    try:
        names = os.listdir(host_dir)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith("tiering-vllm-") and name.endswith(".slab")):
            continue
        path = os.path.join(host_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, a link, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live creator holds it
        if _remove_unheld(fd, path):
            removed.append(path)
    if removed:
        log.warning("tiering: removed %d leftover host slab file(s) in %s", len(removed), host_dir)
    return removed


def _remove_unheld(fd: int, path: str) -> bool:
    """Remove ``path`` if it still names the file of ``fd``, which this process has just
    locked (so no live creator holds it); close ``fd``. Whether the name was removed."""
    try:
        if _same_file(fd, path):
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    return False


def _same_file(fd: int, path: str) -> bool:
    a, b = os.fstat(fd), os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_json(path: str, obj: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically through a temporary file created exclusively (O_EXCL, a
    random name, mode 0600) in the same directory: a name planted there is never followed."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_disk(cfg: TieredConfig, page_bytes: int, fingerprint: str) -> DiskPageStore | None:
    """The disk tier for pages of ``page_bytes`` (one page per chunk), or None."""
    if cfg.disk_path is None:
        return None
    assert cfg.disk_bytes is not None
    if cfg.disk_bytes < page_bytes:
        raise ValueError(
            f"kv_connector_extra_config.disk_bytes {cfg.disk_bytes} is smaller than one block "
            f"({page_bytes} bytes)"
        )
    return DiskPageStore(
        DiskConfig(
            path=cfg.disk_path,
            capacity_bytes=cfg.disk_bytes,
            chunk_bytes=page_bytes,
            io_threads=1,
            io_timeout_s=60.0,
        ),
        (page_bytes,),
        torch.uint8,
        fingerprint=fingerprint,
    )
