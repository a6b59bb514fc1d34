"""Loading production request traces into one small record type.

Three public formats are understood:

``mooncake``  JSON lines with ``timestamp`` (milliseconds from the start),
              ``input_length``, ``output_length`` and ``hash_ids`` (one id per
              512-token block of the prompt; equal ids mean an identical prefix
              up to and including that block).
``azure``     CSV with ``TIMESTAMP`` (a date-time), ``ContextTokens`` and
              ``GeneratedTokens`` (the Azure LLM inference traces).
``burstgpt``  CSV with ``Timestamp`` (seconds), ``Model``, ``Request tokens``,
              ``Response tokens``, ``Total tokens`` and ``Log Type``.

Every loader returns ``TraceRequest`` records sorted by arrival, with arrival
times in seconds from the earliest request. A line that cannot be read raises
``TraceFormatError`` naming the file and the line number.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tiering.errors import TraceFormatError

MOONCAKE_BLOCK_TOKENS = 512

FORMATS = ("mooncake", "azure", "burstgpt")

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURST_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``arrival_s``: seconds from the first request of the trace (>= 0).
    ``input_tokens`` (>= 1) and ``output_tokens`` (>= 0): prompt and response
    lengths. ``hash_ids``: the prompt's chain of block ids (empty when the trace
    has none); block ``i`` covers prompt tokens ``[512 i, 512 (i + 1))``. An id names
    the whole prefix up to its block, so no id appears twice in one chain.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.arrival_s, bool) or not isinstance(self.arrival_s, (int, float)) or not (
            math.isfinite(self.arrival_s) and self.arrival_s >= 0
        ):
            raise ValueError(f"TraceRequest.arrival_s must be a finite number >= 0, "
                             f"got {self.arrival_s!r}")
        if not _is_int(self.input_tokens) or self.input_tokens < 1:
            raise ValueError(f"TraceRequest.input_tokens must be an int >= 1, "
                             f"got {self.input_tokens!r}")
        if not _is_int(self.output_tokens) or self.output_tokens < 0:
            raise ValueError(f"TraceRequest.output_tokens must be an int >= 0, "
                             f"got {self.output_tokens!r}")
        if not isinstance(self.hash_ids, tuple) or not _block_ids(self.hash_ids):
            raise ValueError(f"TraceRequest.hash_ids must be a tuple of ints >= 0, "
                             f"got {self.hash_ids!r}")
        twice = _repeated_id(self.hash_ids)
        if twice is not None:
            raise ValueError(f"TraceRequest.hash_ids is not a chain: {_repeat_text(twice)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids(ids: Sequence[object]) -> bool:
    """Whether every id is an int >= 0 (not a bool)."""
    if all(type(h) is int for h in ids):  # the common case, checked in C
        return not ids or min(ids) >= 0
    return all(_is_int(h) and h >= 0 for h in ids)


def _repeated_id(ids: Sequence[int]) -> tuple[int, int, int] | None:
    """(id, first position, second position) of the first id that ``ids`` holds twice;
    None when every id is distinct."""
    if len(set(ids)) == len(ids):
        return None
    seen: dict[int, int] = {}
    for i, h in enumerate(ids):
        if h in seen:
            return h, seen[h], i
        seen[h] = i
    return None  # pragma: no cover - the set said there is a repeat


def _repeat_text(twice: tuple[int, int, int]) -> str:
    h, first, second = twice
    return (f"id {h} stands at positions {first} and {second}, but an id names the whole "
            "prefix up to its block, so it appears at most once in a chain")


def detect_format(path: str | Path) -> str:
    """The format of ``path``, from its extension and (for CSV) its header line."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix != ".csv":
        raise TraceFormatError(
            f"{p}: cannot tell the trace format from the extension {suffix!r}; "
            f"use a .jsonl or .csv file or name the format (one of {', '.join(FORMATS)})"
        )
    header = next(csv.reader(_lines(p)), [])
    names = {h.strip() for h in header}
    if all(c in names for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in names for c in _BURST_COLUMNS):
        return "burstgpt"
    raise TraceFormatError(
        f"{p}:1: header {header!r} matches no known CSV trace (azure needs "
        f"{list(_AZURE_COLUMNS)}, burstgpt needs {list(_BURST_COLUMNS)})"
    )


