"""The record a policy ranks and the interface every policy implements.

Policies are pure: they receive immutable ``Candidate`` records and return an
order. They never touch pools, resources, torch or the filesystem, which keeps
them cheap to test and safe to swap.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress

import numpy as np

from tiering.types import Tier


@dataclass(frozen=True, slots=True)
class Candidate:
    """One request that could be offloaded, as the controller sees it.

    ``rid``            request id
    ``reclaimable``    bytes ``offload`` would free now (always > 0 here)
    ``last_used``      clock time of the request's last step (injected clock)
    ``tier``           where it lives now (DEVICE for offload, HOST for demotion)
    ``priority``       the named resource's ``get_offload_priority`` (0.0 unless a
                       PRIORITY policy asked for it); higher means more wants it gone
    ``reload_cost_s``  expected seconds to bring it back (0.0 when unknown)
    ``resource``       name of the resource the request belongs to
    """

    rid: str
    reclaimable: int
    last_used: float
    tier: Tier = Tier.DEVICE
    priority: float = 0.0
    reload_cost_s: float = 0.0
    resource: str = ""

    def __post_init__(self) -> None:
        # Ranking sorts on these fields; a NaN or a wrong type would make the
        # order depend on the input order, so refuse them at the door.
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"Candidate.rid must be a non-empty str, got {self.rid!r}")
        if (
            not isinstance(self.reclaimable, int)
            or isinstance(self.reclaimable, bool)
            or not 0 <= self.reclaimable < 2**63
        ):
            raise ValueError(
                f"Candidate {self.rid!r}: reclaimable must be an int in [0, 2**63), "
                f"got {self.reclaimable!r}"
            )
        _check_finite(self.rid, "last_used", self.last_used)
        _check_finite(self.rid, "priority", self.priority)
        _check_finite(self.rid, "reload_cost_s", self.reload_cost_s)
        if self.reload_cost_s < 0:
            raise ValueError(
                f"Candidate {self.rid!r}: reload_cost_s must be >= 0, got {self.reload_cost_s!r}"
            )
        if not isinstance(self.tier, Tier):
            raise ValueError(f"Candidate {self.rid!r}: tier must be a Tier, got {self.tier!r}")
        if not isinstance(self.resource, str):
            raise ValueError(
                f"Candidate {self.rid!r}: resource must be a str, got {self.resource!r}"
            )


def _check_finite(rid: str, field: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
    ):
        raise ValueError(f"Candidate {rid!r}: {field} must be a finite number, got {value!r}")


# A callable the controller hands to a policy that needs a resource's opinion:
# (resource name, rid) -> offload priority.
PriorityLookup = Callable[[str, str], float]


class Policy(ABC):
    """Ranks candidates; the first of the result is evicted first.

    Contract (checked for every policy by one shared test):
    - ``rank`` returns every candidate exactly once;
    - the order is deterministic: the same input gives the same output, ties
      broken by ``rid``;
    - the input is never mutated.
    """

    #: Name of the resource whose ``get_offload_priority`` this policy needs, or
    #: None when it needs none. The controller fills ``Candidate.priority`` only
    #: for policies that name a resource, and only from that resource.
    needs_priority_from: str | None = None

    name: str = "policy"

    @abstractmethod
    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """Return ``candidates`` ordered most-evictable first."""

    def pick(self, candidates: Sequence[Candidate], now: float, need_bytes: int) -> list[Candidate]:
        """The victims to offload to free ``need_bytes``.

        Returns the shortest prefix of ``rank(candidates, now)`` whose
        ``reclaimable`` bytes add up to at least ``need_bytes``; the whole
        ranking when even all of it falls short, and an empty list when
        ``need_bytes`` is 0. ``need_bytes`` must be an int >= 0.
        """
        if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
            raise ValueError(f"need_bytes must be an int >= 0, got {need_bytes!r}")
        if need_bytes == 0:
            return []
        ranked = self.rank(candidates, now)
        total = 0
        for count, candidate in enumerate(ranked, start=1):
            total += candidate.reclaimable
            if total >= need_bytes:
                del ranked[count:]
                break
        return ranked


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

    This is the building block of the built-in policies and is offered to
    custom ones. It sorts on the single key first (one vectorised sort; the
    common case has few ties) and then re-sorts only the runs of equal keys.
    """
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
