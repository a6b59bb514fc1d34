"""Cold tier pieces that need no server: the frame, URL and options parsing, the breaker, the
local cache of known blocks, config validation, and the start-up error for a dead endpoint."""

from __future__ import annotations

import random
import re
import socket

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiering.coldtier import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    ColdTierConfig,
    ColdTierUnavailable,
    FrameRefused,
    KnownBlocks,
    LeaseConfig,
    SharedTierConfig,
    SweeperConfig,
    frame,
    open_s3_store,
    parse_s3_url,
    unframe,
)
from tiering.coldtier.frame import KIND_BLOCK, KIND_PRIVATE, framed_size
from tiering.coldtier.s3 import check_storage_options
from tiering.coldtier.trust import MacKeys, TrustConfig

KEYS = MacKeys(random.Random(22).randbytes(32))  # the deployment key these tests frame under
TRUST = TrustConfig(secret=random.Random(23).randbytes(32))


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rbytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


# -- frame ------------------------------------------------------------------------------------
def test_frame_round_trip_is_bitwise_and_unpadded():
    rng = random.Random(1)
    for n in (1, 17, 4096, 100_003):
        key, root, geom, payload = rbytes(rng, 32), rbytes(rng, 16), rbytes(rng, 8), rbytes(rng, n)
        data = frame(KIND_BLOCK, key, root, geom, payload, keys=KEYS)
        assert len(data) == framed_size(key, root, geom, n)
        assert len(data) - n < 128  # header + ids + crc only: no padding of small blocks
        assert bytes(unframe(KIND_BLOCK, data, key, root, geom, keys=KEYS)) == payload


def test_frame_refuses_foreign_truncated_and_damaged_objects():
    rng = random.Random(2)
    key, root, geom, payload = rbytes(rng, 32), rbytes(rng, 16), rbytes(rng, 8), rbytes(rng, 5000)
    data = frame(KIND_BLOCK, key, root, geom, payload, keys=KEYS)
    cases = {
        "another key": (data, rbytes(rng, 32), root, geom, KIND_BLOCK, "expected"),
        "another root": (data, key, rbytes(rng, 16), geom, KIND_BLOCK, "another root"),
        "another geometry": (data, key, root, rbytes(rng, 8), KIND_BLOCK, "another geometry"),
        "another kind": (data, key, root, geom, KIND_PRIVATE, "kind"),
        "truncated": (data[:-100], key, root, geom, KIND_BLOCK, "truncated"),
        "extended": (data + b"\x01", key, root, geom, KIND_BLOCK, "truncated or extended"),
        "tiny": (data[:10], key, root, geom, KIND_BLOCK, "shorter than a frame"),
        "foreign": (b"PK\x03\x04" + data[4:], key, root, geom, KIND_BLOCK, "magic"),
    }
    for name, (d, k, r, g, kind, msg) in cases.items():
        with pytest.raises(FrameRefused, match=msg):
            unframe(kind, d, k, r, g, keys=KEYS)
        assert name
    # one flipped payload bit anywhere is caught by the crc
    for pos in rng.sample(range(len(data) - 4), 20):
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(FrameRefused):
            unframe(KIND_BLOCK, bytes(bad), key, root, geom, keys=KEYS)


def test_frame_bad_input_names_the_field():
    with pytest.raises(ValueError, match="key must not be empty"):
        frame(KIND_BLOCK, b"", b"r", b"", b"x", keys=KEYS)
    with pytest.raises(ValueError, match="root must be bytes"):
        frame(KIND_BLOCK, b"k", "r", b"", b"x", keys=KEYS)


@pytest.mark.parametrize("kind", [300, -1, 3, True, 1.0])
def test_a_frame_kind_that_is_not_one_of_the_two_is_refused_by_name(kind):
    """300 and -1 raised a bare struct.error; 3 and True were written (True as a shared
    block), and an object of kind 3 is one no reader accepts."""
    data = frame(KIND_BLOCK, b"k", b"r", b"g", b"abc", keys=KEYS)
    with pytest.raises(ValueError, match=f"frame kind must be 1 .* or 2 .*, got {kind!r}"):
        frame(kind, b"k", b"r", b"g", b"abc", keys=KEYS)
    with pytest.raises(ValueError, match="frame kind must be"):
        unframe(kind, data, b"k", b"r", b"g", keys=KEYS)
    assert bytes(unframe(KIND_BLOCK, data, b"k", b"r", b"g", keys=KEYS)) == b"abc"  # the control


