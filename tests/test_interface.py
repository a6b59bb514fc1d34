"""Our Resource interface carries every method of the engine's, with the same
parameters and defaults. Checked against the seed file when it is beside the
repository, and always against the list of eviction hooks."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import resources.base as base
from resources.kv_cache import PagedKVCache

SEED_DIR = Path(__file__).resolve().parents[2] / "shared" / "seeds"

# The seed's text lost its indentation; these are its module-level functions.
MODULE_FUNCTIONS = {"build_resource"}

EVICTION_HOOKS = {
    "supports_eviction", "is_offloaded", "offload", "reload", "can_reload",
    "reclaimable", "get_offload_priority",
}


def seed_methods() -> dict[tuple[str, str], tuple[list[str], list[str]]]:
    """(class, method) -> (parameter names, default sources) parsed from the seed."""
    files = sorted(SEED_DIR.glob("*.txt"))
    if not files:
        return {}
    text = "\n".join(f.read_text() for f in files)
    out = {}
    cls = None
    for m in re.finditer(r"^class (\w+)|^def (\w+)\(", text, re.M):
        if m.group(1):
            cls = m.group(1)
            continue
        name = m.group(2)
        owner = None if name in MODULE_FUNCTIONS else cls
        i = m.end()
        depth = 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end() : i - 1]
        fn = ast.parse(f"def f({params}): pass").body[0].args
        names = [a.arg for a in fn.posonlyargs + fn.args + fn.kwonlyargs]
        defaults = [ast.unparse(d) for d in fn.defaults]
        out[(owner, name)] = (names, defaults)
    return out


SEED = seed_methods()
ENGINE_CLASSES = {"Resource": base.Resource, "AttentionResource": base.AttentionResource,
                  "CGSlotSpec": base.CGSlotSpec, "EngineResourceInfo": base.EngineResourceInfo,
                  "PublishedInfo": base.PublishedInfo}


def test_seed_was_parsed():
    if not SEED_DIR.exists():
        pytest.skip(f"no seed beside the repository at {SEED_DIR}")
    assert len(SEED) > 40, f"parsed only {len(SEED)} methods from {SEED_DIR}"


@pytest.mark.parametrize("key", sorted(SEED, key=str) or [("Resource", "offload")], ids=str)
def test_every_seed_method_has_same_signature(key):
    cls_name, meth = key
    if cls_name is None:  # module-level function
        ours = getattr(base, meth)
    else:
        ours = inspect.getattr_static(ENGINE_CLASSES[cls_name], meth)
    if isinstance(ours, property):
        ours = ours.fget
    if isinstance(ours, classmethod):
        ours = ours.__func__
    if key not in SEED:  # no seed beside the repo: the eviction hooks still must exist
        assert callable(ours)
        return
    names, defaults = SEED[key]
    sig = inspect.signature(ours)
    assert list(sig.parameters) == names, f"{key}: {list(sig.parameters)} != {names}"
    ours_defaults = [
        repr(p.default) for p in sig.parameters.values() if p.default is not inspect.Parameter.empty
    ]
    assert ours_defaults == [repr(ast.literal_eval(d)) for d in defaults], key


def test_eviction_hooks_are_on_the_interface_and_overridden_by_the_kv_cache():
    for hook in EVICTION_HOOKS:
        assert hasattr(base.Resource, hook), hook
        assert getattr(PagedKVCache, hook) is not getattr(base.Resource, hook), hook
    assert base.Resource.supports_eviction.fget(None) is False


def test_engine_types_exist():
    for name in ("NodeResourceSpec", "ResourceReqConfig", "ResourceStep", "StepContext",
                 "AdmitOutcome", "ADMIT_OK", "BucketKey", "EngineResourceInfo", "CachedPrefix",
                 "KeyedWalks", "PublishedInfo", "CGSlotSpec", "build_resource"):
        assert hasattr(base, name), name
    assert base.ADMIT_OK.ok and bool(base.ADMIT_OK)


def test_build_resource_builds_a_kv_cache(geom):
    import torch

    spec = base.NodeResourceSpec("kv", PagedKVCache, {"geometry": geom, "device_pages": 4,
                                                      "host_pages": 4})
    with base.build_resource(spec, base.EngineResourceInfo(device=torch.device("cpu"))) as kv:
        assert isinstance(kv, PagedKVCache) and kv.supports_eviction
        kv.check_integrity()


# -- the vocabulary: where a request in each state is reported --------------------------


def test_a_request_in_flight_is_reported_at_the_faster_of_its_two_tiers(kv, closing):
    import threading

    import torch
    from conftest import fill

    from tiering.types import TIER_ORDER, Move, RequestState, Tier

    S = RequestState
    moves_of = {
        S.OFFLOADING: (Move.OFFLOAD_TO_HOST, Move.OFFLOAD_TO_DISK),
        S.DEMOTING: (Move.DEMOTE,),
        S.RELOADING: (Move.RELOAD_FROM_HOST, Move.RELOAD_FROM_DISK),
    }
    assert {s for s in S if s.in_flight} == set(moves_of)
    for state, moves in moves_of.items():
        for move in moves:
            fastest = min(move.source, move.destination, key=TIER_ORDER.index)
            assert state.tier is fastest, (state, move)
    at_rest = {S.RESIDENT: Tier.DEVICE, S.ON_HOST: Tier.HOST, S.ON_DISK: Tier.DISK, S.LOST: None}
    assert {s: s.tier for s in at_rest} == at_rest

    # the real cache reports the same while its copies are provably in flight
    go, entered = threading.Event(), threading.Semaphore(0)

    def hold(kind):
        entered.release()
        assert go.wait(10)

    cache = kv(device_pages=8, host_pages=8, copy_fault_hook=hold)
    closing.call(go.set)  # before the cache is closed: its held copy goes on
    fill(cache, "a", torch.Generator().manual_seed(5), 8)
    cache.offload("a")
    assert entered.acquire(timeout=10)
    assert cache.state_of("a") is S.OFFLOADING and cache.tier_of("a") is Tier.DEVICE
    go.set()
    cache.synchronize(10)
    go.clear()
    assert cache.reload("a")
    assert entered.acquire(timeout=10)
    assert cache.state_of("a") is S.RELOADING and cache.tier_of("a") is Tier.DEVICE
    cache.check_integrity()
    go.set()
    cache.synchronize(10)
    assert cache.tier_of("a") is Tier.DEVICE
    cache.check_integrity()
