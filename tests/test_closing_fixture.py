"""The ``closing`` fixture (``closing_scope``) that closes what a test built: order, errors,
a gate opened before the close it unblocks, and a real cache closed at the end."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_same, cache_factory, closing_scope, fill
from tiering.resources.kv_cache import PagedKVCache

from tiering.errors import CacheClosed


class Recorder:
    """Records its close in a shared log; ``fail`` makes the close raise after recording."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise OSError(f"close of {self.name} failed")


def test_it_returns_what_it_closes_and_closes_last_in_first_out():
    log: list[str] = []
    with closing_scope() as closing:
        a = Recorder("a", log)
        assert closing(a) is a
        closing(Recorder("b", log))
        closing.call(log.append, "call")
        assert log == []  # nothing is closed before the scope ends
    assert log == ["call", "b", "a"]


@pytest.mark.parametrize("where", ["in_a_close", "in_the_test"])
def test_an_error_is_raised_at_the_end_and_everything_is_still_closed(where):
    """A close that raises does not stop the others; neither does the test's own error."""
    log: list[str] = []
    error, match = (OSError, "close of b failed") if where == "in_a_close" else (KeyError, "test failed")
    with pytest.raises(error, match=match):
        with closing_scope() as closing:
            closing(Recorder("a", log))
            closing(Recorder("b", log, fail=where == "in_a_close"))
            closing(Recorder("c", log))
            if where == "in_the_test":
                raise KeyError("the test failed")
    assert log == ["c", "b", "a"]


class NeedsGate:
    """A resource whose close needs ``gate`` open first (as a cache whose copy waits on it)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def close(self) -> None:
        if not self.gate.is_set():
            raise RuntimeError("closed while its copy still waits on the gate")


def test_a_gate_registered_after_the_resource_is_opened_before_its_close():
    gate = threading.Event()
    with closing_scope() as closing:
        closing(NeedsGate(gate))
        closing.call(gate.set)
    assert gate.is_set()
    # negative control: registered the other way round, the close comes first and fails
    with pytest.raises(RuntimeError, match="still waits"):
        with closing_scope() as closing:
            closing.call(threading.Event().set)
            closing(NeedsGate(threading.Event()))


def test_a_real_cache_with_a_held_copy_is_closed_at_the_end_and_a_second_close_is_harmless(geom):
    release, entered = threading.Event(), threading.Event()

    def hold(kind):
        entered.set()
        assert release.wait(10)

    with closing_scope() as closing:
        kv = closing(PagedKVCache(geom, device_pages=8, host_pages=8, copy_fault_hook=hold))
        closing.call(release.set)
        fill(kv, "a", torch.Generator().manual_seed(71), 9)
        assert kv.offload("a") and entered.wait(10)  # the copy is held at the gate
        kv.check_integrity()
        assert kv.in_flight() == 1
    assert release.is_set()
    with pytest.raises(CacheClosed):
        kv.poll()
    kv.close()  # what a test that closes mid-test does before the fixture's close: harmless
    # a cache closed in the middle of a scope is closed again at its end without an error
    with closing_scope() as closing:
        kv2 = closing(PagedKVCache(geom, device_pages=8, host_pages=8))
        fill(kv2, "b", torch.Generator().manual_seed(72), 5)
        kv2.check_integrity()
        kv2.close()
    with pytest.raises(CacheClosed):
        kv2.poll()


def test_the_kv_factory_closes_every_cache_it_made(geom):
    with closing_scope() as closing:
        make = cache_factory(geom, closing)
        first = make(device_pages=4, host_pages=4)
        other = make(geometry=make.geometry, device_pages=8, host_pages=8)
        assert make.made == [first, other] and first is not other
        data = fill(other, "r", torch.Generator().manual_seed(73), 6)
        other.check_integrity()
        assert_same(other, "r", data)
        first.poll()  # open until the scope ends
    for cache in (first, other):
        with pytest.raises(CacheClosed):
            cache.poll()