def test_a_frame_payload_that_is_not_a_contiguous_buffer_is_named():
    import numpy as np

    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    for bad in (strided, "text"):
        with pytest.raises(TypeError, match="frame payload must be a contiguous bytes-like buffer"):
            frame(KIND_BLOCK, b"k", b"r", b"g", bad, keys=KEYS)
    whole = np.ascontiguousarray(strided)
    assert bytes(unframe(KIND_BLOCK, frame(KIND_BLOCK, b"k", b"r", b"g", whole, keys=KEYS), b"k", b"r", b"g", keys=KEYS)) \
        == whole.tobytes()


# -- URL, options, start-up -------------------------------------------------------------------
def test_parse_s3_url():
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    for bad, msg in [("file:///tmp/x", "scheme"), ("s3:///x", "no bucket"),
                     ("s3://b/a//c", "empty or relative"), ("s3://b/../c", "empty or relative"),
                     ("s3://b/a?x=1", "query")]:
        with pytest.raises(ValueError, match=msg):
            parse_s3_url(bad)


def test_unknown_storage_option_is_named():
    with pytest.raises(ValueError, match="'endpiont'"):
        open_s3_store("s3://b/p", {"endpiont": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="timeout_s"):
        open_s3_store("s3://b/p", {"timeout_s": -1})
    with pytest.raises(ValueError, match=r"client_kwargs.*'verify'"):
        open_s3_store("s3://b/p", {"client_kwargs": {"verify": False}})


def test_shared_tier_config_keeps_a_read_only_copy_of_nested_options():
    """The copy was shallow: changing the caller's ``client_kwargs`` dict afterwards changed
    the checked config (here to an option the check refuses)."""
    from tiering.coldtier import SharedTierConfig

    inner = {"endpoint_url": "http://127.0.0.1:1"}
    cfg = SharedTierConfig("s3://b/p", {"client_kwargs": inner, "region": "us-east-1"})
    inner["verify"] = False
    assert dict(cfg.storage_options["client_kwargs"]) == {"endpoint_url": "http://127.0.0.1:1"}
    with pytest.raises(TypeError):
        cfg.storage_options["client_kwargs"]["verify"] = False
    with pytest.raises(TypeError):
        cfg.storage_options["region"] = "x"
    open_s3_store(cfg.url, cfg.storage_options, check=False)  # still opens as checked


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_unreachable_store_raises_the_tiers_own_error_at_start():
    port = _dead_port()
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "region": "us-east-1", "key": "k",
            "secret": "s"}
    with pytest.raises(ColdTierUnavailable, match=f"127.0.0.1:{port}"):
        open_s3_store("s3://bucket/prefix", opts, timeout_s=2.0, max_retries=0)
    # fsspec-style client_kwargs are understood the same way
    with pytest.raises(ColdTierUnavailable):
        open_s3_store("s3://bucket/prefix", {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
                                              "key": "k", "secret": "s", "region": "us-east-1"},
                      timeout_s=2.0, max_retries=0)
    # without the check, opening does no I/O and succeeds (a caller may defer the probe)
    assert open_s3_store("s3://bucket/prefix", opts, check=False) is not None


