"""The runs of one replay (every seed x every run of a grid) in a process pool, and each
finished run kept on disk as it finishes.

Each run is independent (its own trace copy, simulator, policies and KV model), so
``run_all`` with ``jobs`` > 1 runs them in a pool of that many worker processes
and hands each result to ``deliver`` in the order the sequential loop would (seed by
seed, run by run), so every output equals that of one process. Each worker names its
run on stderr as it starts and ends (``Progress`` lines). ``Keeper`` appends every
finished run's row to ``DIR/runs.jsonl`` the moment it is back, so a replay stopped
with Ctrl-C keeps what it had done; the caller removes the file once the whole replay
is written.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tiering.apps.replay.progress import Progress
from tiering.apps.replay.seeds import jitter
from tiering.apps.replay.sweep import run_grid
from tiering.errors import PolicyFailed


class JobContext(NamedTuple):
    """What every run needs (sent once to each worker task)."""

    trace: Sequence[Any]
    model: Any
    hardware: Any
    grid: Any
    sim: Any
    time_scale: float
    block_registry: Any
    keys: Sequence[str]  # each run's name, by index
    seeds: int
    quiet: bool
    decisions: bool  # keep each run's decision log in its result


class RunDone(NamedTuple):
    """One finished run (``result`` only for the first seed, whose results the report
    reads), or the message of a policy that stopped it."""

    seed: int
    index: int
    row: dict | None
    result: Any
    failed: str | None


def run_one(ctx: JobContext, task: tuple[int, int], stream=None) -> RunDone:
    """Run ``task`` (seed, run index) alone, as the sequential loop would run it."""
    seed, i = task
    trace = jitter(ctx.trace, seed)
    prefix = f"seed {seed + 1}/{ctx.seeds} " if ctx.seeds > 1 else ""
    progress = Progress(len(ctx.keys), len(trace), stream=stream, tty=False, quiet=ctx.quiet,
                        prefix=prefix)
    got: list = []

    def on_result(row, result) -> None:
        progress.finished(row)
        keep = result._replace(decisions=[]) if not ctx.decisions else result
        got.append((row, keep if seed == 0 else None))

    try:
        run_grid(trace, ctx.model, ctx.hardware, ctx.grid, ctx.sim, time_scale=ctx.time_scale,
                 on_finish=progress.advance, on_start=lambda j, _: progress.start(j, ctx.keys[j]),
                 on_result=on_result, block_registry=ctx.block_registry, only=(i,))
    except PolicyFailed as err:
        return RunDone(seed, i, None, None, str(err))
    finally:
        progress.close()
    row, result = got[0]
    return RunDone(seed, i, row, result, None)


_WORKER: list[JobContext] = []  # a worker process's context, set once as it starts


def _worker_init(ctx: JobContext) -> None:
    # Ctrl-C reaches the whole process group: the parent decides (it stops the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER[:] = [ctx]


def _worker_run(task: tuple[int, int]) -> RunDone:
    return run_one(_WORKER[0], task)


def run_all(ctx: JobContext, jobs: int, deliver: Callable[[RunDone], None],
            keep: Callable[[RunDone], None] | None = None) -> None:
    """Every (seed, run) of ``ctx``: ``keep(done)`` as each one comes back, ``deliver(done)``
    in the sequential order. A run stopped by its policy raises ``PolicyFailed`` naming
    it (after the pool is stopped); so does nothing else but the run's own errors."""
    tasks = [(s, i) for s in range(ctx.seeds) for i in range(len(ctx.keys))]
    if jobs == 1:
        for t in tasks:
            done = run_one(ctx, t)
            _take(ctx, done, keep)
            deliver(done)
        return
    # forked workers inherit the context (a registry of user classes need not pickle);
    # each task is then its (seed, run index) alone
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(
        min(jobs, len(tasks)), initializer=_worker_init, initargs=(ctx,))
    try:
        back: dict[tuple[int, int], RunDone] = {}
        nxt = 0
        for done in pool.imap_unordered(_worker_run, tasks):
            _take(ctx, done, keep)
            back[(done.seed, done.index)] = done
            while nxt < len(tasks) and tasks[nxt] in back:
                deliver(back.pop(tasks[nxt]))
                nxt += 1
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _take(ctx: JobContext, done: RunDone, keep) -> None:
    if done.failed is not None:
        where = f" (seed {done.seed + 1} of {ctx.seeds})" if ctx.seeds > 1 else ""
        raise PolicyFailed(f"run {ctx.keys[done.index]!r}{where} stopped: {done.failed}")
    if keep is not None:
        keep(done)


class Keeper:
    """Appends each finished run's row to ``path`` (JSON lines: seed, run index, run name,
    row), creating its folder on the first one."""

    def __init__(self, path: Path, keys: Sequence[str]) -> None:
        self.path = Path(path)
        self._keys = keys
        self.kept = 0
        self._made: list[Path] = []  # folders this keeper created, deepest last

    def __call__(self, done: RunDone) -> None:
        if not self.kept:
            missing = []
            d = self.path.parent
            while not d.exists() and d.parent != d:
                missing.append(d)
                d = d.parent
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._made = missing[::-1]
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
               for k, v in done.row.items()}
        line = json.dumps({"seed": done.seed, "run": done.index,
                           "name": self._keys[done.index], "row": row})
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        self.kept += 1

    def discard(self) -> None:
        """The whole replay is written: the partial record goes."""
        self.path.unlink(missing_ok=True)

    def forget(self) -> None:
        """The replay failed and writes nothing: the record goes, and the folders made
        for it if nothing else is in them."""
        self.discard()
        for d in reversed(self._made):
            try:
                d.rmdir()
            except OSError:
                break