def load_trace(
    path: str | Path, fmt: str | None = None, limit: int | None = None
) -> list[TraceRequest]:
    """Read the trace at ``path`` (format detected unless ``fmt`` names it).

    ``limit`` keeps only the first ``limit`` requests of the file. The result
    is sorted by arrival (stable) and rebased so that the earliest arrival is 0.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {p} does not exist" if not p.exists()
                                else f"trace {p} is not a file")
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    fmt = detect_format(p) if fmt is None else fmt
    readers = {"mooncake": _read_mooncake, "azure": _read_azure, "burstgpt": _read_burstgpt}
    reader = readers.get(fmt)
    if reader is None:
        raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    lines = reader(p)
    try:
        for row in lines:
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    finally:
        lines.close()  # the file, too, when ``limit`` stopped early
    if not rows:
        raise TraceFormatError(f"{p}: the trace holds no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRequest(t - t0, i, o, h) for t, i, o, h in rows]


# -- readers: each yields (time in seconds, input, output, hash ids) -----------------


def _lines(p: Path) -> Iterator[str]:
    """The text lines of ``p`` (UTF-8, a leading byte-order mark dropped), each with its
    line ending; a line that is not UTF-8 raises ``TraceFormatError`` naming it."""
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise TraceFormatError(
                    f"{p}:{lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1})") from None


def _count(value: object, what: str, where: str, minimum: int) -> int:
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if not (digits.isascii() and digits.isdigit()):
            raise TraceFormatError(f"{where}: {what} must be an integer, got {value!r}")
        value = int(text)
    if not _is_int(value) or value < minimum:
        raise TraceFormatError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds(value: object, what: str, where: str) -> float:
    try:
        t = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceFormatError(f"{where}: {what} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(t) or t < 0:
        raise TraceFormatError(f"{where}: {what} must be a finite number >= 0, got {value!r}")
    return t


def _read_mooncake(p: Path) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for lineno, line in enumerate(_lines(p), start=1):  # decoded one line at a time
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceFormatError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceFormatError(f"{where}: missing field {key!r}")
        t = _seconds(obj["timestamp"], "timestamp", where) / 1000.0
        n_in = _count(obj["input_length"], "input_length", where, 1)
        n_out = _count(obj["output_length"], "output_length", where, 0)
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not _block_ids(ids):
            raise TraceFormatError(f"{where}: hash_ids must be a list of integers >= 0")
        twice = _repeated_id(ids)
        if twice is not None:
            raise TraceFormatError(f"{where}: hash_ids is not a chain: {_repeat_text(twice)}")
        yield t, n_in, n_out, tuple(ids)


def _csv_rows(p: Path, columns: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str]]]:
    reader = csv.reader(_lines(p))  # decoded one line at a time
    header = [h.strip() for h in next(reader, [])]
    missing = [c for c in columns if c not in header]
    if missing:
        raise TraceFormatError(f"{p}:1: header lacks column(s) {missing}; got {header}")
    index = {c: header.index(c) for c in columns}
    width = max(index.values()) + 1
    for fields in reader:
        if not fields or all(not x.strip() for x in fields):
            continue
        where = f"{p}:{reader.line_num}"
        if len(fields) < width:
            raise TraceFormatError(f"{where}: expected at least {width} fields, got {len(fields)}")
        yield where, {c: fields[i] for c, i in index.items()}


def _read_azure(p: Path) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for where, row in _csv_rows(p, _AZURE_COLUMNS):
        stamp = row["TIMESTAMP"].strip()
        try:
            moment = datetime.fromisoformat(stamp)
        except ValueError:
            raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} is not a date-time") from None
        if moment.tzinfo is None:  # the traces are in UTC; never apply a local offset
            moment = moment.replace(tzinfo=timezone.utc)
        t = moment.timestamp()
        n_in = _count(row["ContextTokens"], "ContextTokens", where, 1)
        n_out = _count(row["GeneratedTokens"], "GeneratedTokens", where, 0)
        yield t, n_in, n_out, ()


def _read_burstgpt(p: Path) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for where, row in _csv_rows(p, _BURST_COLUMNS):
        t = _seconds(row["Timestamp"].strip(), "Timestamp", where)
        n_in = _count(row["Request tokens"], "Request tokens", where, 1)
        n_out = _count(row["Response tokens"], "Response tokens", where, 0)
        yield t, n_in, n_out, ()
