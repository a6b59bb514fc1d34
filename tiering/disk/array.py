"""The zarr array behind the disk tier: its codecs, creation, and the check on reattach.

One zarr v3 array of shape ``[rows, row_elems]`` (a row is one page, as
unsigned integers of the page dtype's width) chunked by ``[pages_per_chunk,
row_elems]``, with ``/``-separated chunk keys (``c/<i>/0``), fill value 0 and
``write_empty_chunks`` on. Codecs: bytes, then the optional compressor, then
crc32c on every chunk.

``raw_crc_chunks`` tells whether an array's chunks are encoded as plain bytes
in native order followed by their crc32c (codec ``none`` on a little-endian
host): then a chunk can be written and read directly, bypassing the codec
pipeline, and still be exactly what the pipeline produces.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import zarr
import zarr.api.asynchronous as zasync
from zarr.codecs import BloscCodec, BloscShuffle, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
from zarr.storage import StorePath

CODECS = ("none", "zstd", "blosc")


def page_codecs(codec: str, itemsize: int) -> tuple[BytesCodec, list[Any]]:
    """(serializer, compressors) for ``codec``; crc32c always comes last."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    compressors: list[Any] = []
    if codec == "zstd":
        compressors.append(ZstdCodec(level=1))
    elif codec == "blosc":
        compressors.append(
            BloscCodec(cname="lz4", clevel=5, shuffle=BloscShuffle.bitshuffle, typesize=itemsize)
        )
    compressors.append(Crc32cCodec())
    return BytesCodec(), compressors


def max_encoded_bytes(codec: str, raw_bytes: int) -> int:
    """An upper bound on one encoded chunk: raw bytes, compressor worst case, crc."""
    if codec == "none":
        return raw_bytes + 4
    return raw_bytes + raw_bytes // 128 + 4096


async def create_page_array(
    store_path: StorePath,
    *,
    rows: int,
    row_elems: int,
    pages_per_chunk: int,
    dtype: np.dtype,
    codec: str,
) -> zarr.AsyncArray[Any]:
    serializer, compressors = page_codecs(codec, dtype.itemsize)
    return await zasync.create_array(
        store_path,
        shape=(rows, row_elems),
        chunks=(pages_per_chunk, row_elems),
        dtype=dtype,
        serializer=serializer,
        compressors=compressors,
        filters=[],
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "/"},
        zarr_format=3,
        overwrite=True,
        config={"write_empty_chunks": True},
    )


def raw_crc_chunks(array: zarr.AsyncArray[Any]) -> bool:
    """Whether every chunk of ``array`` is stored as its raw bytes (C order, as they
    lie in memory here) followed by their crc32c, under a ``c/<i>/<j>`` key."""
    metadata = array.metadata
    codecs = getattr(metadata, "codecs", None)
    if codecs is None or len(codecs) != 2:
        return False
    serializer, checksum = codecs
    if not isinstance(serializer, BytesCodec) or not isinstance(checksum, Crc32cCodec):
        return False
    itemsize = np.dtype(array.dtype).itemsize
    if itemsize > 1 and (serializer.endian is None or serializer.endian.value != sys.byteorder):
        return False
    encoding = getattr(metadata, "chunk_key_encoding", None)
    return (
        isinstance(encoding, DefaultChunkKeyEncoding)
        and encoding.separator == "/"
        and array.order == "C"
    )


def page_array_mismatch(
    array: zarr.AsyncArray[Any],
    *,
    rows: int,
    row_elems: int,
    pages_per_chunk: int,
    dtype: np.dtype,
    codec: str,
) -> str | None:
    """Why an existing array is not the one we would create, or None if it is."""
    serializer, compressors = page_codecs(codec, dtype.itemsize)
    want = [_comparable(c.to_dict()) for c in (serializer, *compressors)]
    try:
        have = [_comparable(c.to_dict()) for c in array.metadata.codecs]  # type: ignore[union-attr]
        same = (
            array.shape == (rows, row_elems)
            and array.chunks == (pages_per_chunk, row_elems)
            and np.dtype(array.dtype) == dtype
            and have == want
        )
    except (AttributeError, TypeError) as exc:
        return f"array metadata not understood: {exc!r}"
    if same:
        return None
    return (
        f"array metadata differs: shape {array.shape} chunks {array.chunks} "
        f"dtype {array.dtype} codecs {have}"
    )


def _comparable(codec: dict[str, Any]) -> dict[str, Any]:
    """A codec's dict with the bytes codec's endianness (a platform detail) dropped."""
    codec = dict(codec)
    if codec.get("name") == "bytes":
        codec.pop("configuration", None)
    return codec
