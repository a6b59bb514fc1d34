"""The second-open check: while a cache is live, another process opens one on its disk path.

One live disk tier holds its path exclusively: a second cache on the same
directory would clear or reattach over pages the first one is still using. The
check runs a child process (``python -m tiering.apps.stress.second_open``) that
builds a ``PagedKVCache`` with exactly the disk configuration of the live one
and reports on stdout, as one JSON line, whether the open was accepted or what
it raised. Around it, the parent takes a digest of every file under the disk
directory (with no transfer in flight, so only the child could change them).

The check passes (``SecondOpenOutcome.ok``) when the open was refused with an
error naming the path and the holder (the parent's pid), and the directory is
byte for byte what it was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tiering.apps.stress.crash import child_env

#: Bytes read at a time while digesting the disk directory.
_BLOCK = 1 << 20


class SecondOpenOutcome(NamedTuple):
    """What the child reported and what the parent saw around it."""

    opened: bool  # the child's cache was built (the open was tolerated)
    error_type: str | None
    error: str | None
    names_path: bool  # the refusal's message names the disk path
    names_holder: bool  # ... and the holder (the live cache's pid)
    data_unchanged: bool  # every file under the disk directory has the same bytes
    problems: tuple[str, ...]

    @property
    def refused(self) -> bool:
        return not self.opened and self.error is not None

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "refused": self.refused, "opened": self.opened, "error_type": self.error_type,
            "error": self.error, "names_path": self.names_path,
            "names_holder": self.names_holder, "data_unchanged": self.data_unchanged,
            "problems": list(self.problems),
        }


def directory_digest(root: str | Path) -> dict[str, str]:
    """relative path -> blake2b of its bytes, for every regular file under ``root``."""
    root = Path(root)
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h = hashlib.blake2b(digest_size=16)
            with open(p, "rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
            out[p.relative_to(root).as_posix()] = h.hexdigest()
    return out


def verdict(
    report: dict[str, Any], *, path: str, holder_pid: int,
    before: dict[str, str], after: dict[str, str],
) -> SecondOpenOutcome:
    """Judge one attempt: ``report`` as the child printed it, digests around it."""
    opened = bool(report.get("opened"))
    error = report.get("error")
    error_type = report.get("error_type")
    problems: list[str] = []
    names_path = isinstance(error, str) and path in error
    names_holder = isinstance(error, str) and str(holder_pid) in error
    if opened:
        problems.append(f"a second cache was opened on the live disk path {path}")
    elif error is None:
        problems.append(report.get("child") or "the child reported neither an open nor a refusal")
    else:
        if not names_path:
            problems.append(f"the refusal does not name the path {path}: {error_type}: {error}")
        if not names_holder:
            problems.append(f"the refusal does not name the holder (pid {holder_pid}): {error}")
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        problems.append(f"the second open changed the live cache's files: {changed[:10]}")
    return SecondOpenOutcome(opened, error_type, error, names_path, names_holder, not changed,
                             tuple(problems))


def spec_of(geometry, disk) -> dict[str, Any]:
    """What the child needs to build the same cache (``geometry``: KVGeometry; ``disk``:
    DiskConfig with a local ``path``)."""
    return {
        "geometry": {"num_layers": geometry.num_layers, "num_kv_heads": geometry.num_kv_heads,
                     "head_dim": geometry.head_dim, "page_tokens": geometry.page_tokens,
                     "dtype": str(geometry.dtype).removeprefix("torch.")},
        "disk": {"path": os.fspath(disk.path), "capacity_bytes": disk.capacity_bytes,
                 "chunk_bytes": disk.chunk_bytes, "io_threads": disk.io_threads,
                 "on_start": disk.on_start},
    }


def attempt_second_open(geometry, disk, *, timeout_s: float) -> dict[str, Any]:
    """Run the child once; its JSON report (``{"opened": bool, ...}``), or one with an
    ``error`` saying why no report came (timeout, crash, unreadable output)."""
    cmd = [sys.executable, "-m", "tiering.apps.stress.second_open", "--spec",
           json.dumps(spec_of(geometry, disk))]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, env=child_env(),
                              check=False)
    except subprocess.TimeoutExpired:
        return {"opened": False, "error_type": None, "error": None,
                "child": f"the child did not answer within {timeout_s}s"}
    lines = [ln for ln in done.stdout.decode(errors="replace").splitlines() if ln.strip()]
    try:
        report = json.loads(lines[-1])
        if not isinstance(report, dict):
            raise ValueError("not an object")
        return report
    except (IndexError, ValueError):
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        return {"opened": False, "error_type": None, "error": None,
                "child": f"exit code {done.returncode}, no report; stderr: {tail}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiering.apps.stress.second_open")
    p.add_argument("--spec", required=True, help="JSON from spec_of")
    args = p.parse_args(argv)
    from tiering.disk.config import DiskConfig
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    spec = json.loads(args.spec)
    g = dict(spec["geometry"])
    geometry = KVGeometry(dtype=getattr(torch, g.pop("dtype")), **g)
    disk = DiskConfig(**spec["disk"])
    try:
        kv = PagedKVCache(geometry, "cpu", device_pages=1, host_pages=1, disk=disk)
    except Exception as exc:  # noqa: BLE001 - the refusal is what this process reports
        print(json.dumps({"opened": False, "error_type": type(exc).__name__, "error": str(exc)}))
        return 0
    kv.close()
    print(json.dumps({"opened": True, "error_type": None, "error": None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
