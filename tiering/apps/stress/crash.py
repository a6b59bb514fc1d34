"""The crash check: kill a process in the middle of disk writes, restart over its directory.

A child process (``python -m tiering.apps.stress.crash_child``) runs a
``PagedKVCache`` whose disk tier starts with ``on_start="reattach"``. It keeps
offloading fresh requests straight to disk (so each is committed to the
manifest) and releasing older ones, on a deliberately slow disk, and says on
stdout what it is doing. The parent kills it with SIGKILL while a chunk write
is in progress, then opens a cache over the same directory and checks the
documented start-up rule:

- only committed requests come back (ON_DISK): every request whose commit the
  child had reported, and no request it had never committed or had released
  (a commit or release in progress at the kill may go either way);
- every request that comes back reloads bit for bit equal to what the child
  wrote (regenerated from (seed, rid));
- everything else on disk was cleared: the tier holds exactly the reattached
  extents, and once they are gone a further restart finds nothing.

A SIGKILL stops the process, not the machine: data the child wrote stays in
the page cache, so this checks the start-up rule and the manifest protocol,
not durability across a power cut.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import NamedTuple

import torch

from tiering.apps.stress.kvdata import derived_seed, mismatched_layers, request_kv
from tiering.disk.config import DiskConfig
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.types import RequestState

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=8,
                      dtype=torch.bfloat16)
PAGES_PER_CHUNK = 2
CAPACITY_CHUNKS = 32
MIN_PAGES, MAX_PAGES = 2, 6  # 1..3 chunks; more than the one-page host, so offloads go to disk
MAX_TOKENS = MAX_PAGES * GEOMETRY.page_tokens


def crash_disk_config(directory: str | Path) -> DiskConfig:
    page = GEOMETRY.page_bytes
    return DiskConfig(
        path=Path(directory) / "disk",
        capacity_bytes=CAPACITY_CHUNKS * PAGES_PER_CHUNK * page,
        chunk_bytes=PAGES_PER_CHUNK * page,
        on_start="reattach",
        io_threads=1,
    )


def crash_cache(directory: str | Path, **kwargs) -> PagedKVCache:
    """The cache both processes open over ``directory`` (same geometry and disk layout)."""
    return PagedKVCache(GEOMETRY, device_pages=24, host_pages=1,
                        disk=crash_disk_config(directory), **kwargs)


def expected_kv(seed: int, rid: str) -> torch.Tensor:
    return request_kv(GEOMETRY, seed, rid, 0, MAX_TOKENS)


class CrashOutcome(NamedTuple):
    """What the check saw. ``problems`` is empty when the start-up rule held."""

    committed: frozenset[str]  # commits reported and not being released at the kill
    uncertain: frozenset[str]  # a commit or release in progress at the kill
    reattached: tuple[str, ...]
    verified: int  # reattached requests that reloaded bit for bit equal
    writes_in_flight: bool  # the child was inside a chunk write when it was killed
    events: int
    problems: tuple[str, ...]


class _Events:
    """The child's reports, folded into what the manifest may and must hold."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.committed: set[str] = set()
        self.uncertain: set[str] = set()
        self.commits_done = 0
        self.count = 0
        self.last = ""

    def add(self, line: str) -> None:
        self.count += 1
        self.last = line
        word, *rest = line.split()
        if word == "commit-begin":
            rid, tokens = rest[0], int(rest[1])
            self.tokens[rid] = tokens
            self.uncertain.add(rid)
        elif word == "commit-end":
            self.uncertain.discard(rest[0])
            self.committed.add(rest[0])
            self.commits_done += 1
        elif word == "commit-abandoned":
            self.uncertain.discard(rest[0])
        elif word == "release-begin":
            self.committed.discard(rest[0])
            self.uncertain.add(rest[0])
        elif word == "release-end":
            self.uncertain.discard(rest[0])


