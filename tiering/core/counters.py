"""One helper for the plain integer counter records the layers keep.

``counter_record`` builds a mutable dataclass whose named fields are ints starting
at 0 (``extra`` adds fields of other types, with their defaults), so a record of
counters is declared by its names and its docstring instead of a column of
``name: int = 0`` lines repeated in every module that counts something.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def counter_record(
    name: str,
    counters: str,
    *,
    doc: str,
    module: str,
    extra: Sequence[tuple[str, Any, Any]] = (),
) -> type:
    """A dataclass ``name`` with one int field (default 0) per word of ``counters``.

    ``extra`` holds ``(field, type, dataclasses.field(...))`` triples appended after the
    counters. The record gets ``as_dict()`` (field name to value). ``module`` is the defining module's ``__name__`` (for reprs and pickling).
    """
    names = counters.split()
    if not names:
        raise ValueError(f"counter_record {name!r}: no counter names given")
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"counter_record {name!r}: counter names are not identifiers: {bad}")
    every = names + [e[0] for e in extra]
    repeated = sorted({n for n in every if every.count(n) > 1})
    if repeated:
        raise ValueError(f"counter_record {name!r}: field names repeat: {repeated}")
    spec: list[tuple[str, Any, Any]] = [(n, int, dataclasses.field(default=0)) for n in names]
    namespace = {"__doc__": doc, "as_dict": _as_dict}
    cls = dataclasses.make_dataclass(name, spec + list(extra), namespace=namespace)
    cls.__module__ = module
    cls.__qualname__ = name
    return cls


def _as_dict(self: Any) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
