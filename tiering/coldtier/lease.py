"""A lease object that gives one worker a prefix exclusively, by conditional put.

The lease is a small JSON object ``{"owner", "token", "expires_at"}`` at a fixed path. Acquire
writes it by create-if-absent; if one is there and has expired on the (injected, wall) clock,
it is taken over by a put conditioned on the ETag that was read, so of two workers racing for
an expired lease exactly one wins. Renewal is the same ETag-conditioned put. A renewal refused
with 412 re-reads the lease first: a renewal whose reply was lost changed the ETag while the
store still holds this worker's token, and then the lease is still ours (renewed again on the
ETag just read). Only a lease holding another token, or none, means another worker took it
over: this worker must stop writing (:meth:`Lease.renew` returns False and :attr:`Lease.held`
turns False). A lease object is read with a ranged GET of at most ``MAX_LEASE_BYTES``; a larger
one is unreadable (treated as expired). Release overwrites the
lease, conditioned on its ETag, with an already expired one (never a blind delete, which could
remove a successor's lease).

Workers compare ``expires_at`` from different hosts, so their clocks must agree to well within
``ttl_s - renew_every_s``; a worker treats its own lease as held only until
``expires_at - safety_s``.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tiering.core.validate import check_fields, check_timeout, check_waitable

from ._io import Fault, classify, short
from .errors import ColdTierUnavailable, LeaseHeld

__all__ = ["MAX_LEASE_BYTES", "Lease", "LeaseConfig", "LeaseInfo", "LeaseKeeper"]

MAX_LEASE_BYTES = 4096  # a lease is ~150 bytes of JSON; nothing larger is downloaded


@dataclass(frozen=True)
class LeaseConfig:
    ttl_s: float = 30.0
    renew_every_s: float = 10.0
    safety_s: float = 2.0

    def __post_init__(self) -> None:
        check_fields(self, numbers=("ttl_s", "renew_every_s"), zero_ok=("safety_s",))
        if not math.isfinite(self.ttl_s):  # a lease that never expires outlives a dead holder
            raise ValueError(f"LeaseConfig.ttl_s must be finite, got {self.ttl_s!r}")
        check_waitable("LeaseConfig.renew_every_s", self.renew_every_s)  # its keeper waits it
        if self.renew_every_s + self.safety_s >= self.ttl_s:
            raise ValueError(
                f"LeaseConfig: renew_every_s ({self.renew_every_s}) + safety_s ({self.safety_s}) "
                f"must be less than ttl_s ({self.ttl_s})")


class LeaseInfo(NamedTuple):
    owner: str
    token: str
    expires_at: float
    e_tag: str | None


class Lease:
    def __init__(self, store, path: str, owner: str, *, config: LeaseConfig | None = None,
                 clock: Callable[[], float] = time.time,
                 token_factory: Callable[[], str] = lambda: secrets.token_hex(8)) -> None:
        if not isinstance(owner, str) or not owner or len(owner) > 200:
            raise ValueError(f"lease owner must be a non-empty str of at most 200 chars, got {owner!r}")
        if not isinstance(path, str) or not path or path.startswith("/"):
            raise ValueError(f"lease path must be a relative object path, got {path!r}")
        if config is not None and not isinstance(config, LeaseConfig):
            raise ValueError(f"lease config must be a LeaseConfig, got {type(config).__name__}")
        self.store = store
        self.path = path
        self.owner = owner
        self.config = config or LeaseConfig()
        self._clock = clock
        self._token_factory = token_factory
        self._lock = threading.Lock()
        self._info: LeaseInfo | None = None
        self.lost_reason = ""

    # -- state ------------------------------------------------------------------------------
    @property
    def info(self) -> LeaseInfo | None:
        with self._lock:
            return self._info

    @property
    def held(self) -> bool:
        """Held and not within ``safety_s`` of expiry on our clock."""
        with self._lock:
            return self._info is not None and self._clock() < self._info.expires_at - self.config.safety_s

    # -- operations -------------------------------------------------------------------------
    def acquire(self) -> LeaseInfo:
        """Take the lease; LeaseHeld if another worker holds it, ColdTierUnavailable if the store
        does not answer. Takes over a lease that expired."""
        import obstore

        token = self._token_factory()
        for _attempt in range(3):
            body, expires = self._body(token)
            try:
                res = obstore.put(self.store, self.path, body, mode="create")
                return self._set(token, expires, res)
            except Exception as exc:
                fault = classify(exc)
                if fault not in (Fault.EXISTS, Fault.PRECONDITION):
                    raise ColdTierUnavailable(f"cannot write lease {self.path}: {short(exc)}") from exc
            current = self._read()
            if current is None:
                continue  # released and removed between our two requests: create again
            if current.expires_at > self._clock():
                raise LeaseHeld(
                    f"prefix lease {self.path} is held by {current.owner!r} until "
                    f"{current.expires_at:.3f} ({current.expires_at - self._clock():.1f} s from now)")
            body, expires = self._body(token)
            try:
                res = obstore.put(self.store, self.path, body, mode={"e_tag": current.e_tag})
                return self._set(token, expires, res)
            except Exception as exc:
                if classify(exc) in (Fault.PRECONDITION, Fault.EXISTS):
                    raise LeaseHeld(f"prefix lease {self.path}: another worker took the expired lease "
                                    f"of {current.owner!r} first") from exc
                raise ColdTierUnavailable(f"cannot take over lease {self.path}: {short(exc)}") from exc
        raise LeaseHeld(f"prefix lease {self.path} keeps changing; try again")

    def renew(self) -> bool:
        """Extend the lease. False if it was lost (taken over, or never held); a transient store
        fault also returns False but keeps the lease until its expiry (check :attr:`held`)."""
        import obstore

        with self._lock:
            info = self._info
        if info is None:
            return False
        e_tag = info.e_tag
        for _attempt in range(2):
            body, expires = self._body(info.token)
            try:
                res = obstore.put(self.store, self.path, body, mode={"e_tag": e_tag})
            except Exception as exc:
                if classify(exc) not in (Fault.PRECONDITION, Fault.MISSING, Fault.EXISTS):
                    return False  # transient: still ours until it expires
                try:
                    current = self._read()
                except ColdTierUnavailable:
                    return False  # cannot tell: keep it until it expires, try again later
                if current is None or current.token != info.token or current.owner != self.owner:
                    with self._lock:
                        if self._info is info:
                            self._info = None
                            holder = "nobody" if current is None else repr(current.owner)
                            self.lost_reason = f"lease {self.path} was taken over (now held by {holder})"
                    return False
                e_tag = current.e_tag  # our own earlier renewal landed; its reply was lost
                continue
            self._set(info.token, expires, res)
            return True
        return False

    def release(self) -> bool:
        """Give the lease up (an expired lease conditioned on our ETag); True if it was ours."""
        import obstore

        with self._lock:
            info, self._info = self._info, None
        if info is None:
            return False
        body = json.dumps({"owner": info.owner, "token": info.token, "expires_at": 0.0}).encode()
        try:
            obstore.put(self.store, self.path, body, mode={"e_tag": info.e_tag})
        except Exception:
            return False  # taken over already, or store away: it expires on its own
        return True

    # -- helpers ----------------------------------------------------------------------------
    def _body(self, token: str) -> tuple[bytes, float]:
        """The lease object's bytes and the expiry they state. The holder keeps exactly that
        expiry: one computed after the write would be later than what other workers read."""
        expires = self._clock() + self.config.ttl_s
        return json.dumps({"owner": self.owner, "token": token, "expires_at": expires}).encode(), expires

    def _set(self, token: str, expires: float, res) -> LeaseInfo:
        info = LeaseInfo(self.owner, token, expires, res.get("e_tag"))
        with self._lock:
            self._info = info
            self.lost_reason = ""
        return info

    def _read(self) -> LeaseInfo | None:
        import obstore

        try:
            got = obstore.get(self.store, self.path, options={"range": (0, MAX_LEASE_BYTES + 1)})
            meta = got.meta
            raw = b"" if int(meta["size"]) > MAX_LEASE_BYTES else bytes(got.bytes())
        except Exception as exc:
            fault = classify(exc)
            if fault is Fault.MISSING:
                return None
            if fault is Fault.RANGE:  # an empty object: unreadable, its ETag from a HEAD
                return self._unreadable()
            raise ColdTierUnavailable(f"cannot read lease {self.path}: {short(exc)}") from exc
        try:
            d = json.loads(raw)
            return LeaseInfo(str(d["owner"]), str(d["token"]), float(d["expires_at"]), meta.get("e_tag"))
        except (ValueError, KeyError, TypeError):
            # an unreadable lease is treated as expired so it can be replaced (conditionally)
            return LeaseInfo("<unreadable>", "", 0.0, meta.get("e_tag"))

    def _unreadable(self) -> LeaseInfo | None:
        import obstore

        try:
            meta = obstore.head(self.store, self.path)
        except Exception as exc:
            if classify(exc) is Fault.MISSING:
                return None
            raise ColdTierUnavailable(f"cannot read lease {self.path}: {short(exc)}") from exc
        return LeaseInfo("<unreadable>", "", 0.0, meta.get("e_tag"))

    def check_integrity(self) -> None:
        with self._lock:
            if self._info is not None:
                if not (self._info.owner == self.owner and self._info.token):
                    raise AssertionError(
                        f"lease held as {self._info.owner!r} (token {self._info.token!r}), "
                        f"not as {self.owner!r} with a token"
                    )


class LeaseKeeper:
    """Renews a lease every ``renew_every_s`` on a thread (waits on an Event, never spins)."""

    def __init__(self, lease: Lease, *, on_renew: Callable[[bool], None] | None = None) -> None:
        self.lease = lease
        self._on_renew = on_renew
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coldtier-lease", daemon=True)
        self.renewals = 0

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.lease.config.renew_every_s):
            ok = self.lease.renew()
            self.renewals += ok
            if self._on_renew is not None:
                self._on_renew(ok)
            if not ok and self.lease.info is None:
                return  # lost: nothing left to renew

    def stop(self, timeout_s: float = 5.0) -> None:
        timeout_s = check_timeout("LeaseKeeper.stop", timeout_s)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
