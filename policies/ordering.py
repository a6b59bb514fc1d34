"""Order rows by numeric sort keys, ties broken by id, computing only the prefix asked for.

``order_rows(keys, ids, limit)`` is what a policy's ``order`` is made of: the
keys are compared most significant first, each ascending, and rows equal on
every key are ordered by ``rid`` and then ``resource`` (plain str comparison),
so the result never depends on the order the rows came in. Rows that share
one (rid, resource) and tie on every key (a list holding one request twice)
are ordered by their other fields (bytes, last use, priority, reload cost),
so even they come out the same way whatever the input order.

With a ``limit``, only the rows that can be among the first ``limit`` are
sorted: a selection (``np.partition``, O(n)) on the first key finds the
boundary value, rows beyond it are dropped, rows equal to it are narrowed the
same way on the next key, and whatever is left is sorted in full. Victims are
a small prefix of a long order, so this turns an n log n sort into a linear
pass plus a small sort.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Protocol

import numpy as np


class RowIds(Protocol):
    """The ids of the rows being ordered (a ``CandidateBatch`` is one)."""

    @property
    def rids(self) -> np.ndarray: ...

    @property
    def resources(self) -> np.ndarray: ...

# Above this many rows a partial order first narrows the rows to sort; below
# it, or when the prefix asked for is most of the rows, it sorts them all.
_SELECT_MIN_ROWS = 512
# A combined key must stay below this (int64, with room for one more factor).
_COMBINED_MAX = 2**62


def check_keys(keys: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, ...]:
    """Return ``keys`` as 1-D numeric arrays of length ``n``; raise ValueError otherwise.

    ``keys`` must be a tuple (or list) of columns: a bare array, a str, a
    mapping or a number is refused by name rather than taken apart."""
    if not isinstance(keys, (tuple, list)):
        raise ValueError(
            f"sort keys must be a tuple of 1-D arrays, got {type(keys).__name__}"
        )
    checked = []
    for position, key in enumerate(keys):
        array = np.asarray(key)
        if array.shape != (n,):
            raise ValueError(f"sort key {position} has shape {array.shape}; expected ({n},)")
        if array.dtype.kind == "b":
            array = array.astype(np.int8)
        elif array.dtype.kind not in "iuf":
            raise ValueError(f"sort key {position} must be numeric, got dtype {array.dtype}")
        if array.dtype.kind == "f" and np.isnan(array).any():
            raise ValueError(f"sort key {position} contains NaN, which has no order")
        checked.append(array)
    return tuple(checked)


def order_rows(
    keys: Sequence[np.ndarray],
    ids: RowIds,
    limit: int | None = None,
) -> np.ndarray:
    """Row indices, ascending by ``keys`` then ``rid`` then ``resource``.

    ``keys`` must already be checked (``check_keys``). ``ids.rids`` and
    ``ids.resources`` (object arrays of str) are read only if some rows tie
    on every key. Without ``limit`` the
    whole order is returned. With one, a prefix of the whole order holding at
    least ``min(limit, n)`` rows: it may hold more (rows that tie at the
    boundary are kept, sorted, rather than cut arbitrarily).
    """
    n = len(keys[0]) if keys else len(ids.rids)
    if limit is not None and limit <= 0:
        return np.empty(0, dtype=np.int64)
    if limit is None or n < _SELECT_MIN_ROWS or limit * 2 >= n:
        return _sort(keys, ids, None, n)
    chosen = _select(keys, n, limit)
    return chosen[_sort(tuple(k[chosen] for k in keys), ids, chosen, len(chosen))]


def _select(keys: Sequence[np.ndarray], n: int, limit: int) -> np.ndarray:
    """Rows that may be among the first ``limit`` (a superset, closed under ties).

    Every row left out is, at the first key where it differs from the
    boundary, greater than the boundary, so it sorts after every row kept.
    """
    kept: list[np.ndarray] = []
    pool: np.ndarray | None = None  # None: every row
    need = limit
    for key in keys:
        size = n if pool is None else len(pool)
        if need >= size:
            break
        values = key if pool is None else key[pool]
        boundary = np.partition(values, need - 1)[need - 1]
        below = values < boundary
        kept.append(np.flatnonzero(below) if pool is None else pool[below])
        need -= int(np.count_nonzero(below))
        at = values == boundary
        pool = np.flatnonzero(at) if pool is None else pool[at]
    kept.append(np.arange(n, dtype=np.int64) if pool is None else pool)
    return np.concatenate(kept) if len(kept) > 1 else kept[0]


def _sort(
    keys: Sequence[np.ndarray], ids: RowIds, rows: np.ndarray | None, m: int
) -> np.ndarray:
    """Sort positions 0..m-1 of ``keys`` (row ``rows[i]`` of the ids, or row i)."""
    if m == 0:
        return np.empty(0, dtype=np.int64)
    if not keys:
        combined = np.zeros(m, dtype=np.int64)
        order = np.arange(m, dtype=np.int64)
    elif len(keys) == 1:
        combined = keys[0]
        order = np.argsort(combined)
    else:
        combined = _combined_rank(keys)
        order = np.argsort(combined)
    sorted_keys = combined[order]
    tied = sorted_keys[1:] == sorted_keys[:-1]
    if tied.any():
        _break_ties(order, sorted_keys, tied, ids, rows)
    return order


def _dense_rank(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Each value's rank among the distinct values (0-based), and how many there are."""
    order = np.argsort(values)
    ordered = values[order]
    steps = np.empty(len(values), dtype=np.int64)
    steps[0] = 0
    np.cumsum(ordered[1:] != ordered[:-1], out=steps[1:])
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = steps
    return rank, int(steps[-1]) + 1