def test_configs_validate():
    with pytest.raises(ValueError, match="io_threads"):
        ColdTierConfig(io_threads=0)
    with pytest.raises(ValueError, match="known_capacity"):
        ColdTierConfig(known_capacity=-3)
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        BreakerConfig(cooldown_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        LeaseConfig(ttl_s=5, renew_every_s=4, safety_s=2)
    with pytest.raises(ValueError, match="cap_bytes"):
        SweeperConfig(cap_bytes=0)
    with pytest.raises(ValueError, match="low_fraction"):
        SweeperConfig(cap_bytes=10, low_fraction=1.5)


@pytest.mark.parametrize("name, value", [
    ("timeout_s", True), ("timeout_s", float("inf")), ("timeout_s", float("nan")),
    ("connect_timeout_s", float("inf")), ("max_retries", True), ("max_retries", 1.5),
    ("allow_http", "no"),
])
def test_a_bool_infinite_or_mistyped_storage_option_is_refused_by_name(name, value):
    """These were taken: True as a 1 s timeout or 1 retry, an infinite timeout (which bounds
    nothing and broke the client at open), "no" as allow_http=True."""
    with pytest.raises(ValueError, match=f"storage_options\\['{name}'\\]"):
        SharedTierConfig("s3://b/p", {name: value})
    with pytest.raises(ValueError, match=f"storage_options\\['{name}'\\]"):
        open_s3_store("s3://b/p", {name: value}, check=False)
    SharedTierConfig("s3://b/p", {name: {"timeout_s": 3.0, "connect_timeout_s": 1,
                                         "max_retries": 2, "allow_http": False}[name]})


@pytest.mark.parametrize("kw", [{"timeout_s": float("nan")}, {"connect_timeout_s": float("inf")},
                                {"max_retries": True}, {"timeout_s": 0}])
def test_open_s3_store_refuses_bad_timeouts_given_as_arguments(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"open_s3_store: {name}"):
        open_s3_store("s3://b/p", None, check=False, **kw)


@pytest.mark.parametrize("name, value", [
    ("timeout_s", 1e15), ("connect_timeout_s", 1e20), ("max_retries", 10**30),
    ("max_retries", 1001),
])
def test_a_client_knob_past_what_the_client_holds_is_refused_by_name(name, value):
    """A timeout of 1e15 s or 10**30 retries passed the check and then raised OverflowError
    ("Python int too large to convert to C int") while the client was built, naming nothing."""
    with pytest.raises(ValueError, match=rf"storage_options\['{name}'\]"):
        SharedTierConfig("s3://b/p", {name: value})
    with pytest.raises(ValueError, match=rf"open_s3_store: {name}"):
        open_s3_store("s3://b/p", None, check=False, **{name: value})
    limit = {"timeout_s": 9e9, "connect_timeout_s": 9e9, "max_retries": 1000}[name]
    opts = {"endpoint": "http://127.0.0.1:9", "aws_access_key_id": "k",
            "aws_secret_access_key": "s"}
    assert open_s3_store("s3://b/p", opts, check=False, **{name: limit}) is not None


def test_an_endless_cooldown_or_lease_and_a_bool_capacity_are_refused():
    """An infinite cooldown never tries the store again; an infinite ttl outlives a dead
    holder for ever; KnownBlocks(True) was a capacity of one. All three used to be taken."""
    with pytest.raises(ValueError, match="BreakerConfig.cooldown_s must be finite"):
        BreakerConfig(cooldown_s=float("inf"))
    with pytest.raises(ValueError, match="LeaseConfig.ttl_s must be finite"):
        LeaseConfig(ttl_s=float("inf"))
    with pytest.raises(ValueError, match="KnownBlocks capacity"):
        KnownBlocks(True)
    assert BreakerConfig(cooldown_s=1e9).cooldown_s == 1e9  # large but finite: fine


# -- known-blocks cache -----------------------------------------------------------------------
def test_known_blocks_is_bounded_lru():
    rng = random.Random(3)
    kb = KnownBlocks(8)
    keys = [rbytes(rng, 16) for _ in range(20)]
    for k in keys[:8]:
        kb.add(k, 100)
        kb.check_integrity()
    assert keys[0] in kb  # touch: keys[1] is now the oldest
    kb.add(keys[8], 100)
    kb.check_integrity()
    assert keys[0] in kb and keys[1] not in kb and len(kb) == 8
    for k in keys[9:]:
        kb.add(k, 5)
        kb.check_integrity()
    assert len(kb) == 8 and set(kb.keys()) == set(keys[12:])
    with pytest.raises(ValueError, match="capacity"):
        KnownBlocks(0)


# -- circuit breaker (state machine against a model) ------------------------------------------
class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cfg = BreakerConfig(failure_threshold=2, cooldown_s=5.0)
        self.b = CircuitBreaker(self.cfg, clock=self.clock)
        self.state = "closed"
        self.fails = 0
        self.opened_at = 0.0
        self.trial = False
        self.opens = 0

    @rule(dt=st.floats(0, 8))
    def tick(self, dt):
        self.clock.t += dt

    @rule()
    def allow(self):
        got = self.b.allow()
        if self.state == "open" and self.clock.t - self.opened_at >= 5.0:
            self.state, self.trial = "half", False
        if self.state == "closed":
            want = True
        elif self.state == "half" and not self.trial:
            self.trial, want = True, True
        else:
            want = False
        assert got == want

    @rule()
    def success(self):
        self.b.record_success()
        self.state, self.fails, self.trial = "closed", 0, False

    @rule()
    def failure(self):
        self.b.record_failure()
        self.fails += 1
        if self.state == "half" or (self.state == "closed" and self.fails >= 2):
            self.state, self.opened_at, self.trial = "open", self.clock.t, False
            self.opens += 1

    @invariant()
    def agrees(self):
        self.b.check_integrity()
        names = {"closed": BreakerState.CLOSED, "open": BreakerState.OPEN, "half": BreakerState.HALF_OPEN}
        assert self.b.state is names[self.state]
        assert self.b.stats().opened == self.opens


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_breaker_opens_once_and_refuses_without_io():
    clock = FakeClock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=3), clock=clock)
    assert b.allow()
    b.record_failure()
    assert [b.allow() for _ in range(5)] == [False] * 5
    assert b.stats().refused == 5 and b.stats().opened == 1
    clock.t += 3
    assert b.allow() and not b.allow()  # one trial only
    b.record_success()
    assert b.allow() and b.state is BreakerState.CLOSED


