"""A state machine over a cache with a disk tier in ``reattach`` mode, where
request ids are reused after removal (also while their copies run), requests
may hold 0 tokens, and manifest commits fail at random. Invariants: integrity
after every step, every reported completion agrees with the cache, KV that
is resident again is bit-identical to what was written, and nothing raises
out of poll/synchronize."""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

import torch
from conftest import assert_same, offload_resident, random_kv, write_layers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.disk import DiskConfig
from tiering.types import IllegalTransition, RequestState

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2)
IDS = ("a", "b", "c", "d")


class ReuseLifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kv-reuse-"))
        page = GEOM.page_bytes
        cfg = DiskConfig(path=self.dir / "disk", capacity_bytes=12 * page, chunk_bytes=2 * page,
                         on_start="reattach")
        self.kv = PagedKVCache(GEOM, device_pages=10, host_pages=4, disk=cfg, verify=True)
        self.fail_commits = False
        real = self.kv.disk.commit

        def commit(owner, extent, meta=None):
            if self.fail_commits:
                raise OSError(errno.ENOSPC, "no space for the manifest")
            return real(owner, extent, meta)

        self.kv.disk.commit = commit
        self.data: dict[str, list] = {}
        self.removed: set[str] = set()  # ids removed since the last reported results
        self.gen = torch.Generator().manual_seed(0)

    def teardown(self):
        self.kv.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _check(self, results):
        removed, self.removed = self.removed, set()
        for res in results:
            if res.state is None or res.rid in removed:
                continue  # a removed request's copy (applied before or after its removal)
            assert self.kv.state_of(res.rid) is res.state, res
            assert res.ok == (res.reason is None)

    @rule(i=st.integers(0, 3), tokens=st.integers(0, 7))
    def add(self, i, tokens):
        rid = IDS[i]
        if rid in self.data:
            return
        self.kv.ingest_request(rid, None)
        if not self.kv.allocate(rid, tokens):
            self.kv.remove_request(rid)
            self.removed.add(rid)
            return
        d = random_kv(self.gen, GEOM, tokens)
        if tokens:
            write_layers(self.kv, rid, d)
        self.data[rid] = d

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def offload(self, i):
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is not S.RESIDENT:
            return
        offload_resident(self.kv, rid)

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def demote(self, i):
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is S.ON_HOST:
            self.kv.demote(rid)

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def reload(self, i):
        rid = sorted(self.data)[i % len(self.data)]
        try:
            self.kv.reload(rid)
        except IllegalTransition:
            assert self.kv.state_of(rid) not in (S.ON_HOST, S.ON_DISK)

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def remove(self, i):
        rid = sorted(self.data)[i % len(self.data)]
        self.kv.remove_request(rid)
        self.removed.add(rid)
        del self.data[rid]

    @rule(on=st.booleans())
    def commits_fail(self, on):
        self.fail_commits = on

    @rule()
    def poll(self):
        self._check(self.kv.poll())

    @rule()
    def settle_and_verify(self):
        self._check(self.kv.synchronize(10))
        for rid, d in self.data.items():
            st_ = self.kv.state_of(rid)
            assert not st_.in_flight
            assert st_ is not S.LOST, self.kv.lost_reason(rid)
            if st_ is S.RESIDENT and self.kv.num_tokens(rid):
                assert_same(self.kv, rid, d)

    @invariant()
    def integrity(self):
        self.kv.check_integrity()


ReuseLifecycle.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReuseLifecycle = ReuseLifecycle.TestCase
