"""The vLLM backend's settings (``TieredConfig``, read from vLLM's
``kv_connector_extra_config``), the shared host slab both processes map
(``HostSlab``) and the disk tier it opens (``open_disk``). Nothing here imports
vLLM; ``tiering.integrations.vllm._core`` re-exports these."""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policies.blocks import default_block_registry
from tiering.disk import DiskConfig, DiskPageStore

# ----------------------------------------------------------------------------- config


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    }
)


@dataclass(frozen=True)
class TieredConfig:
    """Our part of ``kv_connector_extra_config``; validated on construction.

    ``host_bytes``: bytes of host slots per rank (required, > 0). ``disk_path`` and
    ``disk_bytes``: the disk tier (both or neither; host only without them).
    ``policy``: a registered block policy name (``policies.blocks``: lru, arc,
    s3fifo, chain; default chain), used for both tiers. ``host_dir``: where
    the shared slab files live (default /dev/shm when present). ``state_path``: a
    JSON file the manager rewrites (off the step path) with its counters and disk
    table, for tests and monitoring. ``demote_headroom``: host slots the manager
    keeps free or backed by disk by writing cold blocks down early (default a
    quarter of the slots). ``io_threads``/``copy_threads``: threads for disk I/O in
    the scheduler and for copies in each worker. ``test_corrupt_loads``: TEST ONLY,
    the worker flips bytes of every block it loads (a negative control).
    """

    host_bytes: int
    disk_path: str | None = None
    disk_bytes: int | None = None
    policy: str = "chain"
    host_dir: str | None = None
    state_path: str | None = None
    demote_headroom: int | None = None
    io_threads: int = 2
    copy_threads: int = 2
    test_corrupt_loads: bool = False

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
        for name in ("host_dir", "state_path"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"kv_connector_extra_config.{name} must be a non-empty str, got {v!r}")
        if self.demote_headroom is not None and (
            not _is_int(self.demote_headroom) or self.demote_headroom < 0
        ):
            raise ValueError(
                "kv_connector_extra_config.demote_headroom must be an int >= 0, "
                f"got {self.demote_headroom!r}"
            )
        for name in ("io_threads", "copy_threads"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"kv_connector_extra_config.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.test_corrupt_loads, bool):
            raise ValueError(
                "kv_connector_extra_config.test_corrupt_loads must be a bool, "
                f"got {self.test_corrupt_loads!r}"
            )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> TieredConfig:
        """Ours from vLLM's extra config (other keys belong to vLLM and are left alone)."""
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        if "host_bytes" not in extra:
            raise ValueError("kv_connector_extra_config.host_bytes is required (bytes of host slots)")
        return cls(**{k: extra[k] for k in OUR_KEYS if k in extra})


# ----------------------------------------------------------------------------- host slab


def default_host_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def slab_path(host_dir: str, engine_id: str, rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(engine_id))
    return os.path.join(host_dir, f"tiering-vllm-{safe}-r{rank}.slab")


class HostSlab:
    """``num_slots`` slots of ``slot_bytes`` in a shared file, mapped as a uint8 tensor.

    Both the manager (scheduler process) and a worker open the same file; whichever
    comes first creates it at its full size (``created``), and the second one removes
    its name as soon as it has mapped it (``unlink_if_second``): both mappings stay,
    and no file is left behind however the processes end. Bytes of a slot are only
    read after the manager has seen them written, so stale contents are never served.
    """

    def __init__(self, path: str, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"host slab {path}: num_slots and slot_bytes must be >= 1")
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = num_slots * slot_bytes
        d = os.path.dirname(path) or "."
        st = os.statvfs(d)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            if have not in (0, size):
                raise ValueError(
                    f"host slab {path} exists with {have} bytes, expected {size} "
                    "(another engine with the same id and a different host_bytes?)"
                )
            self.created = have == 0
            if have == 0:
                if st.f_bavail * st.f_frsize < size:
                    raise ValueError(
                        f"host_bytes: {size} bytes do not fit in {d} "
                        f"({st.f_bavail * st.f_frsize} bytes free); lower host_bytes or set host_dir"
                    )
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8).view(num_slots, slot_bytes)

    def unlink_if_second(self) -> None:
        """Remove the file's name if the other side created it (it has mapped it already)."""
        if not self.created:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self, unlink: bool = False) -> None:
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _write_json(path: str, obj: Mapping[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


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