def _combined_rank(keys: Sequence[np.ndarray]) -> np.ndarray:
    """One int64 key that orders like the tuple of ``keys`` (equal exactly when all are)."""
    combined, width = _dense_rank(keys[-1])
    for key in reversed(keys[:-1]):
        rank, levels = _dense_rank(key)
        if width * levels >= _COMBINED_MAX:
            combined, width = _dense_rank(combined)
        combined = rank * width + combined
        width *= levels
    return combined


def _break_ties(
    order: np.ndarray,
    sorted_keys: np.ndarray,
    tied: np.ndarray,
    ids: RowIds,
    rows: np.ndarray | None,
) -> None:
    """Re-order, in place, every run of equal keys in ``order`` by (rid, resource).

    Runs are contiguous in ``order`` and their keys increase from run to run,
    so one sort of all tied positions by (key, rid, resource) puts each run
    in order without moving anything between runs.
    """
    in_run = np.zeros(len(order), dtype=bool)
    in_run[:-1] = tied
    in_run[1:] |= tied
    positions = np.flatnonzero(in_run)
    members = order[positions]
    at = members if rows is None else rows[members]
    rows_of = list(zip(sorted_keys[positions].tolist(), ids.rids[at].tolist(),
                       ids.resources[at].tolist(), strict=True))
    arranged = sorted(range(len(positions)), key=rows_of.__getitem__)
    if any(rows_of[a] == rows_of[b] for a, b in pairwise(arranged)):
        # Two rows with one (rid, resource) tie on every key: only the rest of
        # their fields can order them without looking at where they came in.
        others = [col[at].tolist() for col in _other_columns(ids)]
        if others:
            rows_of = [row + rest for row, rest in zip(rows_of, zip(*others, strict=True), strict=True)]
            arranged = sorted(range(len(positions)), key=rows_of.__getitem__)
    order[positions] = members[arranged]


# The columns that order twin rows, after the keys, the rid and the resource.
_TWIN_COLUMNS = ("reclaimable", "last_used", "priority", "reload_cost_s")


def _other_columns(ids: RowIds) -> list[np.ndarray]:
    out = []
    for name in _TWIN_COLUMNS:
        column = getattr(ids, name, None)
        if isinstance(column, np.ndarray):
            out.append(column)
    return out