# -- leases (state machine on obstore's in-memory store, which honours the same preconditions) --
class LeaseMachine(RuleBasedStateMachine):
    """Three workers acquire, renew, release and wait on one lease; at no time do two of them
    believe they hold it, and a live lease is never taken over."""

    def __init__(self) -> None:
        super().__init__()
        from obstore.store import MemoryStore

        from tiering.coldtier import Lease

        self.clock = FakeClock(0.0)
        self.store = MemoryStore()
        cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
        self.leases = [Lease(self.store, "p/LEASE", f"w{i}", config=cfg, clock=self.clock,
                             token_factory=lambda i=i: f"t{i}") for i in range(3)]
        self.expires = 0.0  # when the lease on the store expires (model)
        self.holder: int | None = None  # who wrote it last (model)

    @rule(dt=st.floats(0, 20))
    def tick(self, dt):
        self.clock.t += dt

    @rule(i=st.integers(0, 2))
    def acquire(self, i):
        from tiering.coldtier import LeaseHeld

        live = self.holder is not None and self.clock.t < self.expires
        try:
            self.leases[i].acquire()
        except LeaseHeld as exc:
            assert live, "refused a free or expired lease"
            assert f"'w{self.holder}'" in str(exc)  # the message names the holder
            return
        assert not live, "took over a live lease"
        for j, other in enumerate(self.leases):
            if j != i and other.info is not None:
                assert not other.renew(), "an old holder renewed after a takeover"
        self.holder, self.expires = i, self.clock.t + 30

    @rule(i=st.integers(0, 2))
    def renew(self, i):
        mine = self.holder == i and self.leases[i].info is not None
        ok = self.leases[i].renew()
        assert ok == mine  # only the last writer's ETag still matches
        if ok:
            self.expires = self.clock.t + 30

    @rule(i=st.integers(0, 2))
    def release(self, i):
        if self.leases[i].release():
            assert self.holder == i
            self.holder, self.expires = None, 0.0

    @invariant()
    def one_holder_at_most(self):
        held = [i for i, lease in enumerate(self.leases) if lease.held]
        assert len(held) <= 1, held
        if held:
            assert held == [self.holder] and self.clock.t < self.expires
        for lease in self.leases:
            lease.check_integrity()


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_keeper_renews_until_stopped_and_stops_when_lost():
    import threading

    from obstore.store import MemoryStore

    from tiering.coldtier import Lease, LeaseKeeper

    store = MemoryStore()
    clock = FakeClock(0.0)
    cfg = LeaseConfig(ttl_s=1.0, renew_every_s=0.05, safety_s=0.1)
    lease = Lease(store, "L", "w0", config=cfg, clock=clock)
    lease.acquire()
    events: list[bool] = []
    two = threading.Event()

    def seen(ok: bool) -> None:
        events.append(ok)
        if len(events) >= 2:
            two.set()

    keeper = LeaseKeeper(lease, on_renew=seen).start()
    assert two.wait(10), "the keeper did not renew"
    keeper.stop()
    assert events[:2] == [True, True] and keeper.renewals >= 2
    # the lease is taken over behind its back: the next renewal fails and the keeper ends
    clock.t += 2.0
    Lease(store, "L", "w1", config=cfg, clock=clock).acquire()
    lost = threading.Event()
    keeper = LeaseKeeper(lease, on_renew=lambda ok: ok or lost.set()).start()
    assert lost.wait(10)
    keeper._thread.join(10)
    assert not keeper._thread.is_alive() and lease.info is None and not lease.held


