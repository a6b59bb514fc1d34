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
import pickle
import queue
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


#: how long a stopped worker process is given to end, after SIGTERM and again after SIGKILL
STOP_WAIT_S = 5.0


def _serve(ctx: JobContext, todo, back) -> None:
    """A worker process: run each task of ``todo`` until None, each answer onto ``back``
    as (task, RunDone, None), or (task, None, error) for a run that raised."""
    # Ctrl-C reaches the whole process group: the parent decides (it stops the workers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for task in iter(todo.get, None):
        try:
            back.put((task, run_one(ctx, task), None))
        except Exception as err:  # the parent raises it
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(f"{type(err).__name__}: {err}")
            back.put((task, None, err))


def run_all(ctx: JobContext, jobs: int, deliver: Callable[[RunDone], None],
            keep: Callable[[RunDone], None] | None = None) -> None:
    """Every (seed, run) of ``ctx``: ``keep(done)`` as each one comes back, ``deliver(done)``
    in the sequential order. A run stopped by its policy raises ``PolicyFailed`` naming
    it (after the workers are stopped); so does nothing else but the run's own errors,
    and a worker that dies (RuntimeError naming its exit status)."""
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
    mp = multiprocessing.get_context(method)
    todo, back = mp.Queue(), mp.Queue()
    workers = [mp.Process(target=_serve, args=(ctx, todo, back), daemon=True)
               for _ in range(min(jobs, len(tasks)))]
    for w in workers:
        w.start()
    try:
        for t in [*tasks, *[None] * len(workers)]:
            todo.put(t)
        got: dict[tuple[int, int], RunDone] = {}
        nxt = 0
        for _ in tasks:
            while True:
                try:
                    task, done, err = back.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"--jobs: a worker process died (exit status "
                                           f"{dead[0]}); its run is lost") from None
                    if all(w.exitcode is not None for w in workers):  # none left to answer
                        raise RuntimeError(
                            f"--jobs: every worker process ended while {len(tasks) - len(got) - nxt}"
                            " runs had not come back (one left without answering)") from None
            if err is not None:
                raise err
            _take(ctx, done, keep)
            got[task] = done
            while nxt < len(tasks) and tasks[nxt] in got:
                deliver(got.pop(tasks[nxt]))
                nxt += 1
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:  # SIGTERM, then SIGKILL for one that does not go
            w.join(STOP_WAIT_S)
            if w.is_alive():
                w.kill()
                w.join(STOP_WAIT_S)
        for q in (todo, back):  # what no worker took is dropped, not waited on
            q.close()
            q.cancel_join_thread()


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
