"""The disk tier's chunk ledger: which chunk belongs to whom, and what may be reused.

``ChunkLedger`` is the one owner of the disk tier's allocation state: the free
map, the live extents (owner, page count, written, busy), the committed
entries, and the quarantine of released chunks that may not be reused yet. It
does no I/O; ``DiskPageStore`` drives it and does the reading and writing. All
methods are thread-safe (one lock); a chunk is always exactly one of free, held
by one live extent, or quarantined.

A released chunk is quarantined while either reason holds:
- ``"io"``: the extent's last operation timed out and its I/O is still running;
- ``"manifest"``: the manifest on disk still lists it (so a restart would adopt it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tiering.errors import DiskIntegrityError


class DiskExtent(NamedTuple):
    """What one reservation holds: whole chunks, how many pages they carry, and the
    reservation's generation (unique within the store; a handle whose generation is
    not the live reservation's is stale and refused)."""

    chunks: tuple[int, ...]
    num_pages: int
    generation: int = 0


@dataclass
class ExtentState:
    """One live extent's book-keeping (guarded by the ledger's lock): which of its
    chunks (positions in the extent) hold a completed write, and the positions the
    operation in flight covers."""

    owner: str
    num_pages: int
    generation: int = 0
    num_chunks: int = 0
    done: set[int] = field(default_factory=set)
    busy: bool = False
    timed_out: bool = False
    active: tuple[int, ...] = ()

    @property
    def written(self) -> bool:
        """Every chunk of the extent holds a completed write."""
        return len(self.done) == self.num_chunks


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_owner(owner: object) -> None:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty str, got {owner!r}")


def check_extent(extent: object) -> None:
    if not isinstance(extent, DiskExtent):
        raise ValueError(f"expected a DiskExtent, got {type(extent).__name__}")