def test_fsspec_urls_keep_working():
    import numpy as np
    import zarr

    from tiering.coldtier import open_zarr_store

    zs = open_zarr_store("memory://coldtier-test/x")
    data = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    arr = zarr.create_array(zs, name="y", shape=data.shape, dtype=data.dtype)
    arr[:] = data
    assert type(zs).__name__ == "FsspecStore"
    assert np.array_equal(zarr.open_array(zs, path="y")[:], data)


def test_bad_block_input_raises_and_writes_nothing():
    import obstore
    from obstore.store import MemoryStore

    from tiering.coldtier import BlockQueue, BlockStatus, SharedBlockStore

    rng = random.Random(5)
    store = MemoryStore()
    s = SharedBlockStore(store, rng.randbytes(16), b"g", config=ColdTierConfig(max_block_bytes=1000), trust=TRUST)
    with pytest.raises(ValueError, match="max_block_bytes"):
        s.publish(rng.randbytes(32), rng.randbytes(1001))
    with pytest.raises(ValueError, match="block key"):
        s.publish("not-bytes", rng.randbytes(10))
    q = BlockQueue(s)
    with pytest.raises(ValueError, match="block key"):
        q.submit_fetch(b"")
    assert [m for c in obstore.list(store) for m in c] == [] and len(s.known) == 0
    # and the in-memory store behaves like the server for a real round trip
    k, v = rng.randbytes(32), rng.randbytes(999)
    assert s.publish(k, v).status is BlockStatus.WRITTEN
    assert s.publish(k, v).status is BlockStatus.DUPLICATE
    assert s.fetch(k).payload == v
    s.check_integrity()
    q.close(5)


@pytest.mark.parametrize("args, what", [
    ((b"", b"g"), "root must be 1-1024 bytes"),
    ((b"r" * 1025, b"g"), "root must be 1-1024 bytes"),
    ((b"r", b"g" * 1025), "geometry at most 1024"),
    ((b"r", b"g", {"config": {"io_threads": 2}}), "config must be a ColdTierConfig, got dict"),
    ((b"r", b"g", {"breaker": object()}), "breaker must be a CircuitBreaker"),
])
def test_a_shared_block_store_that_could_never_work_is_refused_at_once(args, what):
    """An empty root was taken: every request then failed on the path ``blocks//<key>``
    and came back UNAVAILABLE, opening the breaker as if the store were down. A root or
    geometry too long for a frame failed only at the first publish, a dict config with
    an AttributeError."""
    from obstore.store import MemoryStore

    from tiering.coldtier import SharedBlockStore

    *ids, kw = args if isinstance(args[-1], dict) else (*args, {})
    with pytest.raises(ValueError, match=what):
        SharedBlockStore(MemoryStore(), *ids, **kw, trust=TRUST)


