"""The shared request state machine (``tiering.core.lifecycle``) on its own, and what
each backend gains from it: one holdings table, one set of guard messages and
counter names, the move choice the model now honours, integrity checks that catch
each kind of corruption, and the ``TieredCache`` calls on the model and the fake."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import fill
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import SimClock
from tiering.control.controller import ControllerConfig
from tiering.control.protocols import TieredCache
from tiering.core import lifecycle as lc
from tiering.core.pools import PoolIntegrityError
from tiering.disk import DiskConfig
from tiering.errors import CacheClosed, IllegalTransition, UnknownRequest
from tiering.testing import FakeClock, FakeTieredResource
from tiering.tiered import TieredKV
from tiering.types import CANCELLED, Move, RequestState, Tier, TransferResult

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2)
PB = GEOM.page_bytes


def machine(device=8, host=4, disk=4):
    ledger = lc.PageLedger(device, host, disk)
    clock = FakeClock()
    life = lc.Lifecycle("test", lc.Counters(), clock, lc.page_releasers(ledger))
    return life, ledger, clock


def resident(life, ledger, rid, n, clock):
    life.register(rid, None, lambda: lc.PageRecord(rid, None, clock(), n))
    r = life.records[rid]
    assert ledger.take(0, n)
    r.device = n
    return r


def check(life, ledger):
    used, cap = lc.ledger_maps(ledger)
    return life.check(lambda r: r.num_tokens, used=used, capacity=cap)


# -- the machine -------------------------------------------------------------------------------


def test_one_holdings_table_covers_every_state():
    assert set(lc.HOLDS) == set(RequestState)
    for state, sets in lc.HOLDS.items():
        sizes = {len(s) for s in sets}
        assert sizes == ({2} if state.in_flight else {0} if state is S.LOST else {1}), state
        if not state.in_flight and state is not S.LOST:
            assert {state.tier} in [set(s) for s in sets]
    for move, state in lc.IN_FLIGHT.items():
        assert lc.holds(state, move) == {frozenset({move.source, move.destination})}


def test_offload_choice():
    assert lc.offload_move(True, True, True) is Move.OFFLOAD_TO_HOST
    assert lc.offload_move(True, False, False) is Move.OFFLOAD_TO_HOST
    assert lc.offload_move(False, True, True) is Move.OFFLOAD_TO_DISK
    assert lc.offload_move(False, True, False) is None
    assert lc.offload_move(False, False, True) is None


def test_a_move_lands_counts_and_frees_its_source():
    rng = random.Random(3)
    life, ledger, clock = machine()
    n = rng.randint(1, 4)
    r = resident(life, ledger, "a", n, clock)
    assert ledger.take(1, n)
    r.host = n
    life.begin(r, lc.Job(Move.OFFLOAD_TO_HOST, clock()))
    assert r.state is S.OFFLOADING and list(life.inflight) == ["a"]
    assert (life.reserved(Tier.HOST), life.reserved(Tier.DEVICE)) == (n, 0)
    assert check(life, ledger) == []
    clock.advance(2.5)
    job = life.end(r)
    res = life.land(r, job.move, n * PB, job.started)
    assert res == TransferResult("a", Move.OFFLOAD_TO_HOST, True, n * PB, S.ON_HOST)
    assert r.held() == (0, n, 0) and ledger.used == [0, n, 0] and not life.inflight
    c = life.counters
    assert (c.offloads_to_host, c.bytes_device_to_host, c.reload_stall_s_total) == (1, n * PB, 0)
    # a reload's stall is counted from its start
    assert ledger.take(0, n)
    r.device = n
    life.begin(r, lc.Job(Move.RELOAD_FROM_HOST, clock()))
    clock.advance(1.25)
    life.land(r, life.end(r).move, n * PB, 1000.0 + 2.5)
    assert c.reload_stall_s_total == pytest.approx(1.25) and c.reloads_from_host == 1
    assert check(life, ledger) == []


def test_a_failed_move_stays_at_its_source_and_a_cancelled_one_is_taken_back():
    life, ledger, clock = machine()
    r = resident(life, ledger, "a", 3, clock)
    assert ledger.take(2, 3)
    r.disk = 3
    life.begin(r, lc.Job(Move.OFFLOAD_TO_DISK, clock()))
    life.end(r)
    res = life.survive(r, Move.OFFLOAD_TO_DISK, "EIO")
    assert res == TransferResult("a", Move.OFFLOAD_TO_DISK, False, 0, S.RESIDENT, "EIO")
    assert r.held() == (3, 0, 0) and life.counters.offload_failures == 1
    assert ledger.take(1, 3)
    r.host = 3
    life.begin(r, lc.Job(Move.OFFLOAD_TO_HOST, clock()))
    res = life.cancel(r)
    assert res == TransferResult("a", Move.OFFLOAD_TO_HOST, False, 0, S.RESIDENT, CANCELLED)
    assert life.counters.offloads_cancelled == 1 and ledger.used == [3, 0, 0]
    assert check(life, ledger) == []


def test_guards_name_the_request_and_change_nothing():
    life, ledger, clock = machine()
    r = resident(life, ledger, "a", 2, clock)
    for op in (lc.Op.DEMOTE, lc.Op.RELOAD, lc.Op.DROP):
        with pytest.raises(IllegalTransition, match=f"{op.value}: request 'a' is resident"):
            lc.guard(r, op)
    with pytest.raises(IllegalTransition, match="'a' is resident; it cannot become on_disk"):
        life.set_state(r, S.ON_DISK)
    assert r.state is S.RESIDENT and r.held() == (2, 0, 0)
    with pytest.raises(UnknownRequest, match="'nope'"):
        life.get("nope")
    with pytest.raises(ValueError, match="different overrides"):
        life.register("a", "other", lambda: lc.PageRecord("a", "other", 0.0))
    assert life.records["a"] is r
    with pytest.raises(ValueError, match="non-empty str"):
        life.register("", None, lambda: lc.PageRecord("", None, 0.0))
    with pytest.raises(ValueError, match=r"tier\(s\) \['disk'\]"):
        lc.Lifecycle("x", lc.Counters(), clock, {Tier.DEVICE: print, Tier.HOST: print})
    life.closed = True
    with pytest.raises(CacheClosed, match="state_of"):
        life.get("a", "state_of")


def test_check_finds_each_kind_of_corruption():
    life, ledger, clock = machine()
    r = resident(life, ledger, "a", 2, clock)
    assert check(life, ledger) == []
    r.host = 2  # resident with host pages
    ledger.used[1] += 2
    assert any("a: state resident holds" in p for p in check(life, ledger))
    r.host = 0
    assert any("host: records hold 0 pages, the ledger says 2" in p for p in check(life, ledger))
    ledger.used[1] -= 2
    r.device = 1  # fewer pages than the request needs
    ledger.used[0] -= 1
    assert any("a: 1 device pages, needs 2" in p for p in check(life, ledger))
    r.device = 2
    ledger.used[0] += 1
    r.state = S.OFFLOADING  # in flight with no job
    assert any("job=False" in p for p in check(life, ledger))
    r.state = S.RESIDENT
    ledger.used[0] = 9  # over capacity
    assert any("device: 9 pages used of 8" in p for p in check(life, ledger))
    ledger.used[0] = 2
    life.inflight["ghost"] = r
    assert any("ghost: in flight but not a current record" in p for p in check(life, ledger))


# -- the backends --------------------------------------------------------------------------------


def _model(to_disk: bool = True, clock=None):
    return ModeledKVCache(PB // 2, 2, 8, 2, 10, LinkRates.instant(), clock or SimClock(),
                          offload_to_disk_when_host_full=to_disk)


@pytest.mark.parametrize("to_disk", [True, False])
def test_the_model_honours_offload_to_disk_when_host_full(tmp_path, to_disk, closing):
    """The model decides as the real cache does (it used to ignore the option)."""
    rng = random.Random(17)
    tokens = rng.randint(5, 6)  # 3 pages; the host holds 2
    model = _model(to_disk)
    real = PagedKVCache(GEOM, device_pages=8, host_pages=2, offload_to_disk_when_host_full=to_disk,
                        disk=DiskConfig(path=tmp_path / "d", capacity_bytes=10 * PB, chunk_bytes=PB))
    closing(real)
    model.ingest_request("a")
    assert model.allocate("a", tokens)
    fill(real, "a", torch.Generator().manual_seed(rng.randrange(1 << 30)), tokens)
    for kv in (model, real):
        want = 3 * PB if to_disk else 0
        assert kv.reclaimable("a") == want
        assert kv.reclaimable_many(["a"]).tolist() == [want]
        assert kv.offload("a") == want
        if to_disk:
            assert kv.offload_destination("a") is Tier.DISK
        else:
            assert kv.state_of("a") is S.RESIDENT and kv.stats.offload_refusals == 1
        kv.check_integrity()
    real.synchronize(10)
    model.poll()
    assert model.state_of("a") is real.state_of("a")
    assert model.stats.offloads_to_disk == real.stats.offloads_to_disk == int(to_disk)
    assert model.stats.bytes_device_to_disk == real.stats.bytes_device_to_disk


def test_every_backend_counts_under_the_same_names(tmp_path, closing):
    real = closing(PagedKVCache(GEOM, device_pages=4, host_pages=4))
    for kv in (real, _model(), FakeTieredResource(100, 100, 100)):
        names = set(kv.stats.as_dict())
        assert set(lc.Counters.FIELDS) <= names, type(kv).__name__
        assert isinstance(kv, TieredCache), type(kv).__name__


def _corrupt_model():
    kv = _model()
    kv.ingest_request("a")
    assert kv.allocate("a", 4)
    kv._reqs["a"].host = 2  # a resident request holding host pages
    return kv


def _corrupt_fake():
    kv = FakeTieredResource(100, 100, 100)
    kv.add("a", 10)
    kv.ledger.used[1] += 5  # the host ledger off
    return kv


def _corrupt_real():
    kv = PagedKVCache(GEOM, device_pages=4, host_pages=4)
    fill(kv, "a", torch.Generator().manual_seed(5), 4)
    kv._reqs["a"].state = S.ON_HOST  # on host, but holding device pages
    return kv


@pytest.mark.parametrize(("make", "error", "what"), [
    (_corrupt_model, AssertionError, "a: state resident holds"),
    (_corrupt_fake, AssertionError, "host: records hold 0 pages, the ledger says 5"),
    (_corrupt_real, PoolIntegrityError, "a: state on_host holds"),
])
def test_each_backends_integrity_check_is_the_machines(make, error, what, closing):
    kv = closing(make())
    with pytest.raises(error, match=what):
        kv.check_integrity()


@pytest.mark.parametrize("which", ["model", "fake"])
def test_the_model_and_the_fake_run_behind_the_front_door(which):
    rng = random.Random(23)
    clock = SimClock() if which == "model" else FakeClock()
    if which == "model":
        kv = ModeledKVCache(PB // 2, 2, 12, 16, 0, LinkRates.instant(), clock)
        sizes = {rid: 2 * rng.randint(3, 4) for rid in "abc"}  # tokens: 3 or 4 pages each
    else:
        kv = FakeTieredResource(12 * PB, 16 * PB, 0, async_transfers=True, clock=clock)
        sizes = {rid: PB * rng.randint(3, 4) for rid in "abc"}
    tkv = TieredKV.around(kv, policy="lru", clock=clock, controller=ControllerConfig(
        high=0.7, low=0.3, min_residency_s=0.0, reload_headroom=0.0))
    for rid, size in sizes.items():
        tkv.add(rid)
        assert kv.allocate(rid, size)
        assert tkv.prepare([rid]) == [rid]
        tkv.after_step([rid])
        kv.check_integrity()
    assert sorted(tkv.requests()) == sorted(kv.requests()) == ["a", "b", "c"]
    tkv.prepare([])  # the offloads land
    offloaded = [rid for rid in "abc" if kv.is_offloaded(rid)]
    assert offloaded, "nothing was offloaded above the watermark"
    assert tkv.stats()["kv.offloads_to_host"] == len(offloaded)
    victim = offloaded[0]
    assert tkv.prepare([victim]) == []  # asked back, not ready yet
    tkv.after_step([], keep=[victim])
    tkv.prepare([])
    assert kv.admit(ResourceStep(victim), StepContext(0)).ok
    assert kv.stats.reloads_from_host == 1  # it came back through a reload, not a recompute
    tkv.remove(victim)
    assert victim not in kv.requests()
    kv.check_integrity()
    tkv.close()
    with pytest.raises(CacheClosed):
        kv.requests()


def test_the_fakes_new_calls_refuse_bad_input_and_change_nothing():
    kv = FakeTieredResource(100, 100, 100)
    kv.ingest_request("a")
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
            kv.allocate("a", bad)
    assert kv.num_tokens("a") == 0 and kv.device_used == 0
    assert kv.allocate("a", 60) and not kv.allocate("a", 101)
    assert kv.device_used == 60
    kv.ingest_request("a")  # idempotent
    with pytest.raises(ValueError, match="different overrides"):
        kv.ingest_request("a", "other")
    with pytest.raises(UnknownRequest, match="'zz'"):
        kv.allocate("zz", 1)
    kv.check_integrity()

