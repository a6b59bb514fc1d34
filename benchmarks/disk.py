"""Disk tier throughput: demote (write) and reload (read) through DiskPageStore,
against raw ``os.pwrite``/``os.pread`` of the same bytes to a file in the same
directory, in the same run.

Method:
- Pages have the default geometry (32 layers, K and V, 16 tokens, 8 KV heads,
  head dim 128, bf16: 2 MiB a page); the data is random normal bf16.
- The store writes requests of 64 pages (one extent each) from one thread,
  as a demotion would; the raw baseline writes the same bytes in 32 MiB
  pieces to one file. Both files are preallocated before timing and both are
  fsynced (untimed) after each pass, so no pass pays for the previous one's
  writeback. Timings exclude fsync: they are the rate a demotion sees.
- Warm reads: straight after writing, into a preallocated output buffer; once as
  the default read (staged: a failed read leaves the output as it was) and once with
  ``out_is_scratch=True`` (cached pieces read straight into the output, the rest
  copied in from a small bounce buffer, each piece checked; a failed read leaves it
  holding unspecified bytes). Each is
  alternated with its own raw passes, and the cold reads likewise.
- Cold reads: after fsync and ``posix_fadvise(DONTNEED)`` on every file; if that
  does not evict the pages (checked through ``Cached`` in /proc/meminfo),
  ``/proc/sys/vm/drop_caches`` is tried. What worked is recorded.
- Each measurement is the best of a few passes, alternating which side goes
  first; ratios are store / raw.
- Codecs: compression ratio (on an in-memory zarr store) and write/read rate
  (through the store on disk) for each codec, on a smaller sample of the same data.
- Floor (warm reads only): the same bytes read from the raw file by bare loops
  on the store's ``io_threads`` threads, 32 MiB a job in 1 MiB pieces, each piece
  checksummed (the store's crc32c) as it lands. ``staged`` reads into a scratch
  buffer copied into the output once every piece passed, as the store must (a
  failed read leaves the output untouched); ``unstaged`` reads straight into the
  output (no such guarantee); ``page-staged`` reads each page into a small buffer
  and copies it into the output once that page passed (unchecked bytes never reach
  the output, but a failed read may leave earlier, checked pages there). They bound
  what the store's warm read can reach on this machine: ``staged`` moves every byte
  through memory twice where pread moves it once (the default read), ``unstaged`` is
  what a read with ``out_is_scratch`` does with cached pages.
- Recorded with the figures: whether the store used its direct path (codec
  ``none`` on the local slot file), which crc32c implementation ran and whether
  it released the GIL, and the 1-minute load average before and after the timed
  passes, since other work on a small shared machine moves both sides.

Usage: python benchmarks/disk.py --out FILE.json [--bytes N] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from zarr.storage import MemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import table, write_json  # noqa: E402
from tiering.disk.crc import IMPLEMENTATION, RELEASES_GIL, ByteSpan  # noqa: E402
from tiering.disk.store import CODECS, DiskConfig, DiskPageStore  # noqa: E402

PAGE_SHAPE = (32, 2, 16, 8, 128)  # layers, K/V, tokens per page, KV heads, head dim
DTYPE = torch.bfloat16
CHUNK_BYTES = 32 << 20
REQUEST_PAGES = 64
WRITE_PASSES = 3
WARM_PASSES = 9
COLD_PASSES = 3
CODEC_SAMPLE_BYTES = 128 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _random_pages(num_pages: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pages = torch.empty((num_pages, *PAGE_SHAPE), dtype=DTYPE)
    for i in range(num_pages):
        pages[i] = torch.randn(PAGE_SHAPE, generator=gen, dtype=torch.float32).to(DTYPE)
    return pages


def _cached_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _fadvise_evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


class _Evictor:
    """Drops the page cache for the benchmark's files and remembers which way worked."""

    def __init__(self) -> None:
        self.fadvise_worked: bool | None = None
        self.drop_caches_worked: bool | None = None

    def evict(self, paths: list[Path], nbytes: int) -> bool:
        before = _cached_bytes()
        _fadvise_evict(paths)
        after = _cached_bytes()
        if before is not None and after is not None:
            self.fadvise_worked = before - after >= nbytes // 2
        if self.fadvise_worked:
            return True
        if self.drop_caches_worked is False:
            return False
        before = _cached_bytes()
        ok = _drop_caches()
        after = _cached_bytes()
        self.drop_caches_worked = bool(
            ok and before is not None and after is not None and before - after >= nbytes // 2
        )
        return self.drop_caches_worked

    @property
    def method(self) -> str | None:
        if self.fadvise_worked:
            return "posix_fadvise(POSIX_FADV_DONTNEED)"
        if self.drop_caches_worked:
            return "/proc/sys/vm/drop_caches"
        return None