def test_configs_and_records_of_the_wrong_type_are_refused_when_given():
    """Each was taken and failed later, at first use, with an AttributeError (or, for a
    string geometry, made every private object unreadable); a NaN hit time was recorded."""
    import obstore
    from obstore.store import MemoryStore

    from tiering.coldtier import HitLog, Lease, PrivatePrefix, Sweeper

    m = MemoryStore()
    with pytest.raises(ValueError, match="Sweeper config must be a SweeperConfig, got dict"):
        Sweeper(m, "w", {"cap_bytes": 5})
    with pytest.raises(ValueError, match="lease config must be a LeaseConfig, got dict"):
        Lease(m, "L", "o", config={"ttl_s": 3})
    with pytest.raises(ValueError, match="PrivatePrefix geometry must be bytes, got str"):
        PrivatePrefix(m, "p", "o", geometry="g", trust=TRUST)
    log = HitLog("w")
    for args in (("r", b"g", b"k", 1.0), (b"r", b"g", b"", 1.0), (b"r", "g", b"k", 1.0),
                 (b"r", b"g", b"k", float("nan")), (b"r", b"g", b"k", True)):
        with pytest.raises(ValueError, match="HitLog.record"):
            log.record(*args)
    assert log.flush(m)  # nothing was recorded: nothing to write
    assert [x for c in obstore.list(m) for x in c] == []
    log.record(b"r", b"g", b"k", 5.0)  # the control
    assert log.flush(m) and len([x for c in obstore.list(m) for x in c]) == 1


def test_refresh_index_limit_bounds_what_it_adds():
    """``limit=0`` added up to the whole capacity (0 read as "no limit") and a negative
    limit added all but the oldest few."""
    import time as _time

    from obstore.store import MemoryStore

    from tiering.coldtier import SharedBlockStore

    rng = random.Random(31)
    m = MemoryStore()
    root = rng.randbytes(16)
    w = SharedBlockStore(m, root, b"g", trust=TRUST)
    keys = []
    for _ in range(5):
        keys.append(rng.randbytes(16))
        w.publish(keys[-1], rng.randbytes(40))
        _time.sleep(0.002)  # distinct modification times: the listing orders by them
    for limit, want in ((0, 0), (2, 2), (None, 5)):
        r = SharedBlockStore(m, root, b"g", trust=TRUST)
        assert r.refresh_index(limit) == 5
        assert len(r.known) == want, (limit, len(r.known))
        # the newest ``want`` of them, oldest first: the listing is ordered by modification time
        assert r.known.keys() == (keys[-want:] if want else []), limit
        r.check_integrity()
    r = SharedBlockStore(m, root, b"g", trust=TRUST)
    for bad in (-2, True, 1.5):
        with pytest.raises(ValueError, match="limit must be None or an int >= 0"):
            r.refresh_index(bad)
    assert len(r.known) == 0


def test_a_foreign_object_under_the_roots_prefix_is_not_taken_for_a_block():
    """An empty or too-short object with a hex name under ``blocks/<root>/`` (left by another
    tool, or truncated) used to enter the known cache with its size, and the next
    check_integrity failed on a refresh that had been accepted."""
    import obstore
    from obstore.store import MemoryStore

    from tiering.coldtier import BlockStatus, SharedBlockStore

    rng = random.Random(9)
    store = MemoryStore()
    root = rng.randbytes(16)
    s = SharedBlockStore(store, root, b"geom", trust=TRUST)
    real = rng.randbytes(16)
    assert s.publish(real, rng.randbytes(64)).status is BlockStatus.WRITTEN
    prefix = f"blocks/{root.hex()}/"
    for name, data in (("00ff", b""), ("abcd", rng.randbytes(8)), ("not-hex", rng.randbytes(99))):
        obstore.put(store, prefix + name, data)
    fresh = SharedBlockStore(store, root, b"geom", trust=TRUST)
    assert fresh.refresh_index() == 1
    assert fresh.known.keys() == [real]
    fresh.check_integrity()
    with pytest.raises(ValueError, match="size of block 00ff must be an int >= 1"):
        fresh.known.add(bytes.fromhex("00ff"), 0)
    with pytest.raises(ValueError, match="key must be non-empty bytes"):
        fresh.known.add("00ff", 10)
    assert fresh.known.keys() == [real]
    fresh.known._d[b"x"] = 0  # the check sees a bad entry (negative control)
    with pytest.raises(AssertionError, match="has size 0"):
        fresh.check_integrity()


def _swept_store(rng, n=6, size=100):
    import obstore
    from obstore.store import MemoryStore

    store = MemoryStore()
    for i in range(n):
        obstore.put(store, f"blocks/{'ab' * 16}/{i:032x}", rng.randbytes(size))
    return store


