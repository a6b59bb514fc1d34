"""A hypothesis state machine over prefix reuse: publish / attach / load / remove / pressure / corruption.

Bytes are content-addressed in the model: every full page's K/V is a function
of its block key, so any hit, from any tier, must return exactly those bytes;
a partial page holds bytes private to its request. After every step:
``check_integrity`` (refcounts equal the mappings, every page free or held by
requests and/or the index, a block in one place or in flight), every resident
request reads back exactly its expected bytes, and a write into a shared page
raises and changes nothing. At teardown everything is released and nothing
but cached blocks holds a page.
"""

from __future__ import annotations

import hashlib

import torch
from conftest import rule_on_one_of
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.resources.kv_prefix import BLOCKS

from tiering.blocks import KeyRoot
from tiering.disk import DiskConfig
from tiering.types import RequestState, Tier

S = RequestState
G = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4)
T = G.page_tokens
PAGE = (G.num_layers, 2, T, G.num_kv_heads, G.head_dim)


def page_bytes_for(seed: bytes) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "little") >> 1)
    return torch.randn(PAGE, generator=gen).to(G.dtype)


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="kv-prefix-sm-")
        disk = DiskConfig(path=self._tmp.name, capacity_bytes=24 * G.page_bytes,
                          chunk_bytes=2 * G.page_bytes)
        self.kv = PagedKVCache(G, "cpu", 12, 8, disk=disk)
        self.kv.enable_prefix_cache(KeyRoot(G.fingerprint(), "sm", page_tokens=T), disk_batch_pages=3)
        self.stems = [torch.randint(0, 50, (4 * T,), generator=torch.Generator().manual_seed(s))
                      for s in range(3)]
        self.seq = 0
        self.expected: dict[str, torch.Tensor] = {}  # rid -> [pages, *PAGE] of its tokens
        self.ids: dict[str, torch.Tensor] = {}
        self.pending: set[str] = set()
        self.hits = 0

    # -- helpers --------------------------------------------------------------

    def _page_of(self, rid, i, keys):
        if i < len(keys):
            return page_bytes_for(keys[i])
        return page_bytes_for(f"{rid}/{i}/{self.seq}".encode())

    def _fill_from(self, rid: str, start_page: int) -> bool:
        """Write the request's pages from ``start_page`` and publish; False if no room."""
        kv = self.kv
        ids = self.ids[rid]
        n = int(ids.numel())
        if not kv.allocate(rid, n):
            return False
        keys = kv._prefix.keys(ids)
        pages = [self._page_of(rid, i, keys) for i in range(G.pages_for(n))]
        for i in range(start_page, len(pages)):
            lo, hi = i * T, min(n, (i + 1) * T)
            for layer in range(G.num_layers):
                p = pages[i][layer]
                kv.write(rid, layer, lo, p[0, : hi - lo], p[1, : hi - lo])
        kv.publish_prefix(rid, ids)
        self.expected[rid] = torch.stack(pages)
        return True

    def _resident(self):
        return sorted(r for r in self.expected if self.kv.state_of(r) is S.RESIDENT)

    # -- rules -----------------------------------------------------------------

    @rule(stem=st.integers(0, 2), cut=st.integers(1, 4), extra=st.integers(0, 9))
    def new_request(self, stem, cut, extra):
        if len(self.kv.requests()) >= 6:
            return
        self.seq += 1
        rid = f"r{self.seq}"
        tail = torch.randint(50, 99, (extra,), generator=torch.Generator().manual_seed(self.seq))
        ids = torch.cat([self.stems[stem][: cut * T], tail])
        self.kv.ingest_request(rid)
        self.ids[rid] = ids
        got = self.kv.attach_prefix(rid, ids)
        assert got % T == 0 and got < ids.numel()
        self.hits += got
        if self.kv.is_offloaded(rid):
            assert not self.kv.admit(ResourceStep(rid), StepContext())
            self.pending.add(rid)
            self.expected[rid] = None
            return
        if not self._fill_from(rid, got // T):
            self.kv.remove_request(rid)
            del self.ids[rid]
            self.expected.pop(rid, None)

    @rule_on_one_of(lambda self: sorted(self.pending))
    def load(self, rid):
        kv = self.kv
        if not kv.reload(rid):
            return
        kv.synchronize(10)
        assert kv.admit(ResourceStep(rid), StepContext())
        self.pending.discard(rid)
        valid = kv.num_tokens(rid)
        if not self._fill_from(rid, valid // T):
            kv.remove_request(rid)
            del self.ids[rid]
            self.expected.pop(rid, None)

    @rule_on_one_of(lambda self: sorted(self.expected))
    def remove(self, rid):
        self.kv.remove_request(rid)
        self.pending.discard(rid)
        del self.expected[rid], self.ids[rid]

    @rule()
    def pressure(self):
        """A filler takes every page the cache can free, then leaves: cached blocks move down."""
        kv = self.kv
        kv.ingest_request("filler")
        room = kv.device_pool.free_pages + kv._prefix.unmapped(Tier.DEVICE)
        if room:
            assert kv.allocate("filler", room * T)
        kv.check_integrity()
        if room and kv.offload("filler"):  # host room for a live request: cached blocks go to disk
            kv.check_integrity()
            kv.synchronize(10)
        kv.check_integrity()
        kv.remove_request("filler")

    @rule_on_one_of(lambda self: self._resident())
    def offload_one(self, rid):
        if self.kv.offload(rid):
            self.kv.synchronize(10)

    @rule(data=st.data())
    def reload_offloaded(self, data):
        off = sorted(r for r in self.expected if r not in self.pending and self.kv.is_offloaded(r))
        if off:
            rid = data.draw(st.sampled_from(off))
            if self.kv.reload(rid):
                self.kv.synchronize(10)

    @rule(data=st.data(), where=st.sampled_from(["host", "disk"]))
    def corrupt(self, data, where):
        p = self.kv._prefix
        keys = sorted(p.index.keys(Tier.HOST if where == "host" else Tier.DISK))
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        if where == "host":
            self.kv._host[p.index.location(key).handle].view(-1)[0] += 1.0
        else:
            p.crc[key] ^= 1

    @rule_on_one_of(lambda self: self._resident())
    def write_into_shared_page_raises(self, rid):
        r = self.kv._reqs[rid]
        if not r.shared:
            return
        k = torch.ones(1, G.num_kv_heads, G.head_dim).to(G.dtype)
        try:
            self.kv.write(rid, 0, 0, k, k)
        except ValueError as exc:
            assert "published" in str(exc)
        else:
            raise AssertionError("a write into a published page was accepted")

    # -- invariants --------------------------------------------------------------

    @invariant()
    def integrity_and_exact_bytes(self):
        kv = self.kv
        kv.check_integrity()
        for rid in self._resident():
            want = self.expected[rid]
            if want is None:
                continue
            n = kv.num_tokens(rid)
            for layer in range(G.num_layers):
                k, v = kv.read(rid, layer)
                wk = want[:, layer, 0].reshape(-1, G.num_kv_heads, G.head_dim)[:n]
                wv = want[:, layer, 1].reshape(-1, G.num_kv_heads, G.head_dim)[:n]
                assert torch.equal(k, wk) and torch.equal(v, wv), f"{rid} layer {layer}"
        p = kv._prefix
        for key in p.index.keys():
            assert p.index.get(key).refs >= 0

    def teardown(self):
        kv = self.kv
        try:
            for rid in list(kv.requests()):
                kv.remove_request(rid)
            kv.synchronize(10)
            kv.check_integrity()
            held = kv.device_pool.holdings()
            assert set(held) <= {BLOCKS}, held
            assert len(held.get(BLOCKS, [])) == kv._prefix.index.count(Tier.DEVICE)
            assert kv.device_used_bytes() == 0 and kv.host_used_bytes() == 0
        finally:
            kv.close()
            self._tmp.cleanup()


PrefixMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixMachine = PrefixMachine.TestCase


def test_the_machine_sees_hits_from_every_tier():
    """The reuse path ran: a fixed walk through the rules gets device, host and disk hits."""
    m = PrefixMachine()
    try:
        m.new_request(0, 4, 3)
        m.integrity_and_exact_bytes()
        m.remove(type("D", (), {"draw": lambda self, s: "r1"})())
        m.new_request(0, 4, 2)  # device hit
        st_ = m.kv.prefix_stats()
        assert st_["hit_tokens_device"] > 0
        m.remove(type("D", (), {"draw": lambda self, s: "r2"})())
        m.pressure()
        m.new_request(0, 4, 1)  # host hit, pending load
        assert m.pending
        m.load(type("D", (), {"draw": lambda self, s: sorted(m.pending)[0]})())
        m.integrity_and_exact_bytes()
        assert m.kv.prefix_stats()["hit_tokens_host"] > 0
    finally:
        m.teardown()