class _RawFile:
    """The baseline: positional I/O of the same bytes, 32 MiB at a time, one file."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError:
            os.ftruncate(self.fd, nbytes)

    def write(self, src: np.ndarray) -> None:
        for off in range(0, self.nbytes, CHUNK_BYTES):
            piece = memoryview(src[off : off + CHUNK_BYTES])
            done = 0
            while done < len(piece):
                done += os.pwrite(self.fd, piece[done:], off + done)

    def read(self, dst: np.ndarray) -> None:
        for off in range(0, self.nbytes, CHUNK_BYTES):
            piece = memoryview(dst[off : off + CHUNK_BYTES])
            done = 0
            while done < len(piece):
                got = os.preadv(self.fd, [piece[done:]], off + done)
                if got <= 0:
                    raise OSError("raw baseline file ended early")
                done += got

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class _Floor:
    """Bare warm reads of the raw file with the store's checksum, on ``threads`` threads."""

    PIECE = 1 << 20

    def __init__(self, raw: _RawFile, threads: int) -> None:
        self.raw = raw
        self.pool = ThreadPoolExecutor(threads)
        self.scratch = np.empty(raw.nbytes, dtype=np.uint8)

    def _job(self, dst: np.ndarray, off: int) -> int:
        span = ByteSpan(dst)
        end = min(dst.nbytes, off + CHUNK_BYTES)
        crc = 0
        for start in range(off, end, self.PIECE):
            stop = min(end, start + self.PIECE)
            got = os.preadv(self.raw.fd, [span.view[start:stop]], start)
            if got != stop - start:
                raise OSError("raw baseline file ended early")
            crc = span.extend(crc, start, stop)
        return crc

    def _read_into(self, dst: np.ndarray) -> None:
        list(self.pool.map(lambda off: self._job(dst, off), range(0, dst.nbytes, CHUNK_BYTES)))

    def _page_job(self, dst: np.ndarray, off: int, page_bytes: int) -> None:
        bounce = np.empty(page_bytes, dtype=np.uint8)
        for page in range(off, min(dst.nbytes, off + CHUNK_BYTES), page_bytes):
            got = os.preadv(self.raw.fd, [bounce], page)
            if got != page_bytes:
                raise OSError("raw baseline file ended early")
            ByteSpan(bounce).extend(0, 0, None)
            dst[page : page + page_bytes] = bounce

    def page_staged(self, dst: np.ndarray, page_bytes: int) -> None:
        """Each page through a small buffer, copied into ``dst`` once that page passed."""
        jobs = range(0, dst.nbytes, CHUNK_BYTES)
        list(self.pool.map(lambda off: self._page_job(dst, off, page_bytes), jobs))

    def staged(self, dst: np.ndarray) -> None:
        self._read_into(self.scratch)
        np.copyto(dst, self.scratch)

    def unstaged(self, dst: np.ndarray) -> None:
        self._read_into(dst)

    def close(self) -> None:
        self.pool.shutdown()