def test_a_sweep_whose_deletes_fail_reports_only_what_it_deleted():
    """The record of a sweep whose delete failed used to say every victim's bytes were freed
    (``bytes_deleted`` and ``total_after``) while ``deleted`` said 0."""
    import unittest.mock as mock

    import obstore

    from tiering.coldtier import Sweeper

    rng = random.Random(21)
    store = _swept_store(rng)
    real_delete = obstore.delete

    def failing_delete(st, paths):
        if any(str(p).startswith("blocks/") for p in ([paths] if isinstance(paths, str) else paths)):
            raise OSError("Generic S3 error: status code: 503, Service Unavailable")
        return real_delete(st, paths)

    sw = Sweeper(store, "w0", SweeperConfig(cap_bytes=350, low_fraction=0.5), clock=FakeClock())
    with mock.patch.object(obstore, "delete", failing_delete):
        res = sw.sweep_once()
    assert res == (600, 600, 0, 0, 0), res
    assert len([m for c in obstore.list(store, prefix="blocks/") for m in c]) == 6
    res = sw.sweep_once()  # the control: the same sweep with working deletes
    assert res == (600, 100, 5, 500, 0), res
    assert len([m for c in obstore.list(store, prefix="blocks/") for m in c]) == 1
    sw.close()


@pytest.mark.parametrize("report", [b"[1, 2]", b'"text"', b'{"ab/cd": "soon"}', b"\xff\xfe"])
def test_a_damaged_hit_report_does_not_stop_the_sweeper(report):
    """A hit report that is JSON but not an object (a list, a string) made every sweep give up
    (None, as for a store fault) before the report was removed, so the sweeper was stuck for
    good. A report with a non-number time or bytes that are not JSON were already skipped."""
    import obstore

    from tiering.coldtier import Sweeper

    rng = random.Random(22)
    store = _swept_store(rng)
    obstore.put(store, "hits/w9/000000000001-ab", report)
    sw = Sweeper(store, "w0", SweeperConfig(cap_bytes=350, low_fraction=0.5), clock=FakeClock())
    res = sw.sweep_once()
    assert res == (600, 100, 5, 500, 1), res
    assert [m for c in obstore.list(store, prefix="hits/") for m in c] == []  # read and removed
    sw.close()


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan"), "5", True])
def test_every_wait_of_the_block_queue_is_bounded(bad):
    """``drain(None)`` and ``close(None)`` waited with no bound (and ``drain(inf)``); NaN
    was no bound either. A negative budget still means: do not wait."""
    import threading

    from obstore.store import MemoryStore

    from tiering.coldtier import BlockQueue, BlockStatus, SharedBlockStore

    rng = random.Random(23)
    s = SharedBlockStore(MemoryStore(), rng.randbytes(16), b"g", trust=TRUST)
    q = BlockQueue(s)
    gate = threading.Event()  # every I/O thread waits on it: the publish stays queued
    for _ in range(s.config.io_threads):
        q._pool.submit(gate.wait, 10)
    k, v = rng.randbytes(16), rng.randbytes(50)
    assert q.submit_publish(k, v)
    for call in (q.drain, q.wait_idle, q.close):
        with pytest.raises(ValueError, match=f"BlockQueue.{call.__name__}: timeout_s must be a finite number"):
            call(bad)
    # an expired budget answers at once: False, the publish is still queued (a wait would
    # outlast the gate and see it done)
    assert q.wait_idle(-1.0) is False and q.in_flight == 1
    gate.set()
    got = q.close(10)
    assert [(r.key, r.status) for r in got] == [(k, BlockStatus.WRITTEN)]
    assert s.fetch(k).payload == v


def test_a_private_object_name_that_is_not_text_is_refused_by_name():
    from obstore.store import MemoryStore

    from tiering.coldtier import PrivatePrefix

    p = PrivatePrefix(MemoryStore(), "w", "me", trust=TRUST)
    for call in (lambda: p.put(5, b"x"), lambda: p.get(5), lambda: p.delete(b"a")):
        with pytest.raises(ValueError, match="object name .* must be 1-200 characters"):
            call()


@pytest.mark.parametrize("message", ["Generic S3 error: status code: 503, Service Unavailable",
                                     "request timed out", "connection refused"])
