"""Layer-wise reload: a request reloading from host is admitted once layer 0 is on the
device, each layer is read only after it landed, and a fault on a middle layer sends
the request back to the host with nothing of it lost or changed."""

from __future__ import annotations

import threading

import pytest
import torch
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.errors import IllegalTransition, LayerNotReady, PoolIntegrityError
from tiering.types import Move, RequestState

S = RequestState
GEOM = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32)


class LayerGate:
    """A copy fault hook that holds (or fails) the host-to-device copy of one layer.

    Each layer of a one-run reload calls the hook once, in order, so the n-th
    ``h2d`` call is layer n."""

    def __init__(self, hold: int | None = None, fail: int | None = None) -> None:
        self.hold, self.fail = hold, fail
        self.calls = 0
        self.release = threading.Event()
        self.reached = threading.Event()

    def __call__(self, kind: str) -> None:
        if kind != "h2d":
            return
        layer = self.calls
        self.calls += 1
        if layer == self.hold:
            self.reached.set()
            assert self.release.wait(10), "the test never released the held layer"
        if layer == self.fail:
            raise OSError(5, f"injected fault on layer {layer}")


def make(gate=None, layerwise=True, **kw) -> PagedKVCache:
    return PagedKVCache(GEOM, device_pages=16, host_pages=16, layerwise_reload=layerwise,
                        copy_fault_hook=gate or (lambda kind: None), **kw)


def fill(kv: PagedKVCache, rid: str, tokens: int, seed: int,
         ingest: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    if ingest:
        kv.ingest_request(rid)
    assert kv.allocate(rid, tokens)
    out = []
    for layer in range(GEOM.num_layers):
        k = torch.randn(tokens, 2, 8, generator=gen)
        v = torch.randn(tokens, 2, 8, generator=gen)
        kv.write(rid, layer, 0, k, v)
        out.append((k, v))
    return out


def offload(kv: PagedKVCache, rid: str) -> None:
    assert kv.offload(rid) > 0
    kv.synchronize()
    assert kv.state_of(rid) is S.ON_HOST
    kv.check_integrity()


def held_reload(kv: PagedKVCache, gate: LayerGate, tokens: int, seed: int):
    """Fill request "a" with ``tokens`` random tokens, offload it and start its reload,
    returning once the gate holds its copy (what was written)."""
    want = fill(kv, "a", tokens, seed=seed)
    offload(kv, "a")
    gate.calls = 0
    assert kv.reload("a")
    assert gate.reached.wait(10)
    return want


def admitted(kv: PagedKVCache, rid: str) -> bool:
    return kv.admit(ResourceStep(rid), StepContext(0)).ok


def same(kv, rid, want, layers=range(GEOM.num_layers)):
    """The first tokens of each layer are the ones written (a grown request has more)."""
    for layer in layers:
        k, v = kv.read(rid, layer)
        n = want[layer][0].shape[0]
        assert torch.equal(k[:n], want[layer][0]) and torch.equal(v[:n], want[layer][1]), layer


def test_admitted_from_layer_zero_and_each_layer_read_once_landed():
    gate = LayerGate(hold=2)
    with make(gate) as kv:
        want = held_reload(kv, gate, 13, seed=1)  # layers 0 and 1 landed, layer 2 is held
        assert kv.state_of("a") is S.RELOADING
        assert admitted(kv, "a")  # ready from layer 0
        kv.check_integrity()
        same(kv, "a", want, layers=[0, 1])
        assert not kv.wait_layer("a", 2, timeout=0.05)  # still copying
        assert not kv.wait_layer("a", 3, timeout=0.0)
        with pytest.raises(IllegalTransition, match="name the layer"):
            kv._data.readable("a", "read")  # a whole-request read needs every layer
        gate.release.set()
        assert kv.wait_layer("a", 3, timeout=10)
        same(kv, "a", want)
        done = kv.synchronize()
        assert [(r.rid, r.move, r.ok) for r in done] == [("a", Move.RELOAD_FROM_HOST, True)]
        assert kv.state_of("a") is S.RESIDENT
        assert kv.stats.reloads_admitted_early == 1
        kv.check_integrity()


def test_whole_request_reload_is_not_admitted_before_it_lands():
    """The negative control: without layer-wise reload the held copy keeps the step out."""
    gate = LayerGate(hold=0)
    with make(gate, layerwise=False) as kv:
        want = held_reload(kv, gate, 13, seed=2)
        assert not admitted(kv, "a")
        assert not kv.wait_layer("a", 0, timeout=0.05)
        gate.release.set()
        kv.synchronize()
        assert admitted(kv, "a")
        same(kv, "a", want)
        assert kv.stats.reloads_admitted_early == 0
        kv.check_integrity()


def test_a_fault_on_a_middle_layer_fails_the_reload_from_there_and_keeps_the_host_copy():
    gate = LayerGate(hold=1, fail=2)
    with make(gate) as kv:
        want = held_reload(kv, gate, 10, seed=3)
        assert admitted(kv, "a")
        same(kv, "a", want, layers=[0])
        gate.release.set()
        assert not kv.wait_layer("a", 2, timeout=10)  # never readable
        with pytest.raises((LayerNotReady, IllegalTransition)):
            kv.read("a", 2)
        done = kv.synchronize()
        res = [r for r in done if r.rid == "a"]
        assert len(res) == 1 and not res[0].ok and "injected fault on layer 2" in res[0].reason
        assert kv.state_of("a") is S.ON_HOST
        assert not admitted(kv, "a")
        kv.check_integrity()
        gate.fail = None  # the host copy is intact: the next reload brings every layer
        assert kv.reload("a")
        kv.synchronize()
        same(kv, "a", want)
        kv.check_integrity()


def test_a_failed_reload_gives_back_what_the_early_step_added():
    gate = LayerGate(hold=1, fail=3)
    with make(gate) as kv:
        want = held_reload(kv, gate, 8, seed=4)  # two full pages: growing takes a new page
        assert admitted(kv, "a")
        assert kv.allocate("a", 11)  # the early step's new tokens
        k = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(9))
        kv.write("a", 0, 8, k, k + 1)
        kv.check_integrity()
        gate.release.set()
        kv.synchronize()
        assert kv.state_of("a") is S.ON_HOST and kv.num_tokens("a") == 8
        assert kv.stats.reloads_undone == 1
        kv.check_integrity()
        gate.fail = None
        assert kv.reload("a")
        kv.synchronize()
        same(kv, "a", want)
        assert kv.allocate("a", 11)  # grows again from the reloaded 8 tokens
        kv.check_integrity()


