"""A hypothesis state machine over the request lifecycle of PagedKVCache.

Copies really run on worker threads while rules fire, so the machine sees
requests mid-flight; it decides what each call must do from the state the
cache reports at that moment, and checks integrity after every step.
"""

from __future__ import annotations

import torch
from conftest import assert_same, offload_resident, random_kv, write_layers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.types import IllegalTransition, RequestState

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = PagedKVCache(GEOM, device_pages=10, host_pages=8, verify=True)
        self.data: dict[str, list] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0

    def teardown(self):
        self.kv.close()

    def rids(self):
        return sorted(self.data)

    @rule(tokens=st.integers(1, 9))
    def add(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        self.kv.ingest_request(rid, None)
        need = GEOM.pages_for(tokens)
        free = self.kv.device_pool.free_pages
        ok = self.kv.allocate(rid, tokens)
        assert ok == (need <= free)
        if not ok:
            self.kv.remove_request(rid)
            return
        d = random_kv(self.gen, GEOM, tokens)
        write_layers(self.kv, rid, d)
        self.data[rid] = d

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def offload(self, i):
        rid = self.rids()[i % len(self.data)]
        state = self.kv.state_of(rid)
        if state is not S.RESIDENT:
            try:
                self.kv.offload(rid)
            except IllegalTransition as exc:
                assert rid in str(exc)
            else:
                raise AssertionError(f"offload of {state} {rid} accepted")
            return
        offload_resident(self.kv, rid)

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def reload(self, i):
        rid = self.rids()[i % len(self.data)]
        self.kv.poll()
        state = self.kv.state_of(rid)
        if state is not S.ON_HOST:
            try:
                self.kv.reload(rid)
            except IllegalTransition:
                return
            raise AssertionError(f"reload of {state} {rid} accepted")
        fits = self.kv.device_pool.free_pages >= GEOM.pages_for(self.kv.num_tokens(rid))
        assert self.kv.reload(rid) == fits

    @precondition(lambda self: self.data)
    @rule(i=st.integers(0, 100))
    def remove(self, i):
        rid = self.rids()[i % len(self.data)]
        self.kv.remove_request(rid)
        del self.data[rid]

    @rule()
    def poll(self):
        self.kv.poll()

    @rule()
    def settle_and_verify(self):
        self.kv.synchronize(10)
        for rid, d in self.data.items():
            st_ = self.kv.state_of(rid)
            assert not st_.in_flight
            if st_ is S.RESIDENT:
                assert_same(self.kv, rid, d)

    @invariant()
    def integrity(self):
        self.kv.check_integrity()

    @invariant()
    def nothing_lost(self):
        assert self.kv.take_lost() == []


Lifecycle.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycle = Lifecycle.TestCase


def test_everything_free_after_all_removed(kv):
    cache = kv(geometry=GEOM, device_pages=10, host_pages=8)
    gen = torch.Generator().manual_seed(3)
    for i in range(4):
        cache.ingest_request(f"x{i}")
        cache.allocate(f"x{i}", 4)
        for layer, (k, v) in enumerate(random_kv(gen, GEOM, 4)):
            cache.write(f"x{i}", layer, 0, k, v)
        cache.offload(f"x{i}")
    for i in range(4):
        cache.remove_request(f"x{i}")
    cache.synchronize(10)
    cache.check_integrity()
    assert cache.device_pool.used_bytes == 0 and cache.host_pool.used_bytes == 0


def test_the_design_page_states_the_legal_transitions_of_the_code():
    """docs/design.md's table of the request state machine is LEGAL_TRANSITIONS."""
    import re
    from pathlib import Path

    from tiering.types import LEGAL_TRANSITIONS

    page = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    page = page.split("## The request state machine", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page, flags=re.M)
    documented = {
        S(state): frozenset(S(v) for v in re.findall(r"`(\w+)`", targets))
        for state, targets in rows
    }
    assert documented == LEGAL_TRANSITIONS