def test_every_fault_the_store_raises_as_not_answering_is_transient(message):
    """A server error (5xx) or timeout becomes StoreNotAnswering with an errno the KV cache
    treats as transient: the bytes stay on the store, a reload is retried, never marked lost."""
    from tiering.coldtier.held import _transient_errno
    from tiering.errors import TRANSIENT_IO_ERRNOS

    assert _transient_errno(RuntimeError(message)) in TRANSIENT_IO_ERRNOS


def test_the_holder_never_believes_its_lease_outlives_what_the_store_says():
    """The holder's expiry is the one it wrote. It used to read the clock again after the
    write, so a slow write (here 3 s, more than ``safety_s``) let the holder think the lease
    held after the moment other workers saw it expire and could take it over."""
    import json

    import obstore
    from obstore.store import MemoryStore

    from tiering.coldtier import Lease

    store = MemoryStore()
    t = [100.0]
    real_put = obstore.put

    def slow_put(*a, **kw):  # every write takes 3 s of the injected clock
        res = real_put(*a, **kw)
        t[0] += 3.0
        return res

    cfg = LeaseConfig(ttl_s=30, renew_every_s=10, safety_s=2)
    lease = Lease(store, "p/LEASE", "w0", config=cfg, clock=lambda: t[0])
    import unittest.mock as mock

    with mock.patch.object(obstore, "put", slow_put):
        for op in (lease.acquire, lease.renew):
            op()
            stored = json.loads(bytes(obstore.get(store, "p/LEASE").bytes()))["expires_at"]
            assert lease.info.expires_at == stored, (op.__name__, lease.info.expires_at, stored)
            t[0] = stored - 0.5  # others may take it over in 0.5 s: the holder must not write
            assert not lease.held
            t[0] = stored - cfg.safety_s - 0.5
            assert lease.held  # the control: well before the stored expiry it holds


@pytest.mark.parametrize(("options", "named"), [
    ({"endpoint": 5}, "storage_options['endpoint']"),
    ({"endpoint_url": ""}, "storage_options['endpoint_url']"),
    ({"region": None}, "storage_options['region']"),
    ({"key": b"id"}, "storage_options['key']"),
    ({"client_kwargs": {"endpoint_url": 8333}}, "storage_options['client_kwargs']['endpoint_url']"),
])
def test_an_endpoint_region_or_credential_that_is_not_text_is_refused_by_name(options, named):
    """A number as the endpoint was taken and failed only inside the client."""
    with pytest.raises(ValueError, match=re.escape(named) + " must be a non-empty str"):
        check_storage_options(options)
    with pytest.raises(ValueError, match=re.escape(named)):
        SharedTierConfig("s3://b/p", options)
    check_storage_options({"endpoint": "http://127.0.0.1:8333", "region": "us-east-1",
                           "anon": True})  # the control: text where text is due, a bool flag


def test_a_block_cap_past_what_a_byte_range_holds_is_refused_not_every_fetch_failing():
    """``ColdTierConfig(max_block_bytes=2**64 + 5)`` was taken; every fetch then asked the
    store for a byte range past 64 bits, failed as UNAVAILABLE and counted against the
    breaker: a shared tier that never hit, blamed on the store."""
    from obstore.store import MemoryStore

    from tiering.coldtier import BlockStatus, SharedBlockStore
    from tiering.coldtier.blocks import MAX_BLOCK_BYTES

    for bad in (2**64 + 5, 10**30, MAX_BLOCK_BYTES + 1):
        with pytest.raises(ValueError, match=r"ColdTierConfig.max_block_bytes must be at most"):
            ColdTierConfig(max_block_bytes=bad)
    rng = random.Random(8)
    s = SharedBlockStore(MemoryStore(), rng.randbytes(16), b"g",
                         config=ColdTierConfig(max_block_bytes=MAX_BLOCK_BYTES), trust=TRUST)
    key, payload = rng.randbytes(32), rng.randbytes(300)
    assert s.publish(key, payload).status is BlockStatus.WRITTEN
    got = s.fetch(key)  # the largest cap still reads back the block
    assert got.status is BlockStatus.HIT and got.payload == payload
