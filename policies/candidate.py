"""What a policy ranks: one ``Candidate`` record, or many as a ``CandidateBatch`` of columns.

A ``Candidate`` is the readable form, one immutable record per (request,
resource). A ``CandidateBatch`` holds the same fields as aligned columns, so a
policy can order 100,000 candidates with a few array operations instead of
100,000 Python objects. Both check what they are given: a NaN or a wrong type
would make an order depend on the input order, so it is refused at the door.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Any

import numpy as np

from tiering.types import Tier

_MAX_BYTES = 2**63  # reclaimable bytes must stay below this (they are compared as int64)


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
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"Candidate.rid must be a non-empty str, got {self.rid!r}")
        if (
            not isinstance(self.reclaimable, int)
            or isinstance(self.reclaimable, bool)
            or not 0 < self.reclaimable < _MAX_BYTES
        ):
            raise ValueError(
                f"Candidate {self.rid!r}: reclaimable must be an int in [1, 2**63) (a request "
                f"with nothing to reclaim is not a candidate), got {self.reclaimable!r}"
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


# Building a record from a batch row skips ``__post_init__``: every value comes
# from a batch column that was checked as a whole when the batch was made
# (non-empty str ids, int64 bytes in range, finite floats, a Tier), so checking
# each record again would only repeat that work, one Python call per field.
# The setters are the slot descriptors of the fields, in declaration order; a
# new field must be added to ``_unchecked_record`` as well (the batch tests
# compare its records with ones built the checked way).
_FIELDS = tuple(f.name for f in fields(Candidate))
if _FIELDS != ("rid", "reclaimable", "last_used", "tier", "priority", "reload_cost_s",
               "resource"):
    raise ImportError(f"Candidate fields changed to {_FIELDS}; update _unchecked_record")
_SET_RID, _SET_BYTES, _SET_LAST, _SET_TIER, _SET_PRIO, _SET_COST, _SET_RES = (
    Candidate.__dict__[name].__set__ for name in _FIELDS
)
_new = object.__new__


def _unchecked_record(
    rid: str, nbytes: int, last: float, tier: Tier, prio: float, cost: float, resource: str
) -> Candidate:
    record = _new(Candidate)
    _SET_RID(record, rid)
    _SET_BYTES(record, nbytes)
    _SET_LAST(record, last)
    _SET_TIER(record, tier)
    _SET_PRIO(record, prio)
    _SET_COST(record, cost)
    _SET_RES(record, resource)
    return record


class _Column:
    """A read-only column of a ``CandidateBatch``: ``batch.name`` is ``batch._column("_name")``."""

    __slots__ = ("name", "slot")

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, batch: Any, owner: type | None = None) -> Any:
        return self if batch is None else batch._column(self.slot)

    def __set__(self, batch: Any, value: Any) -> None:
        raise AttributeError(f"CandidateBatch.{self.name} is read-only")


class CandidateBatch:
    """Candidates as aligned columns, one row per (request, resource).

    ``rids``, ``resources``   1-D object arrays of str
    ``reclaimable``           int64 bytes, or None when they have not been asked
                              for yet (a caller that asks lazily, see
                              ``Policy.needs_reclaimable``)
    ``last_used``, ``priority``, ``reload_cost_s``   float64
    ``tier``                  the tier of every row built from columns

    Same meaning and the same checks as ``Candidate``, field for field. The
    columns are read-only; a batch never changes once made. Row ``i`` of every
    column describes the same candidate; a policy answers with row indices.

    Make one with the constructor (every column checked), ``from_candidates``
    (records, already checked) or ``of_registered`` (ids the caller vouches for).
    """

    __slots__ = (
        "_n", "_rids", "_resources", "_reclaimable", "_last_used", "_priority",
        "_reload_cost_s", "_tier", "_records",
    )

    def __init__(
        self,
        rids: Sequence[str],
        last_used: Sequence[float] | np.ndarray,
        *,
        reclaimable: Sequence[int] | np.ndarray | None = None,
        priority: Sequence[float] | np.ndarray | None = None,
        reload_cost_s: Sequence[float] | np.ndarray | None = None,
        resources: str | Sequence[str] = "",
        tier: Tier = Tier.DEVICE,
    ) -> None:
        for name, given in (("rids", rids), ("resources", resources)):
            if name == "resources" and isinstance(given, str):
                continue  # one name for every row
            if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
                raise ValueError(
                    f"CandidateBatch.{name} must be a sequence of str, got "
                    f"{type(given).__name__} {given!r}"
                )
        rid_col = _object_column(rids)
        for index, rid in enumerate(rid_col):
            if not isinstance(rid, str) or not rid:
                raise ValueError(
                    f"CandidateBatch.rids[{index}] must be a non-empty str, got {rid!r}"
                )
        if isinstance(resources, str):
            res_col = _constant_column(resources, len(rid_col))
        else:
            res_col = _object_column(resources)
            for index, name in enumerate(res_col):
                if not isinstance(name, str):
                    raise ValueError(
                        f"CandidateBatch.resources[{index}] must be a str, got {name!r}"
                    )
        if not isinstance(tier, Tier):
            raise ValueError(f"CandidateBatch.tier must be a Tier, got {tier!r}")
        self._fill(rid_col, res_col, reclaimable, last_used, priority, reload_cost_s, tier)

    @classmethod
    def of_registered(
        cls,
        rids: np.ndarray,
        resources: np.ndarray,
        last_used: np.ndarray,
        *,
        reclaimable: np.ndarray | None = None,
        priority: np.ndarray | None = None,
        reload_cost_s: np.ndarray | None = None,
        tier: Tier = Tier.DEVICE,
    ) -> CandidateBatch:
        """A batch whose ids the caller has already checked, one by one, elsewhere.

        ``rids`` and ``resources`` are 1-D object arrays of the same length
        holding non-empty str ids and str names. The eviction controller
        qualifies: it checks every request id once, in ``add_request``, and
        every resource name once, in its constructor, so checking them again
        per row (a Python call each) would only repeat that. The numeric
        columns are checked exactly as the constructor checks them; so are the
        column lengths and the tier. The batch takes ``rids`` and
        ``resources`` over, uncopied, and makes them read-only: pass arrays
        nothing else holds.
        """
        for name, col in (("rids", rids), ("resources", resources)):
            if not isinstance(col, np.ndarray) or col.dtype != object or col.ndim != 1:
                raise ValueError(f"CandidateBatch.{name} must be a 1-D object array here")
        if not isinstance(tier, Tier):
            raise ValueError(f"CandidateBatch.tier must be a Tier, got {tier!r}")
        batch = cls.__new__(cls)
        batch._fill(rids, resources, reclaimable, last_used, priority, reload_cost_s, tier)
        return batch

    @classmethod
    def from_candidates(cls, candidates: Sequence[Candidate]) -> CandidateBatch:
        """The columns of ``candidates`` (records check themselves when made).

        Each column is gathered from the records the first time it is read,
        so a policy pays only for the fields it orders by. ``records()`` of
        such a batch returns the very records given.
        """
        if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__"):
            raise ValueError(
                f"CandidateBatch.from_candidates needs a sequence of Candidate, got "
                f"{type(candidates).__name__}"
            )
        records = tuple(candidates)
        if not set(map(type, records)) <= {Candidate}:
            for index, record in enumerate(records):
                if not isinstance(record, Candidate):
                    raise ValueError(
                        f"CandidateBatch.from_candidates: item {index} is a "
                        f"{type(record).__name__}, not a Candidate"
                    )
        batch = cls.__new__(cls)
        batch._n = len(records)
        batch._rids = batch._resources = batch._reclaimable = _NOT_YET
        batch._last_used = batch._priority = batch._reload_cost_s = _NOT_YET
        batch._tier = records[0].tier if records else Tier.DEVICE
        batch._records = records
        return batch

    def _fill(
        self,
        rid_col: np.ndarray,
        res_col: np.ndarray,
        reclaimable: object,
        last_used: object,
        priority: object,
        reload_cost_s: object,
        tier: Tier,
    ) -> None:
        n = len(rid_col)
        if len(res_col) != n:
            raise ValueError(f"CandidateBatch got {len(res_col)} resources for {n} rids")
        self._n = n
        self._rids = _readonly(rid_col)
        self._resources = _readonly(res_col)
        self._last_used = _float_column("last_used", last_used, n)
        self._priority = _float_column("priority", priority, n)
        cost = _float_column("reload_cost_s", reload_cost_s, n)
        if n and cost.min() < 0:
            bad = int(np.flatnonzero(cost < 0)[0])
            raise ValueError(
                f"CandidateBatch.reload_cost_s must be >= 0, got {cost[bad]!r} for "
                f"{rid_col[bad]!r}"
            )
        self._reload_cost_s = cost
        self._reclaimable = None if reclaimable is None else _bytes_column(reclaimable, n)
        self._tier = tier
        self._records = None

    # -- columns ------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def _column(self, slot: str) -> np.ndarray | None:
        value = getattr(self, slot)
        if value is _NOT_YET:  # a batch of records: gather the field once
            value = _GATHER[slot](self._records)
            setattr(self, slot, value)
        return value

    # read-only columns, gathered on first use (``reclaimable`` is None when not asked)
    rids = _Column()
    resources = _Column()
    reclaimable = _Column()
    last_used = _Column()
    priority = _Column()
    reload_cost_s = _Column()

    @property
    def tier(self) -> Tier:
        return self._tier

    def __repr__(self) -> str:
        known = "not asked" if self._reclaimable is None else "known"
        return f"CandidateBatch({len(self)} rows, reclaimable {known})"

    # -- records --------------------------------------------------------------------

    def records(
        self,
        rows: Sequence[int] | np.ndarray | None = None,
        *,
        reclaimable: Sequence[int] | np.ndarray | None = None,
    ) -> list[Candidate]:
        """``Candidate`` records of ``rows`` (default: all), in that order.

        ``reclaimable`` gives the bytes of those rows when the batch does not
        carry them (or replaces what it carries): ints in [1, 2**63), one per
        row (each > 0, as a ``Candidate``'s). A batch made ``from_candidates`` returns its
        own records.
        """
        if rows is None:
            index = np.arange(len(self), dtype=np.int64)
        else:
            given = np.asarray(rows)
            if given.ndim != 1:
                raise ValueError("CandidateBatch.records: rows must be 1-D")
            if len(given) and given.dtype.kind not in "iu":
                raise ValueError(
                    f"CandidateBatch.records: rows must be ints, got dtype {given.dtype}"
                )
            index = given.astype(np.int64)
        if len(index) and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"CandidateBatch.records: a row is out of range for {len(self)} rows")
        if self._records is not None:
            picked = [self._records[i] for i in index.tolist()]
            if reclaimable is None:
                return picked
            sizes = _bytes_column(reclaimable, len(index))
            return [
                record if record.reclaimable == nbytes else replace(record, reclaimable=nbytes)
                for record, nbytes in zip(picked, sizes.tolist(), strict=True)
            ]
        if reclaimable is not None:
            sizes = _bytes_column(reclaimable, len(index))
        elif self._reclaimable is not None:
            sizes = self._reclaimable[index]
        else:
            raise ValueError(
                "CandidateBatch.records: this batch's reclaimable bytes were not asked "
                "for; pass reclaimable="
            )
        tier = self._tier
        return [
            _unchecked_record(rid, nbytes, last, tier, prio, cost, name)
            for rid, nbytes, last, prio, cost, name in zip(
                self._rids[index].tolist(),
                sizes.tolist(),
                self._last_used[index].tolist(),
                self._priority[index].tolist(),
                self._reload_cost_s[index].tolist(),
                self._resources[index].tolist(),
                strict=True,
            )
        ]


_NOT_YET = object()  # a column of a records batch not gathered yet


def _gather_objects(field: str):
    get = attrgetter(field)
    return lambda records: _readonly(_object_column(list(map(get, records))))


def _gather_numbers(field: str, dtype: type):
    get = attrgetter(field)
    return lambda records: _readonly(
        np.fromiter(map(get, records), dtype=dtype, count=len(records))
    )


_GATHER = {
    "_rids": _gather_objects("rid"),
    "_resources": _gather_objects("resource"),
    "_reclaimable": _gather_numbers("reclaimable", np.int64),
    "_last_used": _gather_numbers("last_used", np.float64),
    "_priority": _gather_numbers("priority", np.float64),
    "_reload_cost_s": _gather_numbers("reload_cost_s", np.float64),
}


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _object_column(values: Sequence[object]) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values.copy()
    items = list(values)
    column = np.empty(len(items), dtype=object)
    column[:] = items
    return column


def _constant_column(value: str, n: int) -> np.ndarray:
    column = np.empty(n, dtype=object)
    column.fill(value)
    return column


def _numeric_source(name: str, values: object, n: int) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != (n,):
        raise ValueError(f"CandidateBatch.{name} has shape {array.shape}; expected ({n},)")
    if n and array.dtype.kind not in "iuf":
        raise ValueError(f"CandidateBatch.{name} must hold numbers, got dtype {array.dtype}")
    return array


def _float_column(name: str, values: object, n: int) -> np.ndarray:
    if values is None:
        return _readonly(np.zeros(n, dtype=np.float64))
    column = np.array(_numeric_source(name, values, n), dtype=np.float64)
    if n and not np.isfinite(column).all():
        raise ValueError(
            f"CandidateBatch.{name} must be finite, got {column[~np.isfinite(column)][0]!r}"
        )
    return _readonly(column)


def _bytes_column(values: object, n: int) -> np.ndarray:
    array = _numeric_source("reclaimable", values, n)
    if n and array.dtype.kind not in "iu":
        raise ValueError(f"CandidateBatch.reclaimable must hold ints, got dtype {array.dtype}")
    if n and (int(array.min()) <= 0 or int(array.max()) >= _MAX_BYTES):
        bad = int(np.flatnonzero((array <= 0) | (array >= _MAX_BYTES))[0])
        raise ValueError(
            f"CandidateBatch.reclaimable must be in [1, 2**63) (a request with nothing to "
            f"reclaim is not a candidate), got {array[bad]!r} at row {bad}"
        )
    return _readonly(np.array(array, dtype=np.int64))
