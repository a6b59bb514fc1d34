"""Every exception the package raises, in one place.

A caller catches these by name from ``tiering`` (or from here); the modules
that raise them import them from here, and the old import paths (the defining
module of each before this one existed) still name the same class.

How the package uses exceptions at all (docs/design.md, "Errors"):

- bad input (an unknown request, an illegal move, an invalid config) raises,
  names what was wrong and changes nothing;
- an expected shortage (no room yet, disk full) is a False or None return,
  never an exception;
- an I/O fault on the step path is not raised either: the request stays where
  it was, or is marked lost with a reason that ``RequestLost`` later carries.

This module imports nothing of the package (it is the lowest layer, with
``tiering.types``), so any layer may import it.
"""

from __future__ import annotations

import errno as _errno

#: ``OSError.errno`` values of a read that may succeed if tried again (a store
#: that timed out, refused a connection, is skipped by its circuit breaker, is
#: unreachable, or whose lease is being renewed): the data is still where it
#: was, so a reload that fails with one of these leaves the request on disk.
TRANSIENT_IO_ERRNOS = frozenset({
    _errno.ETIMEDOUT, _errno.ECONNREFUSED, _errno.ECONNRESET, _errno.EAGAIN,
    _errno.EHOSTUNREACH, _errno.ENETUNREACH, _errno.ENOLCK, _errno.EREMOTEIO,
})

__all__ = [
    # requests and their states
    "IllegalTransition",
    "BadRequestId",
    "LayerNotReady",
    "UnknownRequest",
    "UnknownRequestError",
    "RequestLost",
    "CacheClosed",
    # the core mechanism
    "PoolIntegrityError",
    "ChecksumMismatch",
    "CopyFault",
    "StagingTimeout",
    "PinError",
    # the disk tier
    "DiskIOError",
    "DiskCorruptionError",
    "DiskIntegrityError",
    "DiskPathInUseError",
    "ChunkChecksumError",
    "ManifestError",
    "StartRefused",
    # the cold tier
    "ColdTierError",
    "ColdTierUnavailable",
    "LeaseHeld",
    "LeaseLost",
    "FrameDamaged",
    "FrameRefused",
    "FrameUnauthenticated",
    "PrefixLeaseLost",
    "StoreNotAnswering",
    "CorruptBlock",
    # integrations and applications
    "TableIntegrityError",
    "TraceFormatError",
    "PolicyFailed",
    "WorkerStalled",
    # packaging
    "MissingExtra",
]


# -- requests and their states ---------------------------------------------------------


class IllegalTransition(RuntimeError):
    """A request was asked to move in a way its state does not allow.

    The message names the request and its state; nothing changed.
    """


class LayerNotReady(IllegalTransition):
    """A layer of a request reloading layer by layer was read or written before it
    landed, and it did not land in time (or will not: its copy failed). Ask
    ``wait_layer`` first; it answers False instead of raising."""


class BadRequestId(TypeError, ValueError):
    """A request id that is not a non-empty str. A TypeError (a non-str id) and a
    ValueError (an empty one) at once, so either ``except`` catches it wherever an id
    is checked: the cache, the controller, the front door and the replay model."""


class UnknownRequest(KeyError):
    """A request id the object asked was never told about, or was told is gone.

    The one class for every component that keeps requests by id: the KV cache,
    the eviction controller, the front door and the replay model all raise it.
    A ``KeyError``, so ``except KeyError`` keeps catching it.
    """

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"


#: The controller's former name for ``UnknownRequest`` (the same class).
UnknownRequestError = UnknownRequest


class RequestLost(RuntimeError):
    """The request's KV could not be kept; ``rid`` names it and ``reason`` says why."""

    def __init__(self, rid: str, reason: str) -> None:
        super().__init__(f"request {rid!r} is lost: {reason}")
        self.rid = rid
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickled (across processes) whole
        return type(self), (self.rid, self.reason)


class CacheClosed(RuntimeError):
    """The cache was closed; every call after ``close()`` raises this and changes nothing."""


# -- the core mechanism ------------------------------------------------------------------


