"""The frame every cold-tier object carries: who it is, and a crc32c over all of it.

Layout (little-endian)::

    magic  b"TKVB"       4 bytes
    version              1 byte  (1)
    kind                 1 byte  (1 = shared block, 2 = private object)
    key length           2 bytes
    root length          2 bytes
    geometry length      2 bytes
    payload length       8 bytes
    key, root, geometry  (their lengths)
    payload              (its length)
    crc32c               4 bytes over everything before it

An object is accepted only if its magic, version, kind, key, root, geometry and payload length
all equal what the reader expects and the crc matches; otherwise :func:`unframe` raises
:class:`FrameRefused` with the reason, and the caller treats the object as lost (never served).
The frame adds ``HEADER_BYTES + len(key) + len(root) + len(geometry) + 4`` bytes; a payload is
stored at its own length (no padding).
"""

from __future__ import annotations

import struct

import google_crc32c

from tiering.errors import FrameRefused

__all__ = ["HEADER_BYTES", "KIND_BLOCK", "KIND_PRIVATE", "MAX_ID_BYTES", "FrameRefused",
           "frame", "framed_size", "unframe"]

MAGIC = b"TKVB"
VERSION = 1
KIND_BLOCK = 1
KIND_PRIVATE = 2
_HEAD = struct.Struct("<4sBBHHHQ")
HEADER_BYTES = _HEAD.size
MAX_ID_BYTES = 1024


def _check_kind(kind: object) -> None:
    if type(kind) is not int or kind not in (KIND_BLOCK, KIND_PRIVATE):
        raise ValueError(f"frame kind must be {KIND_BLOCK} (shared block) or {KIND_PRIVATE}"
                         f" (private object), got {kind!r}")


def _check_ids(key: bytes, root: bytes, geometry: bytes) -> None:
    for name, v in (("key", key), ("root", root), ("geometry", geometry)):
        if not isinstance(v, (bytes, bytearray)):
            raise ValueError(f"block {name} must be bytes, got {type(v).__name__}")
        if len(v) > MAX_ID_BYTES:
            raise ValueError(f"block {name} is {len(v)} bytes; at most {MAX_ID_BYTES}")
    if not key:
        raise ValueError("block key must not be empty")


def framed_size(key: bytes, root: bytes, geometry: bytes, payload_len: int) -> int:
    return HEADER_BYTES + len(key) + len(root) + len(geometry) + payload_len + 4


def frame(kind: int, key: bytes, root: bytes, geometry: bytes, payload) -> bytes:
    """The object's bytes for ``payload`` (any contiguous buffer)."""
    _check_kind(kind)
    _check_ids(key, root, geometry)
    try:
        body = memoryview(payload).cast("B")
    except TypeError as err:
        raise TypeError(f"frame payload must be a contiguous bytes-like buffer ({err})") from err
    head = _HEAD.pack(MAGIC, VERSION, kind, len(key), len(root), len(geometry), body.nbytes)
    out = bytearray(framed_size(key, root, geometry, body.nbytes))
    n = len(head)
    out[:n] = head
    for part in (key, root, geometry):
        out[n : n + len(part)] = part
        n += len(part)
    out[n : n + body.nbytes] = body
    n += body.nbytes
    crc = google_crc32c.value(bytes(out[:n]))
    out[n:] = crc.to_bytes(4, "little")
    return bytes(out)


def unframe(kind: int, data, key: bytes, root: bytes, geometry: bytes) -> memoryview:
    """The payload of ``data`` if it is exactly the object for (kind, key, root, geometry)."""
    _check_kind(kind)
    _check_ids(key, root, geometry)
    buf = memoryview(data).cast("B")
    if buf.nbytes < HEADER_BYTES + 4:
        raise FrameRefused(f"object is {buf.nbytes} bytes, shorter than a frame")
    magic, version, got_kind, klen, rlen, glen, plen = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FrameRefused(f"not a cold-tier object (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FrameRefused(f"frame version {version}, expected {VERSION}")
    if got_kind != kind:
        raise FrameRefused(f"object kind {got_kind}, expected {kind}")
    expect = HEADER_BYTES + klen + rlen + glen + plen + 4
    if buf.nbytes != expect:
        raise FrameRefused(f"object is {buf.nbytes} bytes, its header says {expect} (truncated or extended)")
    n = HEADER_BYTES
    fields = []
    for length in (klen, rlen, glen):
        fields.append(bytes(buf[n : n + length]))
        n += length
    if fields[0] != bytes(key):
        raise FrameRefused(f"object holds key {fields[0].hex()}, expected {bytes(key).hex()}")
    if fields[1] != bytes(root):
        raise FrameRefused("object was written under another root")
    if fields[2] != bytes(geometry):
        raise FrameRefused("object was written for another geometry")
    crc = int.from_bytes(buf[expect - 4 :], "little")
    if google_crc32c.value(bytes(buf[: expect - 4])) != crc:
        raise FrameRefused("crc32c mismatch: the object is damaged")
    return buf[n : n + plen]
