"""A zarr store on an object-store prefix that one worker holds by lease (the disk tier on s3://).

:func:`hold_zarr_prefix` opens ``s3://bucket/prefix`` (probing it: :class:`ColdTierUnavailable`
if it cannot be reached), takes the lease object ``<prefix>/LEASE`` (:class:`LeaseHeld`, naming
the URL and the holder, if another live worker has it) and renews it on a thread. The zarr store
it returns, :class:`LeasedZarrStore`, wraps ``zarr.storage.ObjectStore`` so that:

- every write (``set``, ``set_if_not_exists``, ``delete``, ``delete_dir``, ``clear``) first
  checks that the lease is still held, a local check with no request. A lost or expired lease
  fails the write with :class:`PrefixLeaseLost` (an ``OSError``, errno ``ENOLCK``) before
  anything is sent. A write already on the wire when the lease is lost cannot be recalled:
  the store has no fencing;
- a :class:`CircuitBreaker` sits in front of every request. A connection error, timeout or
  5xx opens it. While it is open, requests fail at once with :class:`StoreNotAnswering`
  (``OSError``, errno ``EAGAIN``) and make no request, so a store that stopped answering costs
  one client timeout per I/O thread, not one per queued write. After the cooldown one request
  is the trial; the others wait for its outcome (at most the client timeout) and go on if it
  succeeded. Other transient faults are
  raised as :class:`StoreNotAnswering` with errno ``ETIMEDOUT``, ``ECONNREFUSED`` or ``EREMOTEIO``;
- the lease object is invisible: listings leave it out, a clear keeps it, and a write or
  delete of its key is refused (``PermissionError``). A clear therefore removes exactly what
  is under the prefix except the lease, never anything outside the prefix.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from tiering.errors import PrefixLeaseLost, StoreNotAnswering

from ._io import Fault, classify, short
from .breaker import BreakerConfig, BreakerState, CircuitBreaker
from .errors import LeaseHeld
from .lease import Lease, LeaseConfig, LeaseKeeper

__all__ = ["LEASE_KEY", "HeldPrefix", "LeasedZarrStore", "PrefixLeaseLost", "StoreNotAnswering",
           "hold_zarr_prefix"]

LEASE_KEY = "LEASE"  # the lease object, relative to the held prefix
_T = TypeVar("_T")


def _transient_errno(exc: BaseException) -> int:
    text = f"{type(exc).__name__} {exc}".lower()
    if "timed out" in text or "timeout" in text:
        return errno.ETIMEDOUT
    if "connection refused" in text or "connect" in text:
        return errno.ECONNREFUSED
    return errno.EREMOTEIO  # it answered, with a server error (5xx) or refused credentials


def _from_the_store(exc: BaseException) -> bool:
    """An error of the client or the connection (not a bug in the caller's arguments)."""
    try:
        from obstore.exceptions import BaseError
    except ImportError:  # pragma: no cover - the extra is required to get here
        return isinstance(exc, OSError)
    return isinstance(exc, (BaseError, OSError, TimeoutError))


class LeasedZarrStore(WrapperStore[Store]):
    """``zarr.storage.ObjectStore`` guarded by a lease and a breaker (see the module docstring)."""

    def __init__(self, store: Store, *, lease: Lease, breaker: CircuitBreaker, where: str,
                 trial_wait_s: float = 10.0) -> None:
        super().__init__(store)
        self.lease = lease
        self.breaker = breaker
        self.where = where
        self.trial_wait_s = trial_wait_s

    def _with_store(self, store: Store) -> LeasedZarrStore:
        return LeasedZarrStore(store, lease=self.lease, breaker=self.breaker, where=self.where,
                               trial_wait_s=self.trial_wait_s)

    def __repr__(self) -> str:
        return f"LeasedZarrStore({self.where!r})"

    # -- guards -----------------------------------------------------------------------------
    def _check_write(self, key: str) -> None:
        if key.rstrip("/") == LEASE_KEY:
            raise PermissionError(errno.EPERM, f"{self.where}: {LEASE_KEY!r} is the prefix's lease "
                                               "object, not a key of the store")
        if not self.lease.held:
            why = self.lease.lost_reason or "its lease expired without renewal"
            raise PrefixLeaseLost(errno.ENOLCK, f"{self.where}: this worker no longer holds the "
                                                f"prefix ({why}); nothing was written")

    async def _call(self, aw: Awaitable[_T]) -> _T:
        """Await one request through the breaker; transient faults become StoreNotAnswering."""
        if not await self._admitted():
            if hasattr(aw, "close"):
                aw.close()  # never started: no request is made
            raise StoreNotAnswering(errno.EAGAIN, f"{self.where}: the store stopped answering; "
                                                  "no request made until its cooldown has passed")
        try:
            out = await aw
        except Exception as exc:
            if not _from_the_store(exc) or classify(exc) is not Fault.TRANSIENT:
                self.breaker.record_success()  # it answered (missing, exists, ...), or not its fault
                raise
            self.breaker.record_failure()
            raise StoreNotAnswering(_transient_errno(exc), f"{self.where}: {short(exc)}") from exc
        self.breaker.record_success()
        return out

    async def _admitted(self) -> bool:
        """May a request go now? While a half-open breaker's one trial is out, wait for its
        outcome (at most ``trial_wait_s``, checked every 20 ms on the event loop, which the
        trial itself needs): a write of several chunks then goes on once the trial succeeded,
        instead of failing because its other chunks were not the trial."""
        deadline = time.monotonic() + self.trial_wait_s
        while True:
            if self.breaker.allow():
                return True
            if self.breaker.state is not BreakerState.HALF_OPEN or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    async def _keys(self, it: AsyncIterator[str]) -> list[str]:
        async def collect() -> list[str]:
            return [k async for k in it]

        return [k for k in await self._call(collect()) if k != LEASE_KEY]

    async def _iterate(self, it: AsyncIterator[str]) -> AsyncIterator[str]:
        for key in await self._keys(it):
            yield key

    # -- reads ------------------------------------------------------------------------------
    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if key == LEASE_KEY:
            return None
        return await self._call(self._store.get(key, prototype, byte_range))

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        ranges = list(key_ranges)
        got = await self._call(self._store.get_partial_values(prototype, ranges))
        return [None if k == LEASE_KEY else v for (k, _), v in zip(ranges, got, strict=True)]

    async def exists(self, key: str) -> bool:
        return key != LEASE_KEY and await self._call(self._store.exists(key))

    async def is_empty(self, prefix: str) -> bool:
        async for _ in self.list_prefix(prefix):
            return False
        return True

    def list(self) -> AsyncIterator[str]:
        return self._iterate(self._store.list())

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        return self._iterate(self._store.list_prefix(prefix))

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        return self._iterate(self._store.list_dir(prefix))

    # -- writes -----------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_write(key)
        await self._call(self._store.set(key, value))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self._check_write(key)
        await self._call(self._store.set_if_not_exists(key, value))

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in values:
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        self._check_write(key)
        await self._call(self._store.delete(key))

    async def delete_dir(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (all of the held prefix for ""), except the lease."""
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        for key in await self._keys(self._store.list_prefix(prefix)):
            await self.delete(key)

    async def clear(self) -> None:
        await self.delete_dir("")


class HeldPrefix(NamedTuple):
    """A zarr store on a prefix this worker holds by lease (what the disk tier opens on s3://)."""

    zarr_store: LeasedZarrStore
    lease: Lease
    keeper: LeaseKeeper | None
    breaker: CircuitBreaker
    url: str

    def close(self) -> None:
        """Stop renewing and release the lease (an expired lease, conditioned on its ETag)."""
        if self.keeper is not None:
            self.keeper.stop()
        self.lease.release()


def hold_zarr_prefix(url: str, storage_options=None, *, owner: str,
                     lease_config: LeaseConfig | None = None, clock: Callable[[], float] = time.time,
                     renew: bool = True, breaker: CircuitBreaker | None = None,
                     monotonic: Callable[[], float] = time.monotonic, **open_kwargs: Any) -> HeldPrefix:
    """Open ``url`` (s3://bucket/prefix) as a zarr store that this worker holds exclusively.

    The store is probed (ColdTierUnavailable if it cannot be reached or refuses the
    credentials), then the lease object ``<prefix>/LEASE`` is taken (LeaseHeld, naming the URL
    and the holder, if another live worker holds it) and renewed on a thread every
    ``lease_config.renew_every_s``. ``clock`` is the wall clock leases compare; ``monotonic``
    the breaker's clock (``breaker`` replaces the default one, threshold 1, cooldown 5 s)."""
    import zarr.storage

    from .s3 import open_s3_store, parse_s3_url

    loc = parse_s3_url(url)
    if not loc.prefix:
        raise ValueError(f"{url!r} names a bucket root; a held prefix needs a prefix of its own")
    store = open_s3_store(url, storage_options, **open_kwargs)
    lease = Lease(store, LEASE_KEY, owner, config=lease_config, clock=clock)
    try:
        lease.acquire()
    except LeaseHeld as exc:
        raise LeaseHeld(f"{url}: {exc}") from exc
    keeper = LeaseKeeper(lease).start() if renew else None
    breaker = breaker or CircuitBreaker(BreakerConfig(), clock=monotonic)
    # a request waits for a half-open trial at most as long as the trial may take
    trial_wait_s = float(dict(storage_options or {}).get("timeout_s", open_kwargs.get("timeout_s", 10.0)))
    guarded = LeasedZarrStore(zarr.storage.ObjectStore(store), lease=lease, breaker=breaker, where=url,
                              trial_wait_s=trial_wait_s)
    return HeldPrefix(guarded, lease, keeper, breaker, url)
