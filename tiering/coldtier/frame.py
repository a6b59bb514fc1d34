"""The frame every cold-tier object carries: who it is, a crc32c, and a keyed MAC.

Layout (little-endian)::

    magic  b"TKVB"       4 bytes
    version              1 byte  (2)
    kind                 1 byte  (1 = shared block, 2 = private object)
    key length           2 bytes
    root length          2 bytes
    geometry length      2 bytes
    payload length       8 bytes
    key id               8 bytes (which deployment key made the MAC; zeros: no MAC)
    key, root, geometry  (their lengths)
    payload              (its length)
    MAC                 32 bytes: keyed BLAKE2b (:mod:`.trust`) over everything before it
                        (zeros without a key)
    crc32c               4 bytes over everything before it, the MAC included

The MAC covers the kind, the lengths, the key, root, geometry and payload, so only a holder of
the deployment secret can make an object that a reader with ``keys`` accepts; the crc32c tells
damage (a flipped bit anywhere, a cut) from a foreign object. An object is accepted only if its
magic and version are ours, its length is the one its header states, the crc matches, its
kind and ids equal what the reader expects and, when the reader has keys, the MAC verifies
under its current or previous key. Otherwise :func:`unframe` raises :class:`FrameRefused` with
the reason; :class:`FrameDamaged` (not a frame, cut, extended or failing its crc) is the only
refusal after which a reader may delete the object: nobody can ever read it, whoever wrote it.
An object of another frame version, kind, key, root, geometry or deployment key is refused and
left alone. ``keys=None`` writes and
reads without a MAC (the explicitly unauthenticated mode). The frame adds
``framed_size(key, root, geometry, 0)`` bytes; a payload is stored at its own length.
"""

from __future__ import annotations

import struct

import numpy as np

from tiering.disk.crc import crc32c_extend
from tiering.errors import FrameDamaged, FrameRefused, FrameUnauthenticated

from .trust import KEY_ID_BYTES, MAC_BYTES, NO_KEY, MacKeys

__all__ = ["HEADER_BYTES", "KIND_BLOCK", "KIND_PRIVATE", "MAX_ID_BYTES", "FrameDamaged", "FrameUnauthenticated",
           "FrameRefused", "frame", "framed_size", "unframe"]

MAGIC = b"TKVB"
VERSION = 2
KIND_BLOCK = 1
KIND_PRIVATE = 2
_HEAD = struct.Struct(f"<4sBBHHHQ{KEY_ID_BYTES}s")
HEADER_BYTES = _HEAD.size
TRAILER_BYTES = 4 + MAC_BYTES
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


def _check_keys(keys: object) -> None:
    if keys is not None and not isinstance(keys, MacKeys):
        raise ValueError(f"frame keys must be MacKeys or None (unauthenticated), got {type(keys).__name__}")


def framed_size(key: bytes, root: bytes, geometry: bytes, payload_len: int) -> int:
    return HEADER_BYTES + len(key) + len(root) + len(geometry) + payload_len + TRAILER_BYTES


def _crc(buf) -> int:
    return crc32c_extend(0, np.frombuffer(buf, dtype=np.uint8))


def frame(kind: int, key: bytes, root: bytes, geometry: bytes, payload, *,
          keys: MacKeys | None) -> bytes:
    """The object's bytes for ``payload`` (any contiguous buffer), tagged under ``keys``'s
    current key (``None``: no MAC, the unauthenticated mode)."""
    _check_kind(kind)
    _check_ids(key, root, geometry)
    _check_keys(keys)
    try:
        body = memoryview(payload).cast("B")
    except TypeError as err:
        raise TypeError(f"frame payload must be a contiguous bytes-like buffer ({err})") from err
    key_id = NO_KEY if keys is None else keys.key_id
    head = _HEAD.pack(MAGIC, VERSION, kind, len(key), len(root), len(geometry), body.nbytes, key_id)
    out = bytearray(framed_size(key, root, geometry, body.nbytes))
    n = len(head)
    out[:n] = head
    for part in (key, root, geometry):
        out[n : n + len(part)] = part
        n += len(part)
    out[n : n + body.nbytes] = body
    n += body.nbytes
    view = memoryview(out)
    if keys is not None:
        out[n : n + MAC_BYTES] = keys.tag(view[:n])
    n += MAC_BYTES
    out[n:] = _crc(view[:n]).to_bytes(4, "little")
    view.release()
    return bytes(out)


def unframe(kind: int, data, key: bytes, root: bytes, geometry: bytes, *,
            keys: MacKeys | None) -> memoryview:
    """The payload of ``data`` if it is exactly the object for (kind, key, root, geometry) and,
    with ``keys``, carries a MAC made under one of them."""
    _check_kind(kind)
    _check_ids(key, root, geometry)
    _check_keys(keys)
    buf = memoryview(data).cast("B")
    if buf.nbytes < HEADER_BYTES + TRAILER_BYTES:
        raise FrameRefused(f"object is {buf.nbytes} bytes, shorter than a frame")
    magic, version, got_kind, klen, rlen, glen, plen, key_id = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:  # not a frame at all: nobody can read it
        raise FrameDamaged(f"not a cold-tier object (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FrameRefused(f"frame version {version}, expected {VERSION}")
    n = HEADER_BYTES + klen + rlen + glen
    end = n + plen
    if buf.nbytes != end + TRAILER_BYTES:
        raise FrameDamaged(f"object is {buf.nbytes} bytes, its header says {end + TRAILER_BYTES}"
                           " (truncated or extended)")
    if _crc(buf[: end + MAC_BYTES]) != int.from_bytes(buf[end + MAC_BYTES :], "little"):
        raise FrameDamaged("crc32c mismatch: the object is damaged")
    if got_kind != kind:
        raise FrameRefused(f"object kind {got_kind}, expected {kind}")
    fields = []
    at = HEADER_BYTES
    for length in (klen, rlen, glen):
        fields.append(bytes(buf[at : at + length]))
        at += length
    if fields[0] != bytes(key):
        raise FrameRefused(f"object holds key {fields[0][:64].hex()}, expected {bytes(key).hex()}")
    if fields[1] != bytes(root):
        raise FrameRefused("object was written under another root")
    if fields[2] != bytes(geometry):
        raise FrameRefused("object was written for another geometry")
    if keys is not None:
        tag = bytes(buf[end : end + MAC_BYTES])
        if key_id == NO_KEY:
            raise FrameUnauthenticated("object carries no MAC (written with trust='unauthenticated')")
        if not keys.knows(key_id):
            raise FrameUnauthenticated(f"object is tagged under key {bytes(key_id).hex()}, which is neither"
                               " the current nor the previous deployment key")
        if not keys.verify(key_id, tag, buf[:end]):
            raise FrameUnauthenticated("MAC mismatch: the object was not written by a holder of the"
                               " deployment secret")
    return buf[n:end]


def crc32c_value(data) -> int:
    """crc32c of the bytes of ``data`` (any contiguous buffer; read in place, not copied)."""
    return _crc(memoryview(data).cast("B"))
