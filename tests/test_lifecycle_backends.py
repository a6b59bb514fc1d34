"""One hypothesis state machine, run against every backend of the shared request lifecycle.

The real cache (``PagedKVCache``, copies on worker threads, a zarr disk tier),
the replay's ``ModeledKVCache`` with instantaneous and with finite links, and
``FakeTieredResource`` all keep their requests in ``tiering.core.lifecycle``.
Each is driven through the same rules and compared, after every step, with a
small independent spec of the lifecycle written here (which state each request
is in, what ``reclaimable`` answers, the bytes per tier and the move counters);
``check_integrity`` runs after every step too. A move stays in flight until the
``settle`` rule completes every copy (the real cache's records change only when
it polls), so every backend must agree on every answer at every step.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import assert_same, random_kv, write_layers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import SimClock
from tiering.core.lifecycle import Counters
from tiering.disk import DiskConfig
from tiering.testing import FakeTieredResource
from tiering.types import IllegalTransition, RequestState, Tier

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2)
PT, PB = GEOM.page_tokens, GEOM.page_bytes
DEVICE, HOST, DISK = 14, 4, 6  # pages per tier
# counters every backend keeps the same way (stall time is clock-dependent)
COMPARED = [f for f in Counters.FIELDS if f != "reload_stall_s_total"]


def pages(tokens: int) -> int:
    return -(-tokens // PT)


def on_a_request(step):
    """A rule on one request the spec holds, drawn by index once any exist:
    ``step(self, rid)``."""

    def rule_body(self, i):
        return step(self, self.pick(i))

    rule_body.__name__ = rule_body.__qualname__ = step.__name__
    rule_body.__doc__ = step.__doc__
    return precondition(lambda self: self.spec.state)(rule(i=st.integers(0, 99))(rule_body))


# -- the backends ---------------------------------------------------------------------------


class RealBackend:
    """``PagedKVCache`` with a disk tier; the data written is checked when it comes back."""

    def __init__(self, to_disk: bool) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="lifecycle-"))
        self.kv = PagedKVCache(
            GEOM, device_pages=DEVICE, host_pages=HOST, verify=True,
            offload_to_disk_when_host_full=to_disk,
            disk=DiskConfig(path=self.tmp / "disk", capacity_bytes=DISK * PB, chunk_bytes=PB),
        )
        self.gen = torch.Generator().manual_seed(7)
        self.data: dict[str, list] = {}

    def grow(self, rid: str, tokens: int) -> bool:
        self.kv.ingest_request(rid)
        ok = self.kv.allocate(rid, tokens)
        if ok:
            d = random_kv(self.gen, GEOM, tokens)
            write_layers(self.kv, rid, d)
            self.data[rid] = d
        return ok

    def settle(self) -> None:
        self.kv.synchronize(10)
        for rid, d in self.data.items():
            if self.kv.state_of(rid) is S.RESIDENT:
                assert_same(self.kv, rid, d)  # what came back is what was written

    def forget(self, rid: str) -> None:
        self.data.pop(rid, None)

    def close(self) -> None:
        self.kv.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class ModelBackend:
    """``ModeledKVCache``; with finite links ``settle`` moves the clock to each completion."""

    def __init__(self, to_disk: bool, rates: LinkRates) -> None:
        self.clock = SimClock()
        self.kv = ModeledKVCache(PB // PT, PT, DEVICE, HOST, DISK, rates, self.clock,
                                 offload_to_disk_when_host_full=to_disk)

    def grow(self, rid: str, tokens: int) -> bool:
        self.kv.ingest_request(rid)
        return self.kv.allocate(rid, tokens)

    def settle(self) -> None:
        while (due := self.kv.next_completion()) is not None:
            self.clock.now = max(self.clock.now, due)
            self.kv.poll()

    def forget(self, rid: str) -> None:
        pass

    def close(self) -> None:
        self.kv.close()


class FakeBackend:
    """``FakeTieredResource`` with transfers in flight until ``poll`` (a page is PB bytes)."""

    def __init__(self, to_disk: bool) -> None:
        self.kv = FakeTieredResource(DEVICE * PB, HOST * PB, DISK * PB, async_transfers=True,
                                     offload_to_disk_when_host_full=to_disk)

    def grow(self, rid: str, tokens: int) -> bool:
        self.kv.ingest_request(rid)
        return self.kv.allocate(rid, pages(tokens) * PB)

    def settle(self) -> None:
        self.kv.poll()

    def forget(self, rid: str) -> None:
        pass

    def close(self) -> None:
        self.kv.close()


BACKENDS = {
    "real": RealBackend,
    "model-instant": lambda to_disk: ModelBackend(to_disk, LinkRates.instant()),
    "model-finite": lambda to_disk: ModelBackend(
        to_disk, LinkRates(3.0 * PB, 2.0 * PB, 1.0 * PB, 1.5 * PB, d2h_latency_s=0.01)),
    "fake": FakeBackend,
}
# the fake answers ``reclaimable`` without asking whether a tier below has room
ROOM_AWARE = {"real", "model-instant", "model-finite"}


# -- the spec -----------------------------------------------------------------------------------

_I = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
_REST = {Tier.DEVICE: S.RESIDENT, Tier.HOST: S.ON_HOST, Tier.DISK: S.ON_DISK}
_MOVES = {  # (source, destination) -> (state in flight, moves counter, bytes counter)
    (Tier.DEVICE, Tier.HOST): (S.OFFLOADING, "offloads_to_host", "bytes_device_to_host"),
    (Tier.DEVICE, Tier.DISK): (S.OFFLOADING, "offloads_to_disk", "bytes_device_to_disk"),
    (Tier.HOST, Tier.DISK): (S.DEMOTING, "demotions", "bytes_host_to_disk"),
    (Tier.HOST, Tier.DEVICE): (S.RELOADING, "reloads_from_host", "bytes_host_to_device"),
    (Tier.DISK, Tier.DEVICE): (S.RELOADING, "reloads_from_disk", "bytes_disk_to_device"),
}


class Spec:
    """What every backend must answer: pages per tier, each request's state, counters."""

    def __init__(self, to_disk: bool) -> None:
        self.to_disk = to_disk
        self.cap = [DEVICE, HOST, DISK]
        self.used = [0, 0, 0]
        self.state: dict[str, RequestState] = {}
        self.pages: dict[str, int] = {}
        self.move: dict[str, tuple[Tier, Tier]] = {}
        self.counts = dict.fromkeys(COMPARED, 0)

    def free(self, tier: Tier) -> int:
        return self.cap[_I[tier]] - self.used[_I[tier]]

    def grow(self, rid: str, n: int) -> bool:
        if n > self.free(Tier.DEVICE):
            return False
        self.used[0] += n
        self.state[rid], self.pages[rid] = S.RESIDENT, n
        return True

    def where_to(self, n: int) -> Tier | None:
        if self.free(Tier.HOST) >= n:
            return Tier.HOST
        if self.to_disk and self.free(Tier.DISK) >= n:
            return Tier.DISK
        return None

    def reclaimable(self, rid: str) -> int:
        n = self.pages[rid]
        ok = self.state[rid] is S.RESIDENT and self.where_to(n) is not None
        return n * PB if ok else 0

    def start(self, rid: str, src: Tier, dst: Tier) -> None:
        self.used[_I[dst]] += self.pages[rid]
        self.move[rid] = (src, dst)
        self.state[rid] = _MOVES[(src, dst)][0]

    def settle(self) -> None:
        for rid, (src, dst) in self.move.items():
            n = self.pages[rid]
            self.used[_I[src]] -= n
            self.state[rid] = _REST[dst]
            _, moves, nbytes = _MOVES[(src, dst)]
            self.counts[moves] += 1
            self.counts[nbytes] += n * PB
        self.move.clear()

    def drop(self, rid: str) -> None:
        tier = {S.ON_HOST: Tier.HOST, S.ON_DISK: Tier.DISK}[self.state[rid]]
        self.used[_I[tier]] -= self.pages[rid]
        self.state[rid] = S.LOST
        self.counts["dropped"] += 1

    def remove(self, rid: str) -> None:
        tier = {S.RESIDENT: Tier.DEVICE, S.ON_HOST: Tier.HOST, S.ON_DISK: Tier.DISK}.get(
            self.state[rid])
        if tier is not None:
            self.used[_I[tier]] -= self.pages[rid]
        del self.state[rid], self.pages[rid]


