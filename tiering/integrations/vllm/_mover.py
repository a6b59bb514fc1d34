"""The worker side of the vLLM backend: ``TieredMover`` copies bytes between
vLLM's per-layer KV tensors and this rank's host slab slots, as the manager's
load and store specs name them (``plan_blocks`` lays a block row out). Nothing
here imports vLLM; ``tiering.integrations.vllm._core`` re-exports these."""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from tiering.core.executor import OFFLOAD, RELOAD, PriorityExecutor
from tiering.core.transfer import StreamSet, coalesce, copy_runs
from tiering.core.validate import check_timeout
from tiering.integrations.vllm._config import HostSlab

log = logging.getLogger("tiering.integrations.vllm._core")  # the backend core's logger, as before the split

# ----------------------------------------------------------------------------- worker side


class LayerCopy(NamedTuple):
    """One KV tensor of a group: ``tensor`` (num_blocks, >= nbytes) uint8 view; its
    bytes go to ``offset`` .. ``offset + nbytes`` of a block's part of a host slot."""

    tensor: torch.Tensor
    offset: int
    nbytes: int


class GroupLayout(NamedTuple):
    copies: tuple[LayerCopy, ...]
    block_bytes: int  # bytes of one vLLM block of this group across its layers


def _is_index(v: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    if isinstance(v, bool) or type(v).__name__ in ("bool", "bool_"):  # numpy's bools too
        return False
    try:
        operator.index(v)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _indices(what: str, values: Iterable[object]) -> list[int]:
    """``values`` as a list of ints >= 0; a ValueError naming ``what`` otherwise."""
    out = []
    for v in values:
        if not _is_index(v) or operator.index(v) < 0:  # type: ignore[call-overload]
            raise ValueError(f"spec: every {what} must be an int >= 0, got {v!r}")
        out.append(operator.index(v))  # type: ignore[call-overload]
    return out


def plan_blocks(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: Sequence[int],
    blocks_per_chunk: int,
) -> list[tuple[int, list[int], list[int]]]:
    """Per KV group: (group, vLLM block ids, host rows) where a host row is
    ``slot * blocks_per_chunk + block-within-chunk``; slots are listed group by group,
    one per offloaded chunk the group's blocks touch.

    Every number must be an integer (numpy integers too; a bool or a float is
    refused): block ids, slots, group sizes and block indices >= 0,
    ``blocks_per_chunk`` >= 1. Anything else is a ValueError naming it. Ranges
    (a slot or block id past the end) are the mover's to check: it knows the sizes."""
    if not _is_index(blocks_per_chunk) or operator.index(blocks_per_chunk) < 1:
        raise ValueError(f"spec: blocks_per_chunk must be an int >= 1, got {blocks_per_chunk!r}")
    block_ids = _indices("block id", block_ids)
    group_sizes = _indices("group size", group_sizes)
    block_indices = _indices("block index", block_indices)
    slots = _indices("host slot", slots)
    blocks_per_chunk = operator.index(blocks_per_chunk)
    if sum(group_sizes) != len(block_ids) or len(block_indices) != len(group_sizes):
        raise ValueError(
            f"spec: {len(block_ids)} block ids vs group sizes {list(group_sizes)} "
            f"and block indices {list(block_indices)}"
        )
    out = []
    b = 0
    k = 0
    for g, (n, b0) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n == 0:
            continue
        first_chunk = b0 // blocks_per_chunk
        n_keys = (b0 + n - 1) // blocks_per_chunk - first_chunk + 1
        if k + n_keys > len(slots):
            raise ValueError(f"spec: group {g} needs {n_keys} host slots, {len(slots) - k} left")
        rows = []
        for j in range(n):
            idx = b0 + j
            slot = slots[k + idx // blocks_per_chunk - first_chunk]
            rows.append(int(slot) * blocks_per_chunk + idx % blocks_per_chunk)
        out.append((g, block_ids[b : b + n], rows))
        b += n
        k += n_keys
    if k != len(slots):
        raise ValueError(f"spec: {len(slots)} host slots but the blocks use {k}")
    return out


class JobResult(NamedTuple):
    job_id: int
    success: bool
    nbytes: int
    seconds: float


class TieredMover:
    """Worker side: copies between vLLM's per-layer block tensors and this rank's slab.

    ``groups[g]`` says where group g's layers lie in a host block row. A slot holds
    ``blocks_per_chunk`` block rows. Each job runs on a worker thread (the copy
    streams on a GPU); adjacent blocks that are adjacent in the slab are one copy
    per layer. A store job may also name slots past the slab (``num_slots + j``)
    and a ``staging`` path: those blocks are laid out as in a slot and written to
    row ``j`` of the file ``f"{staging}.r{rank}"``, ``STAGE_SLOTS`` slots at a time
    (the manager copies them into the disk tier once the job has completed).
    """

    STAGE_SLOTS = 16  # slots of a staging piece: the worker's extra host memory

    def __init__(
        self,
        groups: Sequence[GroupLayout],
        slab: HostSlab,
        blocks_per_chunk: int,
        *,
        threads: int = 2,
        device: torch.device | None = None,
        corrupt_loads: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        rank: int = 0,
    ) -> None:
        self.groups = list(groups)
        if not self.groups:
            raise ValueError("TieredMover: groups must name at least one KV group")
        if not _is_index(blocks_per_chunk) or blocks_per_chunk < 1:
            raise ValueError(
                f"TieredMover: blocks_per_chunk must be an int >= 1, got {blocks_per_chunk!r}"
            )
        if not _is_index(rank) or rank < 0:
            raise ValueError(f"TieredMover: rank must be an int >= 0, got {rank!r}")
        self.rank = rank
        self.slab = slab
        self.bpc = blocks_per_chunk
        row_bytes = max(g.block_bytes for g in self.groups)
        if row_bytes * blocks_per_chunk > slab.slot_bytes:
            raise ValueError(
                f"host slot of {slab.slot_bytes} B cannot hold {blocks_per_chunk} blocks "
                f"of {row_bytes} B"
            )
        self.row_bytes = slab.slot_bytes // blocks_per_chunk
        self.rows = slab.tensor.view(slab.num_slots * blocks_per_chunk, self.row_bytes)
        dev = device or (self.groups[0].copies[0].tensor.device if self.groups else torch.device("cpu"))
        self.streams = StreamSet(dev)
        self.corrupt_loads = corrupt_loads
        self._clock = clock
        self._exec = PriorityExecutor(threads, "tiering-vllm-copy")
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()
        # load staging files opened (their names removed: the manager holds them open too)
        self._load_fds: dict[str, int] = {}
        self._closed = False
        # per group: how many vLLM blocks every one of its tensors has
        self._group_blocks = [min((int(c.tensor.shape[0]) for c in g.copies), default=0)
                              for g in self.groups]
        self.counters = {"jobs": 0, "bytes": 0, "failed": 0, "refused": 0}

    def _check(self, job_id: object, plan: list[tuple[int, list[int], list[int]]],
               staging: str | None = None) -> None:
        """Why a job cannot run as given (ValueError), checked before any byte moves."""
        if not _is_index(job_id):
            raise ValueError(f"job id must be an int, got {job_id!r}")
        if self._closed:
            raise ValueError("the mover is shut down")
        if job_id in self._jobs:
            raise ValueError(f"job id {job_id} is already in flight")
        n_rows = int(self.rows.shape[0])
        for g, blocks, rows in plan:
            if g >= len(self.groups):
                raise ValueError(f"KV group {g} does not exist ({len(self.groups)} groups)")
            bad = next((b for b in blocks if b >= self._group_blocks[g]), None)
            if bad is not None:
                raise ValueError(
                    f"vLLM block id {bad} of group {g} is out of range "
                    f"({self._group_blocks[g]} blocks)"
                )
            bad = next((r for r in rows if r >= n_rows), None)
            if bad is not None and staging is None:
                raise ValueError(
                    f"host slot {bad // self.bpc} is out of range ({self.slab.num_slots} slots)"
                )

    def submit(self, job_id: int, store: bool, block_ids, group_sizes, block_indices, slots,
               staging: str | None = None) -> bool:
        """Queue one copy job; False (logged, nothing queued, no byte moved) for a spec
        that does not add up or points outside the slab (without ``staging``) or
        vLLM's tensors, a job id that is not an int or already in flight, or a shut
        down mover. With ``staging``, slots past the slab are rows of its file: a
        store writes them, a load reads them."""
        with self._lock:
            try:
                if staging is not None and not isinstance(staging, str):
                    raise ValueError(f"a staging path must be a str, got {staging!r}")
                plan = plan_blocks(block_ids, group_sizes, block_indices, slots, self.bpc)
                self._check(job_id, plan, staging)
            except ValueError as exc:
                log.error("tiering: job %r refused: %s", job_id, exc)
                self.counters["refused"] += 1
                return False
            marker = self.streams.compute_marker()
            fut = self._exec.submit(RELOAD if not store else OFFLOAD, self._run, store, plan,
                                    marker, staging)
            self._jobs[job_id] = fut
        return True

    def _run(self, store: bool, plan, marker, staging: str | None = None) -> tuple[int, float]:
        t0 = self._clock()
        nbytes = 0
        n_rows = int(self.rows.shape[0])
        staged = [(g, b, r - n_rows) for g, blocks, rows in plan
                  for b, r in zip(blocks, rows, strict=True) if r >= n_rows]
        if staged:
            assert staging is not None
            plan = [(g, [b for b, r in zip(blocks, rows, strict=True) if r < n_rows],
                     [r for r in rows if r < n_rows]) for g, blocks, rows in plan]
            path = f"{staging}.r{self.rank}"
            nbytes += (self._stage(staged, marker, path) if store
                       else self._unstage(staged, marker, path))
        for g, blocks, rows in plan:
            layout = self.groups[g]
            if store:
                runs = coalesce(blocks, rows)
            else:
                runs = coalesce(rows, blocks)
            for c in layout.copies:
                dev = c.tensor[:, : c.nbytes]
                host = self.rows[:, c.offset : c.offset + c.nbytes]
                if store:
                    copy_runs(self.streams, dev, host, runs, "d2h", after=marker)
                else:
                    copy_runs(self.streams, host, dev, runs, "h2d", after=marker)
                    if self.corrupt_loads:  # TEST ONLY negative control
                        for b in blocks:
                            c.tensor[b, : c.nbytes].bitwise_xor_(0x5A)
                nbytes += len(blocks) * c.nbytes
        return nbytes, self._clock() - t0

    def _stage(self, staged: list[tuple[int, int, int]], marker, path: str) -> int:
        """Write blocks (group, vLLM block, staging row) to the staging file, laid out
        as slab slots, ``STAGE_SLOTS`` slots at a time."""
        piece_rows = self.STAGE_SLOTS * self.bpc
        buf = torch.empty((piece_rows, self.row_bytes), dtype=torch.uint8)  # zeroed per piece
        nbytes = 0
        last = max(r for _, _, r in staged)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for base in range(0, last + 1, piece_rows):
                part = [(g, b, r - base) for g, b, r in staged if base <= r < base + piece_rows]
                if not part:
                    continue
                buf.zero_()
                for g in sorted({g for g, _, _ in part}):
                    blocks = [b for gg, b, _ in part if gg == g]
                    rows = [r for gg, _, r in part if gg == g]
                    runs = coalesce(blocks, rows)
                    for c in self.groups[g].copies:
                        copy_runs(self.streams, c.tensor[:, : c.nbytes],
                                  buf[:, c.offset : c.offset + c.nbytes], runs, "d2h",
                                  after=marker)
                        nbytes += len(blocks) * c.nbytes
                used = max(r for _, _, r in part) + 1
                used = -(-used // self.bpc) * self.bpc  # whole slots
                data = memoryview(buf[:used].numpy()).cast("B")
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], base * self.row_bytes + done)
        finally:
            os.close(fd)
        return nbytes

    def _unstage(self, staged: list[tuple[int, int, int]], marker, path: str) -> int:
        """Read blocks (group, vLLM block, staging row) from the staging file into
        vLLM's tensors, ``STAGE_SLOTS`` slots at a time."""
        piece_rows = self.STAGE_SLOTS * self.bpc
        buf = torch.empty((piece_rows, self.row_bytes), dtype=torch.uint8)
        data = memoryview(buf.numpy()).cast("B")
        nbytes = 0
        last = max(r for _, _, r in staged)
        with self._lock:
            fd = self._load_fds.get(path)
            if fd is None:  # the first load through this file: keep it open, drop its name
                fd = self._load_fds[path] = os.open(path, os.O_RDONLY)
                try:
                    os.unlink(path)
                except OSError:
                    pass
        for base in range(0, last + 1, piece_rows):
            part = [(g, b, r - base) for g, b, r in staged if base <= r < base + piece_rows]
            if not part:
                continue
            used = max(r for _, _, r in part) + 1
            want = used * self.row_bytes
            done = 0
            while done < want:
                n = os.preadv(fd, [data[done:want]], base * self.row_bytes + done)
                if n <= 0:
                    raise OSError(f"staging file {path}: short read at row {base}")
                done += n
            for g in sorted({g for g, _, _ in part}):
                blocks = [b for gg, b, _ in part if gg == g]
                rows = [r for gg, _, r in part if gg == g]
                runs = coalesce(rows, blocks)
                for c in self.groups[g].copies:
                    copy_runs(self.streams, buf[:, c.offset : c.offset + c.nbytes],
                              c.tensor[:, : c.nbytes], runs, "h2d", after=marker)
                    if self.corrupt_loads:  # TEST ONLY negative control
                        for b in blocks:
                            c.tensor[b, : c.nbytes].bitwise_xor_(0x5A)
                    nbytes += len(blocks) * c.nbytes
        return nbytes

    def get_finished(self) -> list[JobResult]:
        out = []
        with self._lock:
            done = [(j, f) for j, f in self._jobs.items() if f.done()]
            for j, _ in done:
                del self._jobs[j]
        for j, f in done:
            exc = f.exception()
            if exc is None:
                n, t = f.result()
                self.counters["jobs"] += 1
                self.counters["bytes"] += n
                out.append(JobResult(j, True, n, t))
            else:
                log.error("tiering: copy job %d failed: %r", j, exc)
                self.counters["failed"] += 1
                out.append(JobResult(j, False, 0, 0.0))
        return out

    def wait(self, job_ids: Iterable[int], timeout: float = 120.0) -> None:
        """Wait (at most ``timeout`` seconds in all) for these jobs; unknown ids are
        skipped. A timeout that is not a finite number >= 0 is a ValueError."""
        timeout = check_timeout("TieredMover.wait", timeout)
        with self._lock:
            futs = [self._jobs[j] for j in job_ids if j in self._jobs]
        deadline = time.monotonic() + timeout
        for f in futs:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # reported by get_finished
                pass

    def shutdown(self) -> None:
        """Finish queued copies and stop the copy threads (bounded); later submits are
        refused. A second call does nothing more."""
        with self._lock:
            self._closed = True
        self._exec.shutdown(30.0)
        with self._lock:
            fds, self._load_fds = list(self._load_fds.values()), {}
        for fd in fds:
            os.close(fd)