def test_removed_during_a_layerwise_reload():
    gate = LayerGate(hold=1)
    with make(gate) as kv:
        held_reload(kv, gate, 9, seed=5)
        assert admitted(kv, "a")
        kv.remove_request("a")
        kv.check_integrity()
        assert kv.device_pool.used_pages > 0  # the copy still writes them
        gate.release.set()
        kv.synchronize()
        assert kv.device_pool.used_pages == 0 and kv.host_pool.used_pages == 0
        kv.check_integrity()
        want = fill(kv, "a", 5, seed=6)  # the id behaves like a new one
        same(kv, "a", want)


def test_disk_reloads_land_every_layer_at_once(tmp_path):
    from tiering.disk.config import DiskConfig

    gate = LayerGate()
    disk = DiskConfig(path=str(tmp_path / "d"), capacity_bytes=64 * GEOM.page_bytes)
    with PagedKVCache(GEOM, device_pages=16, host_pages=1, layerwise_reload=True, disk=disk,
                      copy_fault_hook=gate) as kv:
        want = fill(kv, "a", 9, seed=7)
        assert kv.offload("a") > 0
        kv.synchronize()
        assert kv.state_of("a") is S.ON_DISK
        assert kv.reload("a")
        kv.synchronize()
        assert kv.stats.reloads_admitted_early == 0
        same(kv, "a", want)
        kv.check_integrity()


def test_bad_input_names_what_was_wrong():
    with pytest.raises(ValueError, match="layerwise_reload"):
        PagedKVCache(GEOM, layerwise_reload="yes")
    with pytest.raises(ValueError, match="layer_wait_timeout_s"):
        PagedKVCache(GEOM, layer_wait_timeout_s=-1)
    with make() as kv:
        fill(kv, "a", 4, seed=8)
        with pytest.raises(ValueError, match="layer 4 out of range"):
            kv.wait_layer("a", 4)
        with pytest.raises(ValueError, match="timeout"):
            kv.wait_layer("a", 0, timeout=float("nan"))
        assert kv.wait_layer("a", 3)  # resident: every layer at once