class ChunkLedger:
    """Allocation state of ``capacity_chunks`` chunks of ``pages_per_chunk`` pages each."""

    def __init__(self, capacity_chunks: int, pages_per_chunk: int) -> None:
        self.capacity_chunks = capacity_chunks
        self.pages_per_chunk = pages_per_chunk
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._free = np.ones(capacity_chunks, dtype=bool)
        self._used = 0
        self._extents: dict[tuple[int, ...], ExtentState] = {}
        self._committed: dict[str, tuple[DiskExtent, dict[str, Any]]] = {}
        self._quarantine: dict[int, set[str]] = {}
        self._on_disk: set[int] = set()
        self._in_flight = 0
        self._refusals = 0
        self._closed = False
        self._next_generation = 1

    # ------------------------------------------------------------------ sizing

    def chunks_for(self, num_pages: int) -> int:
        if not _is_int(num_pages) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        return -(-int(num_pages) // self.pages_per_chunk)

    def used_chunks(self) -> int:
        with self._lock:
            return self._used

    def can_reserve(self, num_pages: int) -> bool:
        need = self.chunks_for(num_pages)
        with self._lock:
            return not self._closed and self.capacity_chunks - self._used >= need

    # ------------------------------------------------------------------ reserve / release

    def reserve(self, owner: str, num_pages: int) -> DiskExtent | None:
        """Whole chunks for ``num_pages``, one adjacent run if any fits; None (counted) if full."""
        check_owner(owner)
        need = self.chunks_for(num_pages)
        with self._lock:
            self._check_open()
            if self.capacity_chunks - self._used < need:
                self._refusals += 1
                return None
            chunks = pick_chunks(self._free, need)
            self._free[list(chunks)] = False
            self._used += need
            generation = self._next_generation
            self._next_generation += 1
            self._extents[chunks] = ExtentState(
                owner=owner, num_pages=int(num_pages), generation=generation, num_chunks=need
            )
            return DiskExtent(chunks, int(num_pages), generation)

    @property
    def next_generation(self) -> int:
        """The generation the next reservation gets (persisted, so a restart never reuses one)."""
        with self._lock:
            return self._next_generation

    def start_generations_at(self, generation: int) -> None:
        with self._lock:
            self._next_generation = max(self._next_generation, int(generation))

    def release(self, extent: DiskExtent, *, persistent: bool) -> bool:
        """Drop a live extent and its committed entry; free or quarantine its chunks.

        Returns True when the manifest must be rewritten before some of its
        chunks can be reused (``persistent`` stores only).
        """
        with self._lock:
            self._check_open()
            state = self._state(extent)
            if state.busy and not state.timed_out:
                raise ValueError(
                    f"extent {extent.chunks} of {state.owner!r} has an operation in flight"
                )
            del self._extents[extent.chunks]
            owner = self._committed_owner_of(extent)
            if owner is not None:
                del self._committed[owner]
            needs_manifest = False
            free_now = []
            for c in extent.chunks:
                reasons = set()
                if state.busy:
                    reasons.add("io")
                if persistent and c in self._on_disk:
                    reasons.add("manifest")
                    needs_manifest = True
                if reasons:
                    self._quarantine[c] = reasons
                else:
                    free_now.append(c)
            self._free_chunks(free_now)
            return needs_manifest

    # ------------------------------------------------------------------ operations

    def begin(self, extent: DiskExtent, what: str, positions: range | None = None) -> ExtentState:
        """Mark the extent busy for one ``"read"`` or ``"write"`` of the chunks at
        ``positions`` (all of them when None); refuse what may not start."""
        with self._lock:
            self._check_open()
            state = self._state(extent)
            covered = tuple(range(state.num_chunks) if positions is None else positions)
            if state.busy:
                raise ValueError(
                    f"{what} of extent {extent.chunks} of {state.owner!r}: "
                    f"another operation is in flight"
                )
            if what == "read" and not state.done.issuperset(covered):
                raise ValueError(
                    f"extent {extent.chunks} of {state.owner!r} has not been written "
                    f"successfully (in the range read)"
                )
            if what == "write":
                owner = self._committed_owner_of(extent)
                if owner is not None:
                    raise ValueError(
                        f"extent {extent.chunks} is committed by {owner!r}; "
                        f"uncommit it before rewriting"
                    )
                state.done.difference_update(covered)
            state.busy = True
            state.timed_out = False
            state.active = covered
            self._in_flight += 1
            return state

    def finish(self, extent: DiskExtent, state: ExtentState, *, wrote: bool = False) -> None:
        """The operation's last I/O has ended; ``wrote``: it was a write and every chunk
        landed. A write the caller already gave up on (timed out) stays unwritten."""
        with self._lock:
            state.busy = False
            if wrote and not state.timed_out:
                state.done.update(state.active)
            state.active = ()
            self._in_flight -= 1
            if self._extents.get(extent.chunks) is not state:
                self._unquarantine(extent.chunks, "io")  # released while its I/O ran
            self._idle.notify_all()

    def mark_timed_out(self, state: ExtentState) -> None:
        """The caller gave up waiting; the extent stays busy until ``finish``."""
        with self._lock:
            if state.busy:
                state.timed_out = True

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called (work is refused)."""
        with self._lock:
            return self._closed

    def close(self) -> bool:
        """Refuse further work; False if it was already closed."""
        with self._lock:
            was_open = not self._closed
            self._closed = True
            return was_open

    # ------------------------------------------------------------------ committed entries

    def commit(
        self, owner: str, extent: DiskExtent, meta: dict[str, Any]
    ) -> tuple[DiskExtent, dict[str, Any]] | None:
        """Record ``owner``'s committed extent; returns the entry it replaced, if any.

        An owner has at most one committed entry: committing another extent for
        the same owner (a reused request id) supersedes the old entry, whose
        extent stays reserved, so no leftover entry can wedge a reused id."""
        with self._lock:
            self._check_open()
            state = self._state(extent)
            if state.owner != owner:
                raise ValueError(
                    f"commit of {owner!r}: extent {extent.chunks} was reserved by {state.owner!r}"
                )
            if state.busy or not state.written:
                raise ValueError(
                    f"commit of {owner!r}: extent {extent.chunks} is busy or not completely written"
                )
            previous = self._committed.get(owner)
            self._committed[owner] = (extent, meta)
            return previous

    def undo_commit(
        self,
        owner: str,
        extent: DiskExtent,
        meta: dict[str, Any],
        previous: tuple[DiskExtent, dict[str, Any]] | None,
    ) -> None:
        """Undo ``commit(owner, extent, meta)`` if that entry is still the current one,
        putting back the entry it replaced while that one's extent is still live."""
        with self._lock:
            if self._committed.get(owner) != (extent, meta):
                return
            del self._committed[owner]
            if previous is not None:
                state = self._extents.get(previous[0].chunks)
                if state is not None and state.owner == owner and state.written:
                    self._committed[owner] = previous

    def uncommit(self, extent: DiskExtent) -> bool:
        """Forget the committed entry naming ``extent`` (it stays reserved); False if none."""
        with self._lock:
            self._check_open()
            self._state(extent)
            owner = self._committed_owner_of(extent)
            if owner is None:
                return False
            del self._committed[owner]
            return True

    def forget(self, owner: str) -> bool:
        check_owner(owner)
        with self._lock:
            self._check_open()
            return self._committed.pop(owner, None) is not None

    def committed(self) -> dict[str, tuple[DiskExtent, dict[str, Any]]]:
        with self._lock:
            return dict(self._committed)

    def manifest_written(self, entries: dict[str, tuple[DiskExtent, dict[str, Any]]]) -> None:
        """The manifest on disk now lists exactly ``entries``: free chunks that waited for it."""
        with self._lock:
            self._on_disk = {c for extent, _ in entries.values() for c in extent.chunks}
            waiting = [c for c in self._quarantine if c not in self._on_disk]
            self._unquarantine(waiting, "manifest")

    def manifest_failed(self, entries: dict[str, tuple[DiskExtent, dict[str, Any]]]) -> None:
        """A manifest write listing ``entries`` failed: the file on disk may now be the
        old or the new one, so chunks of either count as listed until a write succeeds."""
        with self._lock:
            self._on_disk.update(c for extent, _ in entries.values() for c in extent.chunks)

    def adopt(self, owner: str, extent: DiskExtent, meta: dict[str, Any]) -> None:
        """Take over an extent a manifest listed at start-up: written, committed, on disk."""
        with self._lock:
            if not all(self._free[c] for c in extent.chunks):
                raise ValueError(f"adopting {owner!r}: chunks {extent.chunks} are not free")
            self._free[list(extent.chunks)] = False
            self._used += len(extent.chunks)
            n = len(extent.chunks)
            self._extents[extent.chunks] = ExtentState(
                owner=owner,
                num_pages=extent.num_pages,
                generation=extent.generation,
                num_chunks=n,
                done=set(range(n)),
            )
            self._next_generation = max(self._next_generation, extent.generation + 1)
            self._committed[owner] = (extent, meta)
            self._on_disk.update(extent.chunks)

    # ------------------------------------------------------------------ checks

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "extents": len(self._extents),
                "committed": len(self._committed),
                "quarantined_chunks": len(self._quarantine),
                "in_flight": self._in_flight,
                "refusals": self._refusals,
                "used_chunks": self._used,
            }

    def check(self) -> None:
        """Raise DiskIntegrityError unless every chunk is free, held by exactly one live
        extent, or quarantined for a reason; the count of used chunks equals the chunks
        not free; every extent fits its pages; every committed entry names a live,
        written extent of the same owner."""
        with self._lock:
            problems = self._problems()
        if problems:
            raise DiskIntegrityError("disk store integrity: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems: list[str] = []
        holders = np.zeros(self.capacity_chunks, dtype=np.int64)
        for chunks, state in self._extents.items():
            if len(set(chunks)) != len(chunks):
                problems.append(f"extent {chunks} of {state.owner!r} repeats a chunk")
            if state.generation >= self._next_generation:
                problems.append(
                    f"extent {chunks} of {state.owner!r} has generation {state.generation}, "
                    f"not below the next one {self._next_generation}"
                )
            if state.num_chunks != len(chunks) or not state.done <= set(range(len(chunks))):
                problems.append(f"extent {chunks} of {state.owner!r} has a bad written map")
            if state.busy != bool(state.active):
                problems.append(f"extent {chunks} of {state.owner!r} is busy without a range")
            if len(chunks) != -(-state.num_pages // self.pages_per_chunk):
                problems.append(
                    f"extent {chunks} of {state.owner!r} does not fit {state.num_pages} pages"
                )
            holders[list(chunks)] += 1
        for c, reasons in self._quarantine.items():
            holders[c] += 1
            if not reasons:
                problems.append(f"chunk {c} is quarantined for no reason")
        for label, mask in (
            ("held twice", holders > 1),
            ("held yet marked free", (holders > 0) & self._free),
            ("neither free nor held", (holders == 0) & ~self._free),
        ):
            bad = np.flatnonzero(mask)
            if bad.size:
                problems.append(f"chunks {label}: {bad.tolist()[:20]}")
        reserved = int(np.count_nonzero(~self._free))
        if reserved != self._used:
            problems.append(f"ledger counts {self._used} chunks, {reserved} are reserved")
        if self._used > self.capacity_chunks:
            problems.append(f"ledger counts {self._used} chunks of {self.capacity_chunks}")
        for owner, (extent, _) in self._committed.items():
            state = self._extents.get(extent.chunks)
            if state is None or state.owner != owner or not state.written:
                problems.append(f"committed entry {owner!r} does not name a live written extent")
        return problems

    # ------------------------------------------------------------------ internals (lock held)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("disk store is closed")

    def _state(self, extent: DiskExtent) -> ExtentState:
        check_extent(extent)
        state = self._extents.get(tuple(extent.chunks))
        if state is None:
            raise ValueError(f"extent {extent.chunks} is not reserved in this store")
        if extent.num_pages != state.num_pages:
            raise ValueError(
                f"extent {extent.chunks} was reserved for {state.num_pages} pages, "
                f"not {extent.num_pages}"
            )
        if extent.generation != state.generation:
            raise ValueError(
                f"extent {extent.chunks} handle of generation {extent.generation} is stale: "
                f"the live reservation ({state.owner!r}) is generation {state.generation}"
            )
        return state

    def _committed_owner_of(self, extent: DiskExtent) -> str | None:
        for owner, (committed, _) in self._committed.items():
            if committed.chunks == extent.chunks:
                return owner
        return None

    def _unquarantine(self, chunks: Any, reason: str) -> None:
        freed = []
        for c in chunks:
            reasons = self._quarantine.get(c)
            if reasons is not None and reason in reasons:
                reasons.discard(reason)
                if not reasons:
                    del self._quarantine[c]
                    freed.append(c)
        self._free_chunks(freed)

    def _free_chunks(self, chunks: list[int]) -> None:
        if chunks:
            self._free[chunks] = True
            self._used -= len(chunks)


def pick_chunks(free: np.ndarray, need: int) -> tuple[int, ...]:
    """``need`` free chunk indices: the smallest free run that fits (lowest first on ties),
    else the longest runs first. The caller has checked that enough are free."""
    padded = np.concatenate(([False], free, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
    fits = np.flatnonzero(lengths >= need)
    if fits.size:
        best = fits[np.argmin(lengths[fits])]
        start = int(starts[best])
        return tuple(range(start, start + need))
    chosen: list[int] = []
    for run in np.argsort(-lengths, kind="stable"):
        take = min(int(lengths[run]), need - len(chosen))
        chosen.extend(range(int(starts[run]), int(starts[run]) + take))
        if len(chosen) == need:
            break
    return tuple(sorted(chosen))
