"""The disk tier's manifest: which owners hold which chunks, in a self-checking JSON document.

The manifest lists only *committed* entries (an owner's chunks were fully
written, then committed). It carries the writer's fingerprint and storage
layout, and a crc32c of its own canonical body, so that a reader can tell an
intact manifest written for this geometry from a torn, edited or foreign one.
``decode_manifest`` either returns every entry or raises ``ManifestError`` with
the reason; it never returns a partial result.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import google_crc32c

from tiering.errors import ManifestError

MANIFEST_KEY = "tiering-manifest.json"
MANIFEST_VERSION = 2


class ManifestEntry(NamedTuple):
    """One committed owner: its chunk indices, page count, caller metadata, generation."""

    chunks: tuple[int, ...]
    num_pages: int
    meta: dict[str, Any]
    generation: int = 0


class Manifest(NamedTuple):
    """A decoded manifest: its entries and the next generation the writer would hand out."""

    entries: dict[str, ManifestEntry]
    next_generation: int


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _checksum(body: Mapping[str, Any]) -> str:
    return f"{google_crc32c.value(_canonical(body)):08x}"


def encode_manifest(
    fingerprint: str,
    layout: Mapping[str, Any],
    entries: Mapping[str, ManifestEntry],
    *,
    store_id: str,
    next_generation: int,
) -> bytes:
    """Serialise the committed entries; raises ValueError if a meta is not JSON-safe."""
    body = {
        "version": MANIFEST_VERSION,
        "fingerprint": fingerprint,
        "store_id": store_id,
        "next_generation": int(next_generation),
        "layout": dict(layout),
        "entries": {
            owner: {
                "runs": to_runs(e.chunks),
                "num_pages": e.num_pages,
                "generation": e.generation,
                "meta": e.meta,
            }
            for owner, e in entries.items()
        },
    }
    try:
        checksum = _checksum(body)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"manifest entry meta is not JSON-serialisable: {exc}") from exc
    return json.dumps({"body": body, "checksum": checksum}, indent=1).encode()


def decode_manifest(
    raw: bytes,
    *,
    fingerprint: str,
    layout: Mapping[str, Any],
    capacity_chunks: int,
    pages_per_chunk: int,
    store_id: str,
) -> Manifest:
    """Parse and verify a manifest written by this store identity for this fingerprint
    and layout.

    Checks, in order: it parses; its checksum matches its body; version,
    store identity, fingerprint and layout equal ours; every entry names in-range
    chunks, just enough of them for its page count, and no chunk is claimed
    twice; every generation is below the manifest's next generation.
    """
    try:
        doc = json.loads(raw)
        body, checksum = doc["body"], doc["checksum"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ManifestError(f"manifest does not parse: {exc!r}") from exc
    if not isinstance(body, dict) or _checksum(body) != checksum:
        raise ManifestError("manifest checksum does not match its contents")
    if body.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {body.get('version')!r} is not {MANIFEST_VERSION}")
    if body.get("store_id") != store_id:
        raise ManifestError(
            f"manifest was written by store {body.get('store_id')!r}, not by this store "
            f"{store_id!r} (copied from another store?)"
        )
    next_generation = body.get("next_generation")
    if type(next_generation) is not int or next_generation < 1:
        raise ManifestError(f"manifest has a bad next generation {next_generation!r}")
    if body.get("fingerprint") != fingerprint:
        raise ManifestError(
            f"manifest fingerprint {body.get('fingerprint')!r} differs from ours {fingerprint!r}"
        )
    if body.get("layout") != dict(layout):
        raise ManifestError(f"manifest layout {body.get('layout')!r} differs from ours {layout!r}")
    entries_doc = body.get("entries")
    if not isinstance(entries_doc, dict):
        raise ManifestError("manifest has no entries table")
    entries: dict[str, ManifestEntry] = {}
    claimed: set[int] = set()
    for owner, item in entries_doc.items():
        entry = _entry(owner, item, capacity_chunks, pages_per_chunk, claimed)
        if not 1 <= entry.generation < next_generation:
            raise ManifestError(
                f"manifest entry {owner!r} has generation {entry.generation}, outside "
                f"[1, {next_generation})"
            )
        entries[owner] = entry
    return Manifest(entries, next_generation)


def to_runs(slots: tuple[int, ...]) -> list[list[int]]:
    """Slot indices as [start, length] runs of consecutive slots (compact for big extents)."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1][1] += 1
        else:
            runs.append([int(slot), 1])
    return runs


def from_runs(runs: Any) -> tuple[int, ...]:
    """The inverse of ``to_runs``; ValueError for anything but [int, int >= 1] pairs."""
    slots: list[int] = []
    for run in runs:
        start, length = run
        if type(start) is not int or type(length) is not int or length < 1:
            raise ValueError(f"bad run {run!r}")
        slots.extend(range(start, start + length))
    return tuple(slots)


def _entry(
    owner: str, item: Any, capacity_chunks: int, pages_per_chunk: int, claimed: set[int]
) -> ManifestEntry:
    try:
        chunks = from_runs(item["runs"])
        num_pages = item["num_pages"]
        meta = item["meta"]
        generation = item["generation"]
    except (TypeError, KeyError, ValueError) as exc:
        raise ManifestError(f"manifest entry {owner!r} is malformed: {exc!r}") from exc
    if not all(type(c) is int and 0 <= c < capacity_chunks for c in chunks):
        raise ManifestError(f"manifest entry {owner!r} names chunks out of range: {chunks}")
    if type(num_pages) is not int or num_pages < 1:
        raise ManifestError(f"manifest entry {owner!r} has a bad page count {num_pages!r}")
    if len(chunks) != -(-num_pages // pages_per_chunk):
        raise ManifestError(
            f"manifest entry {owner!r}: {len(chunks)} chunks cannot hold exactly "
            f"{num_pages} pages of {pages_per_chunk} per chunk"
        )
    if type(generation) is not int:
        raise ManifestError(f"manifest entry {owner!r} has a bad generation {generation!r}")
    if not isinstance(meta, dict):
        raise ManifestError(f"manifest entry {owner!r} meta is not a dict")
    overlap = claimed.intersection(chunks)
    if overlap or len(set(chunks)) != len(chunks):
        raise ManifestError(f"manifest entry {owner!r} claims chunks twice: {sorted(overlap)}")
    claimed.update(chunks)
    return ManifestEntry(chunks, num_pages, meta, generation)
