"""The interface every policy implements, and helpers for writing one.

Policies are pure: they receive immutable candidates (``Candidate`` records or
a ``CandidateBatch`` of columns, both defined in ``tiering.policies.candidate`` and
re-exported here) and return an order. They never touch pools, resources,
torch or the filesystem, which keeps them cheap to test and safe to swap.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress

import numpy as np
from tiering.policies.candidate import Candidate, CandidateBatch
from tiering.policies.ordering import check_keys, order_rows

__all__ = [
    "Candidate",
    "CandidateBatch",
    "OrderCursor",
    "Policy",
    "check_batch",
    "check_now",
    "rank_by",
]


class Policy:
    """Orders candidates; the first is evicted first.

    A policy states its order in one of three ways, fastest first:

    - ``sort_keys(batch, now)``: numeric columns, compared most significant
      first, each ascending (smaller is evicted sooner). The base class does
      the rest: ties by ``rid`` then ``resource``, and only as much sorting as
      the prefix a caller reads needs (see ``tiering.policies.ordering``).
    - ``order(batch, now, limit)``: its own columnar order.
    - ``rank(candidates, now)``: records only, the simplest form. The base
      class then builds records from a batch to serve ``order``.

    The most derived of these wins: a subclass of a built-in policy that
    overrides ``rank`` is ordered by its ``rank``.

    Contract (checked for every policy by one shared test):

    - ``rank`` returns every candidate exactly once, in a new list;
    - the order is deterministic: the same input gives the same output, ties
      broken by ``rid`` (then ``resource``), whatever order the input came in;
    - the input is never mutated;
    - ``rank`` and ``order`` agree: ``rank(cs, now)`` is
      ``[cs[i] for i in order(CandidateBatch.from_candidates(cs), now)]``;
    - ``order(batch, now, limit)`` is a prefix of ``order(batch, now)`` with
      at least ``min(limit, len(batch))`` rows;
    - a policy whose ``needs_reclaimable`` is False orders without reading
      ``batch.reclaimable`` (it may be None), so the bytes do not change its
      order and a caller may ask for them only for the rows it walks.
    """

    #: Name of the resource whose ``get_offload_priority`` this policy needs, or
    #: None when it needs none. The controller fills ``Candidate.priority`` only
    #: for policies that name a resource, and only from that resource.
    needs_priority_from: str | None = None

    #: Whether this policy's ``sort_keys`` (or ``order``) reads
    #: ``batch.reclaimable``; a policy that orders without the bytes says False.
    reads_reclaimable: bool = True

    name: str = "policy"

    @property
    def needs_reclaimable(self) -> bool:
        """Whether ordering needs the candidates' reclaimable bytes.

        False only for a policy ordered by ``sort_keys`` or ``order`` that
        says it ``reads_reclaimable`` = False; a policy ordered by ``rank`` is
        handed complete records, bytes included.
        """
        return self.reads_reclaimable or _ranks_records(type(self))

    def sort_keys(self, batch: CandidateBatch, now: float) -> tuple[np.ndarray, ...] | None:
        """Numeric keys of every row, most significant first; smaller is evicted sooner.

        None (the default) means this policy has no keys: it overrides
        ``order`` or ``rank`` instead.
        """
        return None

    def order(
        self, batch: CandidateBatch, now: float, limit: int | None = None
    ) -> np.ndarray:
        """Row indices of ``batch``, most evictable first (int64).

        Without ``limit``, every row once. With one, a prefix of that order
        holding at least ``min(limit, len(batch))`` rows (possibly more).
        """
        check_now(now)
        check_batch(batch, "order")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
        # the flag first: reading ``batch.reclaimable`` gathers a records batch's bytes
        if self.reads_reclaimable and batch.reclaimable is None:
            raise ValueError(
                f"policy {self.name!r} orders by the reclaimable bytes (reads_reclaimable), "
                f"and this batch was made without them"
            )
        keys = None if _ranks_records(type(self)) else self.sort_keys(batch, now)
        if keys is None:
            return self._order_by_rank(batch, now)
        return order_rows(check_keys(keys, len(batch)), batch, limit)

    def _order_by_rank(self, batch: CandidateBatch, now: float) -> np.ndarray:
        if not _ranks_records(type(self)):
            raise TypeError(
                f"policy {type(self).__name__} defines none of sort_keys, order and rank"
            )
        if batch.reclaimable is None:
            raise ValueError(
                f"policy {self.name!r} ranks records, which need the batch's reclaimable bytes"
            )
        records = batch.records()
        ranked = self.rank(records, now)
        # map each returned record back to its row (a list may hold one
        # record object twice: each occurrence is a row of its own)
        rows_of: dict[int, list[int]] = {}
        for row, record in enumerate(records):
            rows_of.setdefault(id(record), []).append(row)
        rows = []
        for record in ranked:
            waiting = rows_of.get(id(record))
            if not waiting:
                break
            rows.append(waiting.pop())
        if len(rows) != len(records) or len(ranked) != len(records):
            raise ValueError(
                f"policy {self.name!r}: rank must return every candidate it is given exactly once"
            )
        return np.array(rows, dtype=np.int64)

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """Return ``candidates`` ordered most-evictable first (a new list)."""
        check_now(now)
        _check_sequence(candidates, "rank")
        if not candidates:
            return []
        rows = self.order(CandidateBatch.from_candidates(candidates), now)
        return [candidates[row] for row in rows.tolist()]

    def pick(self, candidates: Sequence[Candidate], now: float, need_bytes: int) -> list[Candidate]:
        """The victims to offload to free ``need_bytes``.

        Returns the shortest prefix of ``rank(candidates, now)`` whose
        ``reclaimable`` bytes add up to at least ``need_bytes``; the whole
        ranking when even all of it falls short, and an empty list when
        ``need_bytes`` is 0. ``need_bytes`` must be an int >= 0.
        """
        _check_need(need_bytes)
        check_now(now)
        _check_sequence(candidates, "pick")
        if need_bytes == 0 or not candidates:
            return []
        rows = self.pick_rows(CandidateBatch.from_candidates(candidates), now, need_bytes)
        return [candidates[row] for row in rows.tolist()]

    def pick_rows(self, batch: CandidateBatch, now: float, need_bytes: int) -> np.ndarray:
        """``pick`` on a batch: the rows of the shortest covering prefix of ``order``."""
        _check_need(need_bytes)
        check_now(now)
        check_batch(batch, "pick_rows")
        sizes = batch.reclaimable
        if sizes is None:
            raise ValueError("pick_rows needs the batch's reclaimable bytes")
        if need_bytes == 0 or not len(batch):
            return np.empty(0, dtype=np.int64)
        cursor = OrderCursor(self, batch, now)
        mean = float(sizes.mean())
        total = 0
        taken: list[np.ndarray] = []
        while True:
            chunk = cursor.take_for(need_bytes - total, mean)
            if not len(chunk):
                break
            covered, total = _covering_prefix(sizes[chunk], total, need_bytes)
            if covered is not None:
                taken.append(chunk[:covered])
                break
            taken.append(chunk)
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)


class OrderCursor:
    """Reads ``policy.order(batch, now)`` front to back, sorting only what is read.

    Each ``take`` returns the next rows of the order. The cursor asks the
    policy for a prefix long enough to cover them (a policy with sort keys
    then sorts little more than that prefix) and keeps any extra rows it got
    for the next ``take``.
    """

    __slots__ = ("_policy", "_batch", "_now", "_known", "_read")

    #: Rows read first when nothing says how many will be needed.
    FIRST_ROWS = 256

    def __init__(self, policy: Policy, batch: CandidateBatch, now: float) -> None:
        if not isinstance(policy, Policy):
            raise ValueError(f"OrderCursor: policy must be a Policy, got {type(policy).__name__}")
        check_batch(batch, "OrderCursor")
        self._policy = policy
        self._batch = batch
        self._now = check_now(now)
        self._known = np.empty(0, dtype=np.int64)
        self._read = 0

    @property
    def read(self) -> int:
        """How many rows have been returned so far."""
        return self._read

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` rows of the order (fewer at its end, none past it; none
        for a count <= 0). ``count`` must be an int."""
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"OrderCursor.take: count must be an int, got {count!r}")
        n = len(self._batch)
        want = min(self._read + max(count, 0), n)
        if len(self._known) < want:
            known = self._policy.order(self._batch, self._now, want)
            if len(known) < want:
                raise ValueError(
                    f"policy {self._policy.name!r}: order(limit={want}) returned "
                    f"{len(known)} rows of {n}"
                )
            self._known = known
        chunk = self._known[self._read:want]
        self._read = want
        return chunk

    def take_for(self, need_bytes: float, mean_bytes: float | None) -> np.ndarray:
        """The next rows, about enough to free ``need_bytes`` at ``mean_bytes`` a row.

        A margin is added, and at least half as many rows as were read so far
        are taken, so a walk that keeps falling short costs a bounded number
        of sorts. Without a usable mean, ``FIRST_ROWS`` rows.
        """
        if mean_bytes is None or not mean_bytes > 0:
            count = self.FIRST_ROWS
        else:
            count = int(min(max(need_bytes, 1.0) / mean_bytes * 1.25, 2.0**62)) + 16
        return self.take(max(count, self._read // 2, 1))


def _ranks_records(cls: type) -> bool:
    """Whether the most derived ordering method of ``cls`` is ``rank``.

    Within one class, ``sort_keys`` or ``order`` is preferred to ``rank``
    (they must agree; the columnar one is faster).
    """
    for klass in cls.__mro__:
        if klass is Policy:
            break
        found = vars(klass)
        if "sort_keys" in found or "order" in found:
            return False
        if "rank" in found:
            return True
    return False


def check_batch(batch: object, what: str) -> None:
    """Raise ValueError, prefixed by ``what``, unless ``batch`` is a CandidateBatch."""
    if not isinstance(batch, CandidateBatch):
        raise ValueError(f"{what}: batch must be a CandidateBatch, got {type(batch).__name__}")


def _check_sequence(candidates: object, what: str) -> None:
    if not isinstance(candidates, Sequence) or isinstance(candidates, (str, bytes)):
        raise ValueError(
            f"{what}: candidates must be a sequence (list or tuple) of Candidate, got "
            f"{type(candidates).__name__}"
        )


def _check_need(need_bytes: object) -> None:
    if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
        raise ValueError(f"need_bytes must be an int >= 0, got {need_bytes!r}")


def _covering_prefix(sizes: np.ndarray, total: int, need: int) -> tuple[int | None, int]:
    """How many of ``sizes`` bring ``total`` to ``need`` (None if all fall short), new total."""
    if len(sizes) and total + int(sizes.max()) * len(sizes) < 2**63:
        running = np.cumsum(sizes) + total  # exact: no partial sum can overflow
        end = int(np.searchsorted(running, need, side="left"))
        if end < len(sizes):
            return end + 1, int(running[end])
        return None, int(running[-1])
    for count, nbytes in enumerate(sizes.tolist(), start=1):
        total += nbytes
        if total >= need:
            return count, total
    return None, total


def check_now(now: object) -> float:
    """Return ``now`` if it is a finite number; raise ValueError naming it otherwise."""
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number, got {now!r}")
    return now


def rank_by(
    candidates: Sequence[Candidate],
    key: Callable[[Candidate], float] | Sequence[float] | np.ndarray,
    *,
    descending: bool = False,
    then: tuple[str, ...] = ("rid", "resource"),
) -> list[Candidate]:
    """Order candidates by one numeric key, breaking ties by fields in ascending order.

    ``key`` is either a function of a candidate returning a number
    (``operator.attrgetter`` is the fast choice; values are compared as
    float64) or precomputed numeric keys aligned with ``candidates`` (a list or
    a 1-D numpy array; pass int64 to compare large integers exactly). Equal keys
    are ordered by the candidate fields named in ``then``, each ascending,
    normally ending with ``rid`` and ``resource`` so that the result does not
    depend on the input order. A new list is returned; the input is untouched.

    Offered to custom policies that rank records (the built-ins give
    ``sort_keys`` instead). It sorts on the single key first (one vectorised
    sort; the common case has few ties) and then re-sorts only the runs of
    equal keys.

    ``then`` must be a tuple (or list) of the orderable field names: ``rid``,
    ``resource``, ``reclaimable``, ``last_used``, ``priority``, ``reload_cost_s``.
    """
    if not isinstance(then, (tuple, list)) or not all(
        isinstance(field, str) and field in _THEN_FIELDS for field in then
    ):
        raise ValueError(
            f"rank_by: then must be a tuple of field names from "
            f"{', '.join(sorted(_THEN_FIELDS))}; got {then!r}"
        )
    then = tuple(then)
    n = len(candidates)
    if n < 2:
        return list(candidates)
    keys = _key_array(candidates, key, n)
    order = np.argsort(-keys if descending else keys, kind="stable")
    ordered = list(operator.itemgetter(*order.tolist())(candidates))
    if then:
        _fix_spans(ordered, _equal_spans_sorted(keys[order]), then)
    return ordered


def _key_array(candidates: Sequence[Candidate], key: object, n: int) -> np.ndarray:
    if callable(key):
        try:
            return np.fromiter(map(key, candidates), dtype=np.float64, count=n)
        except (TypeError, ValueError) as err:
            raise ValueError(f"rank_by: the key must return numbers ({err})") from err
    keys = np.asarray(key)
    if keys.shape != (n,):
        raise ValueError(f"rank_by got keys of shape {keys.shape} for {n} candidates")
    if keys.dtype.kind not in "iuf":
        raise ValueError(f"rank_by: keys must be numeric, got dtype {keys.dtype}")
    if keys.dtype.kind == "f" and np.isnan(keys).any():
        raise ValueError("rank_by: keys contain NaN, which has no order")
    return keys


def _equal_spans_sorted(sorted_keys: np.ndarray) -> Iterator[tuple[int, int]]:
    """(start, stop) of every run of two or more equal values in a sorted array."""
    equal_next = sorted_keys[1:] == sorted_keys[:-1]
    if not equal_next.any():
        return iter(())
    edges = np.diff(equal_next.astype(np.int8), prepend=0, append=0)
    starts = np.flatnonzero(edges == 1)
    stops = np.flatnonzero(edges == -1) + 1
    return zip(starts.tolist(), stops.tolist(), strict=True)


def _equal_spans_list(keys: list) -> Iterator[tuple[int, int]]:
    """(start, stop) spans of equal neighbours in a sorted list (some may be single)."""
    n = len(keys)
    equal_next = list(map(operator.eq, keys, keys[1:]))  # equal_next[i]: keys[i] == keys[i+1]
    ties = equal_next.count(True)
    if ties == 0:
        return iter(())
    # Walk whichever is fewer: the boundaries between distinct keys, or the ties.
    if n - ties <= ties:
        starts = [0, *compress(range(1, n), map(operator.not_, equal_next)), n]
        return zip(starts, starts[1:], strict=False)
    return _tied_spans(list(compress(range(n - 1), equal_next)))


def _tied_spans(tied: list[int]) -> Iterator[tuple[int, int]]:
    """Turn positions i with keys[i] == keys[i+1] into (start, stop) spans of equal keys."""
    index = 0
    count = len(tied)
    while index < count:
        start = tied[index]
        while index + 1 < count and tied[index + 1] == tied[index] + 1:
            index += 1
        yield start, tied[index] + 2
        index += 1


# Runs of equal keys at least this long are ordered level by level (one
# single-key sort per field); shorter runs are sorted once on a tuple key.
_RECURSE_RUN = 64
# Candidate fields that hold numbers (sorted vectorised) rather than strings.
_NUMERIC_FIELDS = frozenset({"reclaimable", "last_used", "priority", "reload_cost_s"})
# The fields ``rank_by`` can break ties by (``tier`` has no order).
_THEN_FIELDS = _NUMERIC_FIELDS | {"rid", "resource"}


def _fix_spans(
    ordered: list[Candidate], spans: Iterable[tuple[int, int]], then: tuple[str, ...]
) -> None:
    """Re-sort, in place, each span of ``ordered`` by the fields in ``then``."""
    tail_key = operator.attrgetter(*then)
    for start, stop in spans:
        size = stop - start
        if size < 2:
            continue
        if size >= _RECURSE_RUN and len(then) > 1:
            first = operator.attrgetter(then[0])
            if then[0] in _NUMERIC_FIELDS:
                run = rank_by(ordered[start:stop], first, then=then[1:])
            else:
                run = sorted(ordered[start:stop], key=first)
                _fix_spans(run, _equal_spans_list(list(map(first, run))), then[1:])
        else:
            run = sorted(ordered[start:stop], key=tail_key)
        ordered[start:stop] = run