# -- the machine ---------------------------------------------------------------------------------


class AcrossBackends(RuleBasedStateMachine):
    """Drives one backend and the spec through the same calls (see the module doc)."""

    name = "model-instant"

    def __init__(self) -> None:
        super().__init__()
        self.b = None
        self.n = 0

    @initialize(to_disk=st.booleans())
    def build(self, to_disk):
        self.b = BACKENDS[self.name](to_disk)
        self.kv = self.b.kv
        self.spec = Spec(to_disk)

    def teardown(self):
        if self.b is not None:
            self.b.close()

    def pick(self, i: int) -> str:
        rids = sorted(self.spec.state)
        return rids[i % len(rids)]

    def refused(self, call, rid: str) -> None:
        with pytest.raises(IllegalTransition, match=repr(rid)):
            call(rid)

    @rule(tokens=st.integers(1, 6))
    def add(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        expect = self.spec.grow(rid, pages(tokens))
        assert self.b.grow(rid, tokens) == expect
        if not expect:
            self.kv.remove_request(rid)

    @on_a_request
    def offload(self, rid):
        if self.spec.state[rid] is not S.RESIDENT:
            return self.refused(self.kv.offload, rid)
        n = self.spec.pages[rid]
        dst = self.spec.where_to(n)
        assert self.kv.offload(rid) == (n * PB if dst is not None else 0)
        if dst is None:
            self.spec.counts["offload_refusals"] += 1
        else:
            self.spec.start(rid, Tier.DEVICE, dst)
            assert self.kv.offload_destination(rid) is dst

    @on_a_request
    def demote(self, rid):
        if self.spec.state[rid] is not S.ON_HOST:
            return self.refused(self.kv.demote, rid)
        fits = self.spec.free(Tier.DISK) >= self.spec.pages[rid]
        assert self.kv.demote(rid) == fits
        if fits:
            self.spec.start(rid, Tier.HOST, Tier.DISK)
        else:
            self.spec.counts["demote_refusals_disk_full"] += 1

    @on_a_request
    def reload(self, rid):
        src = {S.ON_HOST: Tier.HOST, S.ON_DISK: Tier.DISK}.get(self.spec.state[rid])
        if src is None:
            return self.refused(self.kv.reload, rid)
        fits = self.spec.free(Tier.DEVICE) >= self.spec.pages[rid]
        assert self.kv.reload(rid) == fits
        if fits:
            self.spec.start(rid, src, Tier.DEVICE)
        else:
            self.spec.counts["reload_refusals"] += 1

    @on_a_request
    def drop(self, rid):
        if self.spec.state[rid] not in (S.ON_HOST, S.ON_DISK):
            return self.refused(self.kv.drop, rid)
        self.kv.drop(rid)
        self.spec.drop(rid)
        assert self.kv.take_lost() == [(rid, "dropped")]

    @precondition(lambda self: self.spec.state)
    @rule(i=st.integers(0, 99))
    def remove(self, i):
        self.settle()  # a removed copy in flight gives its pages back at different times
        rid = self.pick(i)
        self.kv.remove_request(rid)
        self.spec.remove(rid)
        self.b.forget(rid)

    @rule()
    def settle(self):
        self.b.settle()
        self.spec.settle()
        for rid, state in self.spec.state.items():
            ok = self.kv.admit(ResourceStep(rid), StepContext(0)).ok
            assert ok == (state is S.RESIDENT), (rid, state)

    @invariant()
    def integrity(self):
        if self.b is not None:
            self.kv.check_integrity()

    @invariant()
    def same_answers(self):
        if self.b is None:
            return
        kv, spec = self.kv, self.spec
        assert sorted(kv.requests()) == sorted(spec.state)
        for rid, state in spec.state.items():
            assert kv.state_of(rid) is state, (rid, kv.state_of(rid), state)
            assert kv.tier_of(rid) is state.tier
            assert kv.is_offloaded(rid) == (state in (S.ON_HOST, S.DEMOTING, S.ON_DISK))
            want = spec.reclaimable(rid)
            if self.name in ROOM_AWARE or want or state is not S.RESIDENT:
                assert kv.reclaimable(rid) == want, (rid, state)
        used = (kv.device_used_bytes(), kv.host_used_bytes(), kv.disk_used_bytes())
        assert used == tuple(p * PB for p in spec.used)
        got = kv.stats.as_dict()
        assert {f: got[f] for f in COMPARED} == spec.counts


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_follows_the_one_lifecycle(backend):
    machine = type(f"AcrossBackends_{backend}", (AcrossBackends,), {"name": backend})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=100 if backend == "real" else 150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