def test_through_the_front_door_an_early_step_runs_while_later_layers_copy():
    """TieredKV: ready() says READY from layer 0, the step runs and grows the request,
    after_step() and the controller take it, and the landing is settled like any other."""
    from tiering import TieredKV, TieredKVConfig
    from tiering.tiered import Readiness

    gate = LayerGate(hold=2)
    cfg = TieredKVConfig(geometry=GEOM, device_pages=16, host_pages=16,
                         cache_options={"layerwise_reload": True, "copy_fault_hook": gate})
    with TieredKV(cfg) as tkv:
        kv = tkv.kv
        tkv.add("a")
        want = fill(kv, "a", 13, seed=11, ingest=False)
        offload(kv, "a")
        gate.calls = 0
        assert tkv.ready("a") is Readiness.ASKED_BACK
        tkv.poll()  # the controller starts the reload
        assert gate.reached.wait(10)
        assert tkv.ready("a") is Readiness.READY  # layer 0 and 1 landed, 2 is held
        assert kv.allocate("a", 14)
        same(kv, "a", want, layers=[0, 1])
        tkv.after_step(["a"])
        tkv.check_integrity()
        gate.release.set()
        same(kv, "a", want)
        tkv.synchronize()
        tkv.check_integrity()
        assert kv.state_of("a") is S.RESIDENT and kv.num_tokens("a") == 14
        assert tkv.stats()["kv.reloads_admitted_early"] == 1



def test_a_host_copy_that_fails_its_checksum_is_never_admitted_early():
    """verify=True: the host copy is checked before layer 0 lands, so a changed byte makes
    the request lost without any layer of it having been readable."""
    with make(verify=True) as kv:
        fill(kv, "a", 12, seed=12)
        offload(kv, "a")
        kv._host[kv._reqs["a"].host[1], 3, 1, 0, 0, 0] += 1.0  # one value of one host page
        assert kv.reload("a")
        assert not kv.wait_layer("a", 0, timeout=10)
        assert not admitted(kv, "a")
        done = kv.synchronize()
        assert [r.ok for r in done if r.rid == "a"] == [False]
        assert kv.state_of("a") is S.LOST and "checksum" in kv.lost_reason("a")
        assert kv.stats.reloads_admitted_early == 0
        kv.check_integrity()


def test_a_step_whose_reload_failed_meets_layer_not_ready_even_once_the_failure_is_applied():
    """The failed copy may be applied (by a poll) before the step reaches its next layer:
    every later read, write and wait of that step still says LayerNotReady / False, never
    "must be resident" (what a worker catches to run the step again later)."""
    gate = LayerGate(hold=1, fail=1)
    with make(gate) as kv:
        held_reload(kv, gate, 10, seed=13)
        assert admitted(kv, "a")
        kv.read("a", 0)  # the step computes layer 0
        gate.release.set()
        kv.synchronize()  # the failure is applied: back on the host
        assert kv.state_of("a") is S.ON_HOST
        with pytest.raises(LayerNotReady, match="cannot go on"):
            kv.read("a", 1)
        with pytest.raises(LayerNotReady, match="cannot go on"):
            kv.write("a", 1, 9, torch.randn(1, 2, 8), torch.randn(1, 2, 8))
        assert not kv.wait_layer("a", 1, timeout=0)
        kv.check_integrity()
        assert not admitted(kv, "a")  # a new step: the request is simply offloaded
        with pytest.raises(IllegalTransition, match="must be resident"):
            kv.read("a", 1)


def test_a_refused_reload_leaves_the_cut_short_step_as_it_was():
    """A reload refused for device room changes nothing: the step its failed reload cut
    short still meets LayerNotReady; a reload that starts ends that step."""
    gate = LayerGate(hold=1, fail=1)
    with make(gate) as kv:
        want = held_reload(kv, gate, 10, seed=14)
        assert admitted(kv, "a")
        gate.release.set()
        kv.synchronize()  # the failure is applied: back on the host
        kv.ingest_request("b")
        assert kv.allocate("b", kv.device_pool.free_pages * GEOM.page_tokens)  # the device full
        assert kv.reload("a") is False
        with pytest.raises(LayerNotReady, match="cannot go on"):
            kv.read("a", 1)
        kv.check_integrity()
        kv.remove_request("b")  # the control: with room the reload starts, the step is over
        gate.fail = None
        assert kv.reload("a")
        kv.synchronize()
        same(kv, "a", want)
        kv.check_integrity()


def test_check_integrity_refuses_a_cut_short_step_on_a_resident_request():
    with make() as kv:
        fill(kv, "a", 10, seed=15)
        kv.check_integrity()
        kv._reqs["a"].undone = "its copy failed"  # only a failed reload may set it
        with pytest.raises(PoolIntegrityError, match="cut short by a failed reload while resident"):
            kv.check_integrity()
