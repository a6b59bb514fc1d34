"""Shared fixtures: small geometries, seeded random KV, a cache factory, and the cuda marker."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.types import RequestState, Tier


def _cuda_ok() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # torch raises mixed types without a driver
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def geom() -> KVGeometry:
    return KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.bfloat16)


@contextlib.contextmanager
def closing_scope():
    """What the ``closing`` fixture yields, usable alone: ``close_at_end(obj)`` returns ``obj``
    and calls ``obj.close()`` when the scope ends; ``close_at_end.call(fn, *args)`` calls
    ``fn`` then. They run last in, first out, each even when an earlier one raised; an error
    raised by any of them is raised when the scope ends."""
    with contextlib.ExitStack() as stack:

        def close_at_end(obj):
            stack.callback(obj.close)
            return obj

        close_at_end.call = stack.callback
        yield close_at_end


@pytest.fixture
def closing():
    """Closes what a test built, whatever the test did: ``closing(obj)`` returns ``obj`` and
    calls ``obj.close()`` at the end of the test; ``closing.call(fn, *args)`` calls ``fn`` then.

    Last in, first out (see ``closing_scope``): register a gate's ``set`` after the cache
    whose copies wait on it, and the gate is opened before the cache is closed. A test that
    must close mid-test (it checks what a close does, or restarts on the same directory)
    closes explicitly; the second close at the end must then be harmless, as it is for every
    cache of this project.
    """
    with closing_scope() as close_at_end:
        yield close_at_end


def cache_factory(geom: KVGeometry, closing):
    """What the ``kv`` fixture returns: ``make(geometry=None, **kwargs)`` builds a
    ``PagedKVCache`` (on ``geom`` unless told) that ``closing`` closes at its end."""
    made: list[PagedKVCache] = []

    def make(geometry: KVGeometry | None = None, **kwargs) -> PagedKVCache:
        cache = closing(PagedKVCache(geom if geometry is None else geometry, **kwargs))
        made.append(cache)
        return cache

    make.geometry = geom  # the default geometry
    make.made = made  # every cache made so far
    return make


@pytest.fixture
def kv(geom, closing):
    """A factory of ``PagedKVCache``: ``kv(device_pages=4, host_pages=8, ...)``.

    The geometry defaults to the ``geom`` fixture (``kv.geometry``; pass
    ``geometry=`` for another). Every cache it made is closed at the end of the test (by
    ``closing``), whatever the test did (closing twice is harmless), so no test needs
    ``try/finally: kv.close()``.
    """
    return cache_factory(geom, closing)


def random_kv(gen: torch.Generator, geometry: KVGeometry, tokens: int):
    """Random K and V for every layer: list of (k, v) shaped [tokens, heads, dim]."""
    shape = (tokens, geometry.num_kv_heads, geometry.head_dim)
    return [
        (
            torch.randn(shape, generator=gen).to(geometry.dtype),
            torch.randn(shape, generator=gen).to(geometry.dtype),
        )
        for _ in range(geometry.num_layers)
    ]


def write_layers(kv, rid: str, data, start: int = 0) -> None:
    """Write ``data`` (a (k, v) pair per layer) into ``rid`` from token ``start``."""
    for layer, (k, v) in enumerate(data):
        kv.write(rid, layer, start, k, v)


def fill(kv, rid: str, gen: torch.Generator, tokens: int):
    """Ingest, allocate and write random KV for ``rid``; returns what was written."""
    kv.ingest_request(rid, None)
    assert kv.allocate(rid, tokens)
    data = random_kv(gen, kv.geometry, tokens)
    write_layers(kv, rid, data)
    return data


def assert_same(kv, rid: str, data) -> None:
    for layer, (k, v) in enumerate(data):
        k2, v2 = kv.read(rid, layer)
        assert torch.equal(k2, k), f"{rid} layer {layer}: K differs"
        assert torch.equal(v2, v), f"{rid} layer {layer}: V differs"


def write_random(kv, rid: str, gen: torch.Generator, n: int, start: int = 0):
    """Allocate ``n`` tokens from ``start`` (the request exists) and write random K/V into
    every layer there; checks integrity and returns what was written."""
    assert kv.allocate(rid, start + n)
    data = random_kv(gen, kv.geometry, n)
    write_layers(kv, rid, data, start)
    kv.check_integrity()
    return data


def assert_leading(kv, rid: str, want, ntok: int) -> None:
    """The first ``ntok`` tokens of ``rid`` hold ``want`` bit for bit in every layer."""
    for layer, (k, v) in enumerate(want):
        gk, gv = kv.read(rid, layer)
        assert torch.equal(gk[:ntok], k[:ntok]), f"{rid} layer {layer}: K differs"
        assert torch.equal(gv[:ntok], v[:ntok]), f"{rid} layer {layer}: V differs"


def offload_resident(kv, rid: str) -> None:
    """Offload a RESIDENT request: it frees what ``reclaimable`` promised and is then
    OFFLOADING (still RESIDENT when nothing was reclaimable)."""
    expect = kv.reclaimable(rid)
    assert kv.offload(rid) == expect
    assert kv.state_of(rid) is (RequestState.OFFLOADING if expect else RequestState.RESIDENT)


def reload_all_and_check(kv, data) -> None:
    """Reload every request of ``data`` (all offloaded), checking integrity
    throughout, and compare their KV bit for bit."""
    for rid in data:
        assert kv.reload(rid)
        kv.check_integrity()
    kv.synchronize(10)
    kv.check_integrity()
    for rid, d in data.items():
        assert kv.tier_of(rid) is Tier.DEVICE
        assert_same(kv, rid, d)


class ReclaimsNothing:
    """A mixin for a ``FakeTieredResource`` subclass: requests for which ``holds_nothing``
    says True answer 0 to ``reclaimable`` and ``reclaimable_many``, whatever they hold."""

    def holds_nothing(self, rid: str) -> bool:
        raise NotImplementedError

    def reclaimable(self, rid: str) -> int:
        return 0 if self.holds_nothing(rid) else super().reclaimable(rid)

    def reclaimable_many(self, rids):
        out = super().reclaimable_many(rids)
        out[[i for i, r in enumerate(rids) if self.holds_nothing(r)]] = 0
        return out


def rule_on_one_of(pool):
    """Make ``step(self, rid)`` a hypothesis rule on one id drawn from ``pool(self)`` (a
    sequence, drawn in its order), enabled while the pool is not empty. (hypothesis is
    imported here: the vLLM environment loads this conftest without it.)"""
    from hypothesis import strategies as st
    from hypothesis.stateful import precondition, rule

    def decorate(step):
        def rule_body(self, data):
            return step(self, data.draw(st.sampled_from(pool(self))))

        rule_body.__name__ = rule_body.__qualname__ = step.__name__
        rule_body.__doc__ = step.__doc__
        return precondition(lambda self: bool(pool(self)))(rule(data=st.data())(rule_body))

    return decorate


def disk_lock_held(root) -> bool:
    """Whether some open file description holds the disk tier's lock on ``root`` now."""
    import fcntl
    import os

    from tiering.disk.lock import LOCK_FILE_NAME

    path = root / LOCK_FILE_NAME
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def conversation_trace(seed: int, n: int, *, shared: float = 0.5):
    """A seeded replay trace: conversations that extend each other's block chains
    (64-token blocks), some unrelated requests."""
    import random

    from tiering.apps.replay.traces import TraceRequest

    rng = random.Random(seed)
    chains: list[list[int]] = []
    next_id = 1
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(4.0)
        if chains and rng.random() < shared:
            base = rng.choice(chains)
            extra = [next_id + i for i in range(rng.randint(1, 6))]
            chain = base + extra
        else:
            extra = [next_id + i for i in range(rng.randint(2, 20))]
            chain = [0] + extra
        next_id += len(extra)
        chains.append(chain)
        n_in = len(chain) * 64 - rng.randint(0, 63)
        out.append(TraceRequest(t, n_in, rng.randint(1, 120), tuple(chain)))
    return out