def _store_for(root: Path, num_pages: int, codec: str) -> DiskPageStore:
    page_bytes = int(np.prod(PAGE_SHAPE)) * DTYPE.itemsize
    pages_per_chunk = max(1, CHUNK_BYTES // page_bytes)
    chunks = -(-num_pages // pages_per_chunk)
    cfg = DiskConfig(
        path=root,
        capacity_bytes=chunks * pages_per_chunk * page_bytes,
        chunk_bytes=CHUNK_BYTES,
        codec=codec,
    )
    return DiskPageStore(cfg, PAGE_SHAPE, DTYPE, fingerprint="benchmark")


class _StoreSide:
    """The store under test: one extent per request of REQUEST_PAGES pages."""

    def __init__(self, root: Path, pages: torch.Tensor, codec: str = "none") -> None:
        self.root = root
        self.pages = pages
        self.store = _store_for(root, pages.shape[0], codec)
        self.extents = []
        for i, start in enumerate(range(0, pages.shape[0], REQUEST_PAGES)):
            n = min(REQUEST_PAGES, pages.shape[0] - start)
            extent = self.store.reserve(f"request-{i}", n)
            if extent is None:
                raise RuntimeError("benchmark store refused a reservation it was sized for")
            self.extents.append((start, extent))

    def write(self) -> None:
        for start, extent in self.extents:
            self.store.write(extent, self.pages[start : start + extent.num_pages])

    def read(self, out: torch.Tensor, out_is_scratch: bool = False) -> None:
        for start, extent in self.extents:
            self.store.read(
                extent, out[start : start + extent.num_pages], out_is_scratch=out_is_scratch
            )

    def fsync(self) -> None:
        for path in _files_under(self.root):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.store.close()


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _alternate(
    passes: int, first: Callable[[], float], second: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """Run both sides ``passes`` times, swapping which goes first each pass."""
    a: list[float] = []
    b: list[float] = []
    for i in range(passes):
        if i % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


def _codec_figures(work: Path, sample: torch.Tensor) -> dict[str, dict[str, float]]:
    nbytes = sample.numel() * sample.element_size()
    out = torch.empty_like(sample)
    figures: dict[str, dict[str, float]] = {}
    for codec in CODECS:
        chunks: dict = {}
        mem_cfg = DiskConfig(
            store=MemoryStore(store_dict=chunks),
            capacity_bytes=_store_for_capacity(sample.shape[0]),
            chunk_bytes=CHUNK_BYTES,
            codec=codec,
        )
        with DiskPageStore(mem_cfg, PAGE_SHAPE, DTYPE) as mem:
            extent = mem.reserve("sample", sample.shape[0])
            assert extent is not None
            mem.write(extent, sample)
            stored = sum(len(v) for k, v in chunks.items() if k.startswith("c/"))
        side = _StoreSide(work / f"codec-{codec}", sample, codec)
        try:
            writes, reads = [], []
            for _ in range(3):
                writes.append(_timed(side.write))
                side.fsync()
                reads.append(_timed(lambda side=side: side.read(out)))
            if not torch.equal(out.view(torch.int16), sample.view(torch.int16)):
                raise RuntimeError(f"codec {codec}: read back differs from what was written")
        finally:
            side.close()
            shutil.rmtree(side.root, ignore_errors=True)
        figures[codec] = {
            "compression_ratio": nbytes / stored,
            "write_gbps": _gbps(nbytes, min(writes)),
            "read_gbps": _gbps(nbytes, min(reads)),
        }
    return figures


def _store_for_capacity(num_pages: int) -> int:
    page_bytes = int(np.prod(PAGE_SHAPE)) * DTYPE.itemsize
    ppc = max(1, CHUNK_BYTES // page_bytes)
    return -(-num_pages // ppc) * ppc * page_bytes


def run(total_bytes: int, base_dir: str | None, seed: int = 0) -> dict:
    page_bytes = int(np.prod(PAGE_SHAPE)) * DTYPE.itemsize
    num_pages = max(1, total_bytes // page_bytes)
    nbytes = num_pages * page_bytes
    if base_dir is not None:
        Path(base_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiering-disk-bench-", dir=base_dir))
    load_before = os.getloadavg()[0]
    try:
        pages = _random_pages(num_pages, seed)
        out = torch.zeros_like(pages)
        src = pages.view(torch.uint8).numpy().reshape(-1)
        dst = out.view(torch.uint8).numpy().reshape(-1)
        raw = _RawFile(work / "raw.bin", nbytes)
        side = _StoreSide(work / "store", pages)
        direct_io = side.store.direct_io
        io_threads = side.store.config.io_threads
        evictor = _Evictor()
        try:

            def raw_write() -> float:
                t = _timed(lambda: raw.write(src))
                raw.fsync()
                return t

            def store_write() -> float:
                t = _timed(side.write)
                side.fsync()
                return t

            store_w, raw_w = _alternate(WRITE_PASSES, store_write, raw_write)

            def check() -> None:
                if not torch.equal(out.view(torch.int16), pages.view(torch.int16)):
                    raise RuntimeError("store read back differs from what was written")

            def store_read(out_is_scratch: bool = False) -> float:
                out.zero_()
                t = _timed(lambda: side.read(out, out_is_scratch))
                check()
                return t

            def scratch_read() -> float:
                return store_read(out_is_scratch=True)

            def raw_read() -> float:
                return _timed(lambda: raw.read(dst))

            store_r, raw_r = _alternate(WARM_PASSES, store_read, raw_read)
            scratch_r, raw_rs = _alternate(WARM_PASSES, scratch_read, raw_read)

            floor = _Floor(raw, side.store.config.io_threads)
            try:

                def floor_read(read: Callable[[np.ndarray], None]) -> Callable[[], float]:
                    def go() -> float:
                        out.zero_()
                        t = _timed(lambda: read(dst))
                        check()
                        return t

                    return go

                staged_r, raw_r2 = _alternate(WARM_PASSES, floor_read(floor.staged), raw_read)
                unstaged_r, raw_r3 = _alternate(
                    WARM_PASSES, floor_read(floor.unstaged), raw_read
                )
                paged_r, raw_r4 = _alternate(
                    WARM_PASSES,
                    floor_read(lambda d: floor.page_staged(d, page_bytes)),
                    raw_read,
                )
            finally:
                floor.close()

            def cold(
                read: Callable[[], float], paths: Callable[[], list[Path]]
            ) -> Callable[[], float]:
                def go() -> float:
                    if not evictor.evict(paths(), nbytes):
                        return float("nan")
                    return read()

                return go

            store_c, raw_c = _alternate(
                COLD_PASSES,
                cold(store_read, lambda: _files_under(side.root)),
                cold(raw_read, lambda: [raw.path]),
            )
            scratch_c, raw_cs = _alternate(
                COLD_PASSES,
                cold(scratch_read, lambda: _files_under(side.root)),
                cold(raw_read, lambda: [raw.path]),
            )
            load_after = os.getloadavg()[0]
        finally:
            side.close()
            raw.close()
        sample_pages = max(1, min(num_pages, CODEC_SAMPLE_BYTES // page_bytes))
        codecs = _codec_figures(work, pages[:sample_pages].clone())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(times: list[float]) -> float | None:
        finite = [t for t in times if t == t]
        return _gbps(nbytes, min(finite)) if finite else None

    result = {
        "bytes": nbytes,
        "page_bytes": page_bytes,
        "page_shape": list(PAGE_SHAPE),
        "dtype": str(DTYPE),
        "chunk_bytes": CHUNK_BYTES,
        "request_pages": REQUEST_PAGES,
        "store": "SlotFileStore (zarr v3 array, crc32c on every chunk, one preallocated file)",
        "direct_io": direct_io,
        "crc_releases_gil": RELEASES_GIL,
        "crc_implementation": IMPLEMENTATION,
        "io_threads": io_threads,
        "load_avg_1min": [load_before, load_after],
        "write_gbps": best(store_w),
        "raw_write_gbps": best(raw_w),
        "read_gbps": best(store_r),
        "raw_read_gbps": best(raw_r),
        "read_cold_gbps": best(store_c),
        "raw_read_cold_gbps": best(raw_c),
        "read_scratch_gbps": best(scratch_r),
        "raw_read_scratch_gbps": best(raw_rs),
        "read_cold_scratch_gbps": best(scratch_c),
        "raw_read_cold_scratch_gbps": best(raw_cs),
        "cold_method": evictor.method,
        "fadvise_worked": evictor.fadvise_worked,
        "drop_caches_worked": evictor.drop_caches_worked,
        "passes": {"write": WRITE_PASSES, "warm_read": WARM_PASSES, "cold_read": COLD_PASSES},
        "all_gbps": {
            "write": [_gbps(nbytes, t) for t in store_w],
            "raw_write": [_gbps(nbytes, t) for t in raw_w],
            "read": [_gbps(nbytes, t) for t in store_r],
            "raw_read": [_gbps(nbytes, t) for t in raw_r],
            "read_cold": [_gbps(nbytes, t) for t in store_c if t == t],
            "raw_read_cold": [_gbps(nbytes, t) for t in raw_c if t == t],
            "read_scratch": [_gbps(nbytes, t) for t in scratch_r],
            "raw_read_scratch": [_gbps(nbytes, t) for t in raw_rs],
            "read_cold_scratch": [_gbps(nbytes, t) for t in scratch_c if t == t],
            "raw_read_cold_scratch": [_gbps(nbytes, t) for t in raw_cs if t == t],
        },
        "floor": {
            "staged_gbps": best(staged_r),
            "staged_ratio": _ratio(best(staged_r), best(raw_r2)),
            "unstaged_gbps": best(unstaged_r),
            "unstaged_ratio": _ratio(best(unstaged_r), best(raw_r3)),
            "page_staged_gbps": best(paged_r),
            "page_staged_ratio": _ratio(best(paged_r), best(raw_r4)),
            "raw_read_gbps": [best(raw_r2), best(raw_r3), best(raw_r4)],
        },
        "codecs": codecs,
        "codec_sample_bytes": sample_pages * page_bytes,
        "cpus": os.cpu_count(),
    }
    for key, a, b in (
        ("write_ratio", "write_gbps", "raw_write_gbps"),
        ("read_ratio", "read_gbps", "raw_read_gbps"),
        ("read_cold_ratio", "read_cold_gbps", "raw_read_cold_gbps"),
        ("read_scratch_ratio", "read_scratch_gbps", "raw_read_scratch_gbps"),
        ("read_cold_scratch_ratio", "read_cold_scratch_gbps", "raw_read_cold_scratch_gbps"),
    ):
        result[key] = _ratio(result[a], result[b])
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def print_table(r: dict) -> None:
    print(
        f"disk tier vs raw pwrite/pread: {r['bytes'] / 2**30:.2f} GiB, "
        f"{r['page_bytes'] >> 20} MiB pages, {r['chunk_bytes'] >> 20} MiB chunks, "
        f"GB/s with GB = 1e9 bytes, best of {r['passes']}"
    )
    rows = [
        (label, r[key + "_gbps"], r["raw_" + key + "_gbps"], r[key + "_ratio"])
        for label, key in (
            ("write", "write"),
            ("read warm", "read"),
            ("read cold", "read_cold"),
            ("read warm, out_is_scratch", "read_scratch"),
            ("read cold, out_is_scratch", "read_cold_scratch"),
        )
    ]
    print(table(rows, ("", "store GB/s", "raw GB/s", "store/raw")))
    print(f"cold reads: {r['cold_method'] or 'page cache could not be dropped'}")
    f = r["floor"]
    print(f"floor of a warm read, bare loops on {r['io_threads']} threads (ratio to pread "
          "measured alongside each):")
    rows = [
        ("staged (out untouched on failure)", f["staged_gbps"], f["staged_ratio"]),
        ("page-staged (verified pages land first)", f["page_staged_gbps"],
         f["page_staged_ratio"]),
        ("unstaged (reads into out)", f["unstaged_gbps"], f["unstaged_ratio"]),
    ]
    print(table(rows, ("", "GB/s", "/raw")))
    print(
        f"direct path: {r['direct_io']}, crc32c: {r['crc_implementation']} "
        f"(without the GIL: {r['crc_releases_gil']}), "
        f"{r['cpus']} CPUs, 1-min load before/after: "
        + "/".join(f"{x:.2f}" for x in r["load_avg_1min"])
    )
    print(f"codecs on {r['codec_sample_bytes'] >> 20} MiB of the same data:")
    rows = [
        (name, c["compression_ratio"], c["write_gbps"], c["read_gbps"])
        for name, c in r["codecs"].items()
    ]
    print(table(rows, ("codec", "ratio", "write GB/s", "read GB/s")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--bytes", type=int, default=1 << 30, help="bytes to move (default 1 GiB)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: temp dir)")
    args = parser.parse_args(argv)
    if args.bytes <= 0:
        parser.error("--bytes must be positive")
    result = run(args.bytes, args.dir)
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
