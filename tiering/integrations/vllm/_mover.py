"""The worker side of the vLLM backend: ``TieredMover`` copies bytes between
vLLM's per-layer KV tensors and this rank's host slab slots, as the manager's
load and store specs name them (``plan_blocks`` lays a block row out). Nothing
here imports vLLM; ``tiering.integrations.vllm._core`` re-exports these."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from tiering.core.executor import OFFLOAD, RELOAD, PriorityExecutor
from tiering.core.transfer import StreamSet, coalesce, copy_runs
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


def plan_blocks(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: Sequence[int],
    blocks_per_chunk: int,
) -> list[tuple[int, list[int], list[int]]]:
    """Per KV group: (group, vLLM block ids, host rows) where a host row is
    ``slot * blocks_per_chunk + block-within-chunk``; slots are listed group by group,
    one per offloaded chunk the group's blocks touch."""
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
        out.append((g, [int(x) for x in block_ids[b : b + n]], rows))
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
    per layer.
    """

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
    ) -> None:
        self.groups = list(groups)
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
        self.counters = {"jobs": 0, "bytes": 0, "failed": 0}

    def submit(self, job_id: int, store: bool, block_ids, group_sizes, block_indices, slots) -> bool:
        try:
            plan = plan_blocks(block_ids, group_sizes, block_indices, slots, self.bpc)
        except ValueError as exc:
            log.error("tiering: job %d refused: %s", job_id, exc)
            return False
        marker = self.streams.compute_marker()
        fut = self._exec.submit(RELOAD if not store else OFFLOAD, self._run, store, plan, marker)
        with self._lock:
            self._jobs[job_id] = fut
        return True

    def _run(self, store: bool, plan, marker) -> tuple[int, float]:
        t0 = self._clock()
        nbytes = 0
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
        with self._lock:
            futs = [self._jobs[j] for j in job_ids if j in self._jobs]
        deadline = time.monotonic() + timeout
        for f in futs:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # reported by get_finished
                pass

    def shutdown(self) -> None:
        self._exec.shutdown(30.0)
