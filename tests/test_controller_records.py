"""The controller settles its in-flight ledger from the ``TransferResult`` records of ``poll()``.

Each test drives a fake whose state-query hooks lie about transfers (they keep
saying "still in flight"), so only the records can tell the controller that a
transfer finished or failed; the same fake whose ``poll()`` loses its records
(``Mute``) is the negative control that must not settle.
"""

from __future__ import annotations

import random

import pytest
from conftest import ReclaimsNothing
from tiering.policies import make_policy

from tiering.control.controller import ControllerConfig, EvictionController
from tiering.testing import ExactPressure, FakeClock, FakeTieredResource, ScriptedFraction
from tiering.types import Move, RequestState, Tier, TransferResult

S = RequestState


class Stale(ReclaimsNothing, FakeTieredResource):
    """The fake whose ``tier_of`` and ``can_reload`` answer as of the moment a transfer
    started, until the test says otherwise: only ``poll()``'s records are current."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.frozen: dict[str, RequestState] = {}

    def _move(self, rid, in_flight, dest):
        self.frozen[rid] = in_flight
        super()._move(rid, in_flight, dest)

    def tier_of(self, rid):
        state = self.frozen.get(rid, self.state[rid])
        return state.tier

    def can_reload(self, rid):
        return self.frozen.get(rid, self.state[rid]) in (S.ON_HOST, S.ON_DISK)

    def holds_nothing(self, rid):
        return rid in self.frozen


class Mute(Stale):
    """The negative control: ``poll()`` applies completions but loses their records."""

    def poll(self):
        super().poll()
        return []


def _world(records: bool, seed: int = 1, **kwargs):
    rng = random.Random(seed)
    clock = FakeClock()
    res = (Stale if records else Mute)(100_000, 1 << 30, 1 << 30, async_transfers=True,
                                       complete_on_poll=False, **kwargs)
    ctl = EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res),
                             ControllerConfig(high=0.8, low=0.5), clock=clock)
    rids = []
    for i in range(12):
        rid = f"r{i:02d}"
        res.add(rid, rng.randint(7_000, 8_000))
        ctl.add_request(rid)
        clock.advance(0.1)
        rids.append(rid)
    clock.advance(5.0)
    return res, ctl, clock, rids


@pytest.mark.parametrize("records", [True, False])
def test_completed_offloads_are_settled_from_the_records(records):
    res, ctl, clock, rids = _world(records)
    report = ctl.evict_if_needed(())
    assert report.offloaded
    assert ctl.stats()["offloads_in_flight"] == len(report.offloaded)
    res.complete_transfers()
    ctl.evict_if_needed(())
    ctl.check_integrity()
    res.check_integrity()
    stats = ctl.stats()
    if records:
        assert stats["offloads_in_flight"] == 0
        assert stats["transfers_reported"] == len(report.offloaded)
    else:  # the control: without the records nothing settles (the hooks are stale)
        assert stats["offloads_in_flight"] == len(report.offloaded)
        assert stats["transfers_reported"] == 0


@pytest.mark.parametrize("records", [True, False])
def test_a_failed_offload_record_makes_the_request_a_candidate_again(records):
    res, ctl, clock, rids = _world(records)
    first = ctl.evict_if_needed(())
    failed = first.offloaded[0]
    res.fail_transfer(failed)
    res.frozen.pop(failed)  # it is resident and reclaimable again, as the record says
    ctl.evict_if_needed(())
    in_flight = ctl.stats()["offloads_in_flight"]
    # with the record it left the ledger; without it, it is still counted as leaving
    assert in_flight == len(first.offloaded) - (1 if records else 0)
    ctl.check_integrity()


@pytest.mark.parametrize("records", [True, False])
def test_a_completed_demotion_is_settled_from_its_record(records):
    clock = FakeClock()
    res = (Stale if records else Mute)(1_000_000, 100_000, 1 << 30, async_transfers=True,
                                       complete_on_poll=False)
    ctl = EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res),
                             ControllerConfig(host_high=0.9, host_low=0.7), clock=clock)
    rng = random.Random(3)
    while res.host_used < 0.95 * 100_000:
        rid = f"h{len(res.state):02d}"
        res.add(rid, min(rng.randint(2_000, 6_000), 100_000 - res.host_used), Tier.HOST)
        ctl.add_request(rid)
        clock.advance(0.1)
    report = ctl.evict_if_needed(())
    assert report.demoted
    assert ctl.stats()["demotions_in_flight"] == len(report.demoted)
    res.complete_transfers()
    ctl.evict_if_needed(())
    expected = 0 if records else len(report.demoted)
    assert ctl.stats()["demotions_in_flight"] == expected
    ctl.check_integrity()
    res.check_integrity()


def test_a_record_of_a_removed_request_changes_nothing():
    res, ctl, clock, rids = _world(True)
    report = ctl.evict_if_needed(())
    gone = report.offloaded[0]
    res.remove(gone)  # its copy was in flight: the next poll reports state None
    ctl.remove_request(gone)
    ctl.evict_if_needed(())
    assert ctl.stats()["offloads_in_flight"] == len(report.offloaded) - 1
    ctl.check_integrity()
    res.check_integrity()


def test_the_fake_reports_one_record_per_transfer():
    res = FakeTieredResource(100_000, 100_000, 100_000, async_transfers=True,
                             complete_on_poll=False)
    res.add("a", 4_000)
    res.add("b", 5_000, Tier.HOST)
    res.add("c", 6_000, Tier.HOST)
    assert res.offload("a") == 4_000
    assert res.demote("b")
    assert res.reload("c")
    res.fail_transfer("b", "disk write failed")
    res.complete_transfers(["a", "c"])
    got = sorted(res.poll(), key=lambda r: r.rid)
    assert got == [
        TransferResult("a", Move.OFFLOAD_TO_HOST, True, 4_000, S.ON_HOST),
        TransferResult("b", Move.DEMOTE, False, 5_000, S.ON_HOST, "disk write failed"),
        TransferResult("c", Move.RELOAD_FROM_HOST, True, 6_000, S.RESIDENT),
    ]
    assert res.poll() == []  # each reported once
    res.check_integrity()


def test_a_resource_reporting_something_else_is_refused_by_name():
    class Garbled(FakeTieredResource):
        def poll(self):
            super().poll()
            return [("r", "done")]

    res = Garbled(100_000, 1 << 30, 1 << 30)
    ctl = EvictionController({"kv": res}, make_policy("lru"), ScriptedFraction(0.1),
                             ControllerConfig())
    with pytest.raises(TypeError, match="'kv'.*TransferResult"):
        ctl.evict_if_needed(())


def test_check_integrity_catches_each_kind_of_corruption():
    res, ctl, clock, rids = _world(True)
    ctl.evict_if_needed(())
    res.add("filler", 100_000 - res.device_used)
    ctl.add_request("filler")
    offloaded = [r for r in rids if res.state[r] is not S.RESIDENT]
    res.complete_transfers()
    ctl.evict_if_needed(())
    assert ctl.request_reload(offloaded[0]) is False
    ctl.check_integrity()  # control: the healthy controller passes

    table = ctl._table
    slot = table.slot[rids[-1]]
    table.member["kv"][slot] = False
    with pytest.raises(AssertionError, match="membership"):
        ctl.check_integrity()
    table.member["kv"][slot] = True

    ledger = ctl._ledger
    ledger._releasing += 1
    with pytest.raises(AssertionError, match="releasing"):
        ctl.check_integrity()
    ledger._releasing -= 1

    heap = ctl._admission.queue._heap
    stranded = heap.pop()
    with pytest.raises(AssertionError, match="missing from the heap"):
        ctl.check_integrity()
    heap.append(stranded)

    table.mark_reload(rids[-1], clock())
    table.exempt -= 1
    with pytest.raises(AssertionError, match="exemptions"):
        ctl.check_integrity()
    table.exempt += 1
    ctl.check_integrity()


def test_a_worker_polls_through_the_controller_and_nothing_is_lost():
    res, ctl, clock, rids = _world(True)
    report = ctl.evict_if_needed(())
    res.complete_transfers()
    ctl.poll()  # the worker applies completions early in its step
    assert ctl.stats()["offloads_in_flight"] == 0
    assert ctl.stats()["transfers_reported"] == len(report.offloaded)
    ctl.evict_if_needed(())
    ctl.check_integrity()
    # the hazard it avoids: records taken by a direct poll() never reach the ledger
    other, octl, _, _ = _world(True)
    report = octl.evict_if_needed(())
    other.complete_transfers()
    assert len(other.poll()) == len(report.offloaded)
    octl.evict_if_needed(())
    assert octl.stats()["offloads_in_flight"] == len(report.offloaded)


@pytest.mark.parametrize("answer", [3, None, "done"])
def test_a_poll_that_does_not_answer_with_records_is_refused_by_name(answer):
    """One path settles the ledger: a count (or nothing) from an evicting resource is a
    broken contract, named, not a cue to guess from the other hooks."""
    class Counting(FakeTieredResource):
        def poll(self):
            super().poll()
            return answer

    res = Counting(100_000, 1 << 30, 0, async_transfers=True)
    ctl = EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res),
                             ControllerConfig(high=0.8, low=0.5), clock=FakeClock())
    res.add("a", 90_000)
    ctl.add_request("a")
    with pytest.raises(TypeError, match="resource 'kv': poll\\(\\) returned"):
        ctl.poll()
    res.check_integrity()
    ctl.check_integrity()


def test_an_evicting_resource_without_poll_offloads_synchronously():
    """Without poll() nothing could ever settle an offload in flight: such a resource's
    offload is done when it returns, so the bytes are released (waiting only for a fresh
    sample), never stuck "in flight"; and it takes no part in the cascade."""
    class NoPoll(FakeTieredResource):
        poll = None

    rng = random.Random(5)
    clock = FakeClock()
    res = NoPoll(100_000, 1 << 30, 1 << 30)  # synchronous transfers
    ctl = EvictionController({"kv": res}, make_policy("lru"), ExactPressure(res),
                             ControllerConfig(high=0.8, low=0.5), clock=clock)
    for i in range(10):
        res.add(f"r{i}", rng.randint(8_000, 9_000))
        ctl.add_request(f"r{i}")
        clock.advance(0.1)
    clock.advance(5.0)
    report = ctl.evict_if_needed(())
    assert report.offloaded and all(res.state[r] is S.ON_HOST for r in report.offloaded)
    stats = ctl.stats()
    assert stats["offloads_in_flight"] == 0 and stats["transfers_reported"] == 0
    assert res.calls["demote"] == 0
    ctl.check_integrity()
    res.check_integrity()