class PoolIntegrityError(AssertionError):
    """A pool's slots, free list and ledger disagree (raised by ``check_integrity``)."""


class ChecksumMismatch(RuntimeError):
    """Bytes brought back differ from the bytes that were offloaded."""


class CopyFault(RuntimeError):
    """A page copy failed (raised by real failures and by injected faults)."""


class StagingTimeout(TimeoutError):
    """No staging buffer came free in time (the job fails; its request stays at its source)."""


class PinError(RuntimeError):
    """A host (un)registration failed; the message names the CUDA error."""


# -- the disk tier --------------------------------------------------------------------------


class DiskIOError(OSError):
    """A disk-tier read or write failed; ``errno`` is set when known."""


class DiskCorruptionError(DiskIOError):
    """A chunk's bytes failed their checksum (or could not be decoded) at read."""


class DiskIntegrityError(AssertionError):
    """The disk tier's bookkeeping broke one of its invariants."""


class DiskPathInUseError(OSError):
    """Another live disk tier holds this location; the message names it and the holder."""


class ChunkChecksumError(ValueError):
    """A slot's stored chunk failed its length or crc32c check at a direct read."""


class ManifestError(ValueError):
    """The disk tier's manifest cannot be trusted; the message says why.

    Raised while a reattach reads the manifest and turned there into a
    ``StartRefused``: a cache's caller does not see it.
    """


class StartRefused(Exception):
    """Why a reattach was declined; ``nothing_there`` for a plain first start.

    Raised and caught inside the disk tier at start-up (the store is then
    cleared and the reason logged): a cache's caller does not see it.
    """

    def __init__(self, reason: str, *, nothing_there: bool = False) -> None:
        super().__init__(reason)
        self.nothing_there = nothing_there


# -- the cold tier ---------------------------------------------------------------------------


class ColdTierError(Exception):
    """Base class of every error the cold tier raises."""


class ColdTierUnavailable(ColdTierError):
    """The object store cannot be reached or refuses our credentials (raised at start-up)."""


class LeaseHeld(ColdTierError):
    """Another live worker holds the private prefix asked for."""


class LeaseLost(ColdTierError):
    """This worker's lease was taken over (it expired without renewal); stop writing."""


class PrefixLeaseLost(OSError):
    """A write was refused before any request because this worker no longer holds the prefix."""


class StoreNotAnswering(OSError):
    """The object store did not answer (errno ETIMEDOUT, ECONNREFUSED; EREMOTEIO for a server
    error), or the breaker is
    open after it stopped answering (errno EAGAIN: no request was made)."""


class CorruptBlock(RuntimeError):
    """A stored prefix block's bytes do not match the crc32c taken when it was published."""


class FrameRefused(Exception):
    """An object is not the one asked for (foreign, truncated, damaged); the reason says which."""


class FrameDamaged(FrameRefused):
    """The object is not a readable frame: cut, extended, or failing its crc32c (nobody can
    read it, whoever wrote it)."""


class FrameUnauthenticated(FrameRefused):
    """The object is intact but no key the reader holds made its MAC (forged, unkeyed, or
    written under a deployment key retired since)."""


# -- integrations and applications ------------------------------------------------------------


class TableIntegrityError(AssertionError):
    """The vLLM backend's block table, host pool, disk ledger and policies disagree."""


class TraceFormatError(ValueError):
    """A trace file, or one line of it, is not in the expected format."""


class PolicyFailed(ValueError):
    """A user's policy (request or block) failed while a replay ran: it raised, or gave
    an answer that is not one. The message names the policy and the decision; the
    ``__cause__`` is what the policy raised, if it raised."""


class WorkerStalled(RuntimeError):
    """The demo worker could run nothing for too many steps in a row."""


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str, needed_for: str) -> None:
        super().__init__(
            f"{needed_for} needs the optional package {module!r}, which is not installed: "
            f"pip install 'tiering[{extra}]'",
            name=module,
        )
        self.extra = extra
        self.needed_for = needed_for

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # pickled (across processes) whole
        return type(self), (self.name, self.extra, self.needed_for)
