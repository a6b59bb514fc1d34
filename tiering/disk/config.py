"""Configuration of the disk tier: where its pages live, how much it may hold, how it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from zarr.abc.store import Store
from zarr.storage import StorePath

from tiering.core.frozen import frozen_nested
from tiering.core.validate import check_threads, check_waitable
from tiering.disk.array import CODECS

ON_START = ("clear", "reattach")
S3_SCHEMES = ("s3", "s3a")  # opened through obstore and held by a lease object


def s3_url(path: str | os.PathLike[str] | None) -> str | None:
    """``path`` as a str when it is an s3:// (or s3a://) URL, else None."""
    if path is None:
        return None
    text = os.fspath(path)
    return text if urlsplit(text).scheme in S3_SCHEMES and "://" in text else None


# the ledger keeps per-page state in memory (a byte a page, more while it checks itself):
# past this many pages a capacity is refused by name rather than ending in a MemoryError
MAX_DISK_PAGES = 1 << 30


def check_capacity_pages(capacity_bytes: int, page_bytes: int) -> int:
    """``capacity_bytes // page_bytes``, the disk tier's page count; ValueError naming
    ``DiskConfig.capacity_bytes`` when it is more than ``MAX_DISK_PAGES``."""
    pages = int(capacity_bytes) // int(page_bytes)
    if pages > MAX_DISK_PAGES:
        raise ValueError(
            f"DiskConfig.capacity_bytes {capacity_bytes} is {pages} pages of {page_bytes} "
            f"bytes; the disk tier holds at most {MAX_DISK_PAGES} pages "
            f"({MAX_DISK_PAGES * int(page_bytes)} bytes for this page size), since its "
            "ledger keeps per-page state in memory"
        )
    return pages


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DiskConfig:
    """How the disk tier is stored and sized; validated on construction.

    ``path``: local directory or URL (``file://`` is local; other schemes go to
    fsspec). ``store``: a zarr store or StorePath used instead of ``path``; the
    disk tier owns it (a clear empties the whole store, or a StorePath's prefix, and refuses one holding keys the tier did not write).
    ``capacity_bytes``: the hard cap of the ledger. ``codec``: ``none`` (default),
    ``zstd`` or ``blosc`` (bitshuffle); crc32c is always applied.
    ``chunk_bytes``: the I/O batch: one job moves up to this many bytes of
    adjacent pages (allocation is per page whatever it is). ``on_start``:
    ``clear`` or ``reattach``. ``io_threads``: chunk operations one read or write
    keeps in flight (the local slot store also keeps ``2 * io_threads`` reusable
    chunk-sized read buffers). ``io_timeout_s``: the longest one read or write may
    take. ``lease``: for a store that is not a local directory, an object with
    ``acquire()`` / ``release()`` (``tiering.disk.lock.PathLease``) that holds the
    location exclusively; a local directory is always held by an OS lock.
    ``storage_options``: for a URL path, the store's options: for ``s3://bucket/prefix``
    the endpoint, region, credentials and client timeouts that
    ``tiering.coldtier.open_s3_store`` takes (an option left out comes from the ``AWS_*``
    environment variables); for another fsspec URL, what its filesystem takes. An s3://
    path is opened through obstore, probed at start-up, and held by a lease object
    ``<prefix>/LEASE`` (``lease_ttl_s``, renewed every third of it); it must name a prefix,
    never a bucket root, and takes no ``lease`` of its own. ``trust``: for an s3:// path, the
    ``tiering.coldtier.TrustConfig`` whose deployment secret keys the MAC on every chunk's
    binding record; None reads ``TIERING_COLDTIER_SECRET`` if it is set, else the tier keys its
    MAC with a random key of its own (chunks are still authenticated, but a later process cannot
    reattach them: ``on_start="reattach"`` then starts empty).
    """

    path: str | os.PathLike[str] | None = None
    capacity_bytes: int = 0
    store: Any = None
    codec: str = "none"
    chunk_bytes: int = 32 << 20
    on_start: str = "clear"
    io_threads: int = 2
    io_timeout_s: float = 120.0
    lease: Any = None
    storage_options: Mapping[str, Any] | None = None
    lease_ttl_s: float = 30.0
    trust: Any = None

    def __post_init__(self) -> None:
        if self.lease is not None and not all(
            callable(getattr(self.lease, name, None)) for name in ("acquire", "release")
        ):
            raise ValueError(
                "DiskConfig.lease must have acquire() and release() methods "
                f"(tiering.disk.lock.PathLease), got {type(self.lease).__name__}"
            )
        if self.store is None and self.path is None:
            raise ValueError("DiskConfig.path or DiskConfig.store must be given")
        if self.store is not None and not isinstance(self.store, (Store, StorePath)):
            raise ValueError(
                f"DiskConfig.store must be a zarr Store or StorePath, got {type(self.store).__name__}"
            )
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(
                f"DiskConfig.path must be a str or os.PathLike, got {type(self.path).__name__}"
            )
        if self.path is not None and not os.fspath(self.path):
            raise ValueError("DiskConfig.path must not be empty")
        if not _is_int(self.capacity_bytes) or self.capacity_bytes <= 0:
            raise ValueError(
                f"DiskConfig.capacity_bytes must be a positive int, got {self.capacity_bytes!r}"
            )
        if self.codec not in CODECS:
            raise ValueError(f"DiskConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if not _is_int(self.chunk_bytes) or self.chunk_bytes <= 0:
            raise ValueError(
                f"DiskConfig.chunk_bytes must be a positive int, got {self.chunk_bytes!r}"
            )
        if self.on_start not in ON_START:
            raise ValueError(
                f"DiskConfig.on_start must be one of {ON_START}, got {self.on_start!r}"
            )
        if not _is_int(self.io_threads) or self.io_threads < 1:
            raise ValueError(f"DiskConfig.io_threads must be an int >= 1, got {self.io_threads!r}")
        check_threads("DiskConfig.io_threads", self.io_threads)
        if (
            not isinstance(self.io_timeout_s, (int, float))
            or isinstance(self.io_timeout_s, bool)
            or not 0 < self.io_timeout_s < float("inf")
        ):
            raise ValueError(
                f"DiskConfig.io_timeout_s must be a finite number > 0, got {self.io_timeout_s!r}")
        check_waitable("DiskConfig.io_timeout_s", self.io_timeout_s)
        self._check_storage()

    def _check_storage(self) -> None:
        """The URL-related fields; ValueError naming what is wrong (nothing is opened)."""
        if (
            not isinstance(self.lease_ttl_s, (int, float))
            or isinstance(self.lease_ttl_s, bool)
            or not 0 < self.lease_ttl_s < float("inf")
        ):
            raise ValueError(
                f"DiskConfig.lease_ttl_s must be a finite number > 0, got {self.lease_ttl_s!r}"
            )
        opts = self.storage_options
        if opts is not None:
            if not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
                raise ValueError(
                    "DiskConfig.storage_options must be a mapping of option names (str) "
                    f"to values, got {opts!r:.100}"
                )
            path = None if self.path is None else os.fspath(self.path)
            if self.store is not None or path is None or "://" not in path or path.startswith("file:"):
                raise ValueError(
                    "DiskConfig.storage_options applies only to a URL path (s3://, gcs://, ...), "
                    f"not to {'a given store' if self.store is not None else repr(path)}"
                )
            # a read-only copy: the caller's dict may change later, this config may not
            object.__setattr__(self, "storage_options", frozen_nested(opts))
        url = s3_url(self.path) if self.store is None else None
        if url is None:
            if self.trust is not None:
                raise ValueError("DiskConfig.trust applies only to an s3:// path (its chunks' MAC)")
            return
        from tiering.coldtier.s3 import check_storage_options, parse_s3_url

        try:
            loc = parse_s3_url(url)
        except ValueError as exc:  # its message speaks of a cold tier URL; this is ours
            raise ValueError(f"DiskConfig.path {url!r} is not a usable s3:// URL: {exc}") from exc
        if not loc.prefix:
            raise ValueError(
                f"DiskConfig.path {url!r} names a bucket root; give the disk tier a prefix of "
                "its own (s3://bucket/prefix): a clear there would destroy other data"
            )
        if self.lease is not None:
            raise ValueError(
                f"DiskConfig.lease: an s3:// path ({url!r}) is held by its own lease object; "
                "do not pass one"
            )
        check_storage_options(self.storage_options)  # ValueError naming the option
        if self.trust is not None:
            from tiering.coldtier.trust import TrustConfig

            if not isinstance(self.trust, TrustConfig):
                raise ValueError(f"DiskConfig.trust must be a tiering.coldtier.TrustConfig or None,"
                                 f" got {type(self.trust).__name__}")
