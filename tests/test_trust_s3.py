"""Trust on a real SeaweedFS: a hostile client with write access to the bucket.

- A state machine drives honest workers (publish, fetch, list; one of them on a rotated
  secret) and the adversary of ``hostile_bucket`` (rewrite, copy, truncate, enlarge, replay,
  forge, delete) on one prefix, and asserts after every step that no fetch ever hands back a
  byte that is not the publisher's. Bounded: a few examples of at most 30 steps.
- An s3:// disk tier whose chunk and binding record are rewritten on the server with fresh
  crcs refuses the forged pages.
- A fetch answered by a 64 MiB object for a 2 KiB block downloads at most one frame.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections import Counter

import google_crc32c
import obstore
import pytest
import torch
from conftest import fill
from hostile_bucket import ACTIONS, Adversary
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from seaweed_fixture import _seaweed_shared, seaweed  # noqa: F401  (fixtures)
from tiering.resources.kv_cache import PagedKVCache

from tiering.coldtier import BlockStatus, MacKeys, SharedBlockStore, TrustConfig
from tiering.disk import DiskConfig
from tiering.types import RequestState, Tier

SECRET = hashlib.sha256(b"test_trust_s3 deployment").digest()
ROTATED = hashlib.sha256(b"test_trust_s3 next deployment").digest()
ROOT = hashlib.sha256(b"root").digest()[:16]
GEOM_ID = b"L2H2D8P4f32"
BLOCK = 2048
KEYS = [hashlib.sha256(bytes([i])).digest()[:16] for i in range(3)]


def payload_of(key: bytes) -> bytes:
    """What the honest publisher of ``key`` writes (content-addressed: one payload per key)."""
    out = b"".join(hashlib.blake2b(key + i.to_bytes(4, "little")).digest() for i in range(BLOCK // 64))
    return out[:BLOCK]


class HostileBucket(RuleBasedStateMachine):
    """Honest workers and an adversary on one prefix of the real server."""

    server = None  # set by each test: the fixture's server, a tally, the workers' trust
    tally: Counter = Counter()
    trust: object = TrustConfig(secret=SECRET)
    rotated: object = MacKeys(ROTATED, previous=SECRET)

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed):
        store = self.server.store("hostile-" + uuid.uuid4().hex[:10], timeout_s=5.0)
        self.workers = [SharedBlockStore(store, ROOT, GEOM_ID, trust=self.trust, block_bytes=BLOCK)
                        for _ in range(2)]
        # a worker already on the next secret: it writes under it and still reads the old one
        self.workers.append(SharedBlockStore(store, ROOT, GEOM_ID, block_bytes=BLOCK,
                                             trust=self.rotated))
        self.adversary = Adversary(store, random.Random(seed), grow=64 << 10, payload_bytes=BLOCK,
                                   targets=tuple(self.workers[0].path(k) for k in KEYS))

    @rule(w=st.integers(0, 2), k=st.sampled_from(KEYS))
    def publish(self, w, k):
        res = self.workers[w].publish(k, payload_of(k))
        assert res.status in (BlockStatus.WRITTEN, BlockStatus.DUPLICATE), res
        event(f"publish {res.status.value}")

    @rule(w=st.integers(0, 2), k=st.sampled_from(KEYS))
    def fetch(self, w, k):
        res = self.workers[w].fetch(k)
        event(f"fetch {res.status.value}")
        assert res.status in (BlockStatus.HIT, BlockStatus.LOST), res
        if res.status is BlockStatus.HIT:
            assert res.payload == payload_of(k), "a worker was handed bytes the publisher never wrote"
            self.tally["hit"] += 1
        else:
            assert res.payload is None
            self.tally["refused" if res.reason.startswith("refused") else "missing"] += 1

    @rule(w=st.integers(0, 2))
    def refresh(self, w):
        assert self.workers[w].refresh_index() is not None

    @rule(action=st.sampled_from(ACTIONS))
    def attack(self, action):
        done = self.adversary.act(action, ids=(ROOT, GEOM_ID))
        event(f"attack {action}" if done else "attack: nothing there")
        self.tally[f"attack {action}" if done else "attack none"] += 1

    @invariant()
    def intact(self):
        for w in getattr(self, "workers", ()):
            w.check_integrity()
            assert set(w.refusals()) <= {"mac", "foreign", "damaged", "oversized", "size"}


def _machine(server, **over):
    return type("Run", (HostileBucket,), {"server": server, "tally": Counter(), **over})


def test_no_worker_maps_a_byte_the_publisher_did_not_write(seaweed):  # noqa: F811
    machine = _machine(seaweed)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=10, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    t = machine.tally
    # the paths ran: honest hits, refusals of what the adversary planted, its forgeries
    assert t["hit"] >= 5 and t["refused"] >= 3 and t["attack forge"] >= 1, dict(t)


def test_the_hostile_machine_catches_workers_that_trust_the_bucket(seaweed):  # noqa: F811
    """Negative control: with the MAC off (trust='unauthenticated') the adversary's forgery
    with a fresh crc is served, and the same machine finds it."""
    machine = _machine(seaweed, trust="unauthenticated", rotated="unauthenticated")
    with pytest.raises(AssertionError, match="bytes the publisher never wrote"):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
            database=None, phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow]))


def test_a_forged_chunk_of_the_s3_disk_tier_is_refused(seaweed, geom, closing):  # noqa: F811
    """Chunk bytes and binding record rewritten on the server, both with fresh crc32c: the
    chunk's MAC refuses them and the request is lost, never served the attacker's pages."""
    url = seaweed.url() + "/disk"
    prefix = url.split(f"s3://{seaweed.bucket}/", 1)[1]
    cfg = DiskConfig(path=url, capacity_bytes=64 * geom.page_bytes, chunk_bytes=geom.page_bytes,
                     storage_options=seaweed.options(timeout_s=5.0), trust=TrustConfig(secret=SECRET))
    kv = closing(PagedKVCache(geom, device_pages=16, host_pages=16, disk=cfg))
    gen = torch.Generator().manual_seed(31)
    data = {rid: fill(kv, rid, gen, n) for rid, n in (("a", 9), ("b", 5))}
    for rid in data:
        assert kv.offload(rid) > 0
    kv.synchronize(30)
    for rid in data:
        assert kv.demote(rid)
    assert all(r.ok for r in kv.synchronize(60))
    store = seaweed.store(prefix, check=False)
    chunks = sorted(m["path"] for c in obstore.list(store, prefix="c/") for m in c)
    assert chunks
    rng = random.Random(32)
    for name in chunks:  # the attacker's pages, each with the crcs a reader recomputes
        slot = int(name.split("/")[1])
        raw = bytes(obstore.get(store, name).bytes())
        pages = rng.randbytes(len(raw) - 4)
        obstore.put(store, name, pages + google_crc32c.value(pages).to_bytes(4, "little"))
        record = bytes(obstore.get(store, f"tiering-bind/{slot}").bytes())
        body = record[:36] + google_crc32c.value(pages).to_bytes(4, "little")
        obstore.put(store, f"tiering-bind/{slot}", body + google_crc32c.value(body).to_bytes(4, "little"))
    for rid in data:
        assert kv.tier_of(rid) is Tier.DISK and kv.reload(rid)
    results = kv.synchronize(60)
    kv.check_integrity()
    assert len(results) == 2 and not any(r.ok for r in results), "forged pages were handed back"
    for rid in data:
        assert kv.state_of(rid) is RequestState.LOST
    assert kv.disk.stats()["corruptions"] >= 2


def test_a_fetch_answered_by_a_huge_object_downloads_at_most_one_frame(seaweed):  # noqa: F811
    rng = random.Random(33)
    s = SharedBlockStore(seaweed.store("huge-" + uuid.uuid4().hex[:8], timeout_s=30.0), ROOT, GEOM_ID,
                         trust=TrustConfig(secret=SECRET), block_bytes=BLOCK)
    key = KEYS[0]
    assert s.publish(key, payload_of(key)).status is BlockStatus.WRITTEN
    assert s.known.size(key) == s.object_size(key, BLOCK)
    obstore.put(s.store, s.path(key), rng.randbytes(64 << 20))  # replaced after it was listed
    res = s.fetch(key)
    assert res.status is BlockStatus.LOST and res.nbytes == 0
    assert "over the frame's maximum" in res.reason and s.refusals()["oversized"] == 1
    assert s.refresh_index() == 0  # listed at 64 MiB: not taken for a block at all


@pytest.fixture
def geom():
    from tiering.resources.kv_geometry import KVGeometry

    return KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32)