def child_env() -> dict[str, str]:
    """This interpreter's environment with the repository first on the import path."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _read_lines(stream, out: queue.Queue) -> None:
    for raw in stream:
        out.put(raw.decode(errors="replace").strip())
    out.put(None)


def run_crash_check(
    directory: str | Path,
    *,
    seed: int,
    commits_before_kill: int = 20,
    timeout_s: float = 60.0,
) -> CrashOutcome:
    """Run the child over ``directory``, kill it mid-write, restart and check (see module doc).

    The kill comes at one of the first few chunk writes (chosen from ``seed``)
    after the child has reported ``commits_before_kill`` commits.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    events = _Events()
    problems: list[str] = []
    killed_in_write = False
    skip_writes = random.Random(derived_seed("kill", seed)).randrange(4)  # which write dies
    deadline = time.monotonic() + timeout_s
    with open(directory / "child.stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiering.apps.stress.crash_child", "--dir", str(directory),
             "--seed", str(seed)],
            stdout=subprocess.PIPE, stderr=err, env=child_env(),
        )
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    problems.append(f"the child did not reach {commits_before_kill} commits in time")
                    break
                try:
                    line = lines.get(timeout=left)
                except queue.Empty:
                    continue
                if line is None:
                    problems.append(f"the child exited early (code {proc.wait(10)}); last: "
                                    f"{events.last!r}")
                    break
                if line == "io" and events.commits_done >= commits_before_kill:
                    if skip_writes == 0:
                        os.kill(proc.pid, signal.SIGKILL)
                        killed_in_write = True
                        break
                    skip_writes -= 1
                if line not in ("io", "ready"):
                    events.add(line)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            reader.join(timeout=10)
        while True:  # what the child said before it died is still in the pipe
            try:
                line = lines.get_nowait()
            except queue.Empty:
                break
            if line is not None and line not in ("io", "ready"):
                events.add(line)
    committed, uncertain = frozenset(events.committed), frozenset(events.uncertain)
    if problems:
        return CrashOutcome(committed, uncertain, (), 0, killed_in_write, events.count,
                            tuple(problems))
    restart = check_restart(directory, seed, events.tokens, committed, uncertain)
    return CrashOutcome(committed, uncertain, restart.reattached, restart.verified,
                        killed_in_write, events.count, restart.problems)


class RestartCheck(NamedTuple):
    reattached: tuple[str, ...]
    verified: int
    problems: tuple[str, ...]


def check_restart(
    directory: str | Path,
    seed: int,
    tokens: Mapping[str, int],
    committed: AbstractSet[str],
    uncertain: AbstractSet[str],
) -> RestartCheck:
    """Open a cache over ``directory`` and check what it reattached.

    ``committed``: requests that must come back; ``uncertain``: ones that may;
    ``tokens``: how many tokens the writer gave each request. Every request
    that comes back is reloaded, compared with ``expected_kv(seed, rid)`` and
    removed; then a second start must find nothing.
    """
    problems: list[str] = []
    verified = 0
    with crash_cache(directory) as kv:
        reattached = tuple(sorted(kv.requests()))
        found = set(reattached)
        missing = set(committed) - found
        if missing:
            problems.append(f"committed requests did not come back: {sorted(missing)}")
        stray = found - set(committed) - set(uncertain)
        if stray:
            problems.append(f"requests came back that were never committed or were released: "
                            f"{sorted(stray)}")
        try:
            kv.check_integrity()
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            problems.append(f"integrity after restart: {exc}")
        extents = kv.disk.stats()["extents"]
        if extents != len(reattached):
            problems.append(f"the disk holds {extents} extents for {len(reattached)} requests")
        for rid in reattached:
            if kv.state_of(rid) is not RequestState.ON_DISK:
                problems.append(f"{rid} came back {kv.state_of(rid).value}, not on disk")
                continue
            held = kv.num_tokens(rid)
            if held != tokens.get(rid):
                problems.append(f"{rid} came back with {held} tokens, the writer gave it "
                                f"{tokens.get(rid)}")
                continue
            if not kv.reload(rid):
                problems.append(f"{rid} could not be reloaded")
                continue
            kv.synchronize(30)
            if kv.state_of(rid) is not RequestState.RESIDENT:
                problems.append(f"{rid} did not reload: {kv.lost_reason(rid)}")
                continue
            bad = mismatched_layers(kv.read, rid, expected_kv(seed, rid), held)
            if bad:
                problems.append(f"{rid}: layers {bad} came back with stale or wrong bytes")
            else:
                verified += 1
            kv.remove_request(rid)
        kv.check_integrity()
        if kv.disk.used_bytes():
            problems.append(f"disk still holds {kv.disk.used_bytes()} bytes after removing all")
    with crash_cache(directory) as kv:
        if kv.requests():
            problems.append(f"a second restart found {kv.requests()}")
        if kv.disk.used_bytes():
            problems.append("a second restart found chunks in use")
    return RestartCheck(reattached, verified, tuple(problems))
