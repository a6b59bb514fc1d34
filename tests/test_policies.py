"""Victim-ranking policies: one shared contract, then each policy's own behaviour."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    LRU,
    Candidate,
    CostAware,
    LargestFirst,
    Policy,
    PolicyRegistry,
    Priority,
    default_registry,
    make_policy,
    rank_by,
    register_policy,
)
from policies.cost_aware import EPS_S
from tiering.types import Tier


@dataclass(frozen=True)
class MostRecentFirst(Policy):
    """A custom policy used to prove the registry plugs one in: newest first."""

    name = "mru"

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return rank_by(candidates, attrgetter("last_used"), descending=True)


def _custom_policy() -> Policy:
    registry = register_policy("mru", MostRecentFirst)
    return make_policy("mru", registry=registry)


POLICY_FACTORIES = {
    "lru": LRU,
    "priority": lambda: Priority("kv"),
    "largest": LargestFirst,
    "cost": CostAware,
    "cost-fast-aging": lambda: CostAware(aging_s=0.5, default_bandwidth_bps=3e8),
    "custom-registered": _custom_policy,
}


# Fields drawn from small pools as well as wide ranges, so that ties on every
# sort key are common.
_times = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 1e6, allow_nan=False))
_sizes = st.one_of(
    st.integers(0, 4).map(lambda k: k * 4096),
    st.integers(1, 2**40),
    st.integers(2**62, 2**63 - 1),
)
_priorities = st.one_of(
    st.sampled_from([-1.0, 0.0, 2.5]), st.floats(-1e3, 1e3, allow_nan=False)
)
_costs = st.one_of(st.just(0.0), st.floats(1e-6, 10.0, allow_nan=False))
_candidates = st.builds(
    Candidate,
    rid=st.text(alphabet="abcxyz019-", min_size=1, max_size=5),
    reclaimable=_sizes,
    last_used=_times,
    tier=st.sampled_from([Tier.DEVICE, Tier.HOST]),
    priority=_priorities,
    reload_cost_s=_costs,
    resource=st.sampled_from(["kv", "lora", ""]),
)
_candidate_lists = st.lists(_candidates, max_size=40, unique_by=lambda c: (c.rid, c.resource))


def _expected_pick(ranked: list[Candidate], need: int) -> list[Candidate]:
    if need == 0:
        return []
    total = 0
    for index, candidate in enumerate(ranked):
        total += candidate.reclaimable
        if total >= need:
            return ranked[: index + 1]
    return ranked


@pytest.mark.parametrize("policy_name", sorted(POLICY_FACTORIES))
@settings(max_examples=150, deadline=None)
@given(candidates=_candidate_lists, now=st.floats(0.0, 2e6, allow_nan=False), data=st.data())
def test_policy_contract(policy_name, candidates, now, data):
    policy = POLICY_FACTORIES[policy_name]()
    assert isinstance(policy, Policy)
    snapshot = list(candidates)

    ranked = policy.rank(candidates, now)

    # every candidate exactly once, in a new list
    assert isinstance(ranked, list)
    assert ranked is not candidates
    assert len(ranked) == len(candidates)
    assert Counter(ranked) == Counter(candidates)
    # deterministic: again, from a tuple, and from any shuffle of the input
    assert policy.rank(candidates, now) == ranked
    assert policy.rank(tuple(candidates), now) == ranked
    shuffled = data.draw(st.permutations(candidates), label="shuffled")
    assert policy.rank(shuffled, now) == ranked
    # pick is the shortest prefix of the ranking that covers the need
    total = sum(c.reclaimable for c in candidates)
    need = data.draw(st.integers(0, total + 4096), label="need")
    picked = policy.pick(shuffled, now, need)
    assert picked == _expected_pick(ranked, need)
    if need <= total:
        assert sum(c.reclaimable for c in picked) >= need
    # the input was never touched
    assert candidates == snapshot
    assert all(a is b for a, b in zip(candidates, snapshot, strict=True))


# Reference orders, written as one tuple sort each: the specification the fast
# implementations (single-key sort + tie runs) must reproduce.
REFERENCE_KEYS = {
    "lru": lambda c: (c.last_used, c.rid, c.resource),
    "priority": lambda c: (-c.priority, c.last_used, c.rid, c.resource),
    "largest": lambda c: (-c.reclaimable, c.last_used, c.rid, c.resource),
}


def _random_candidates(rng: random.Random, count: int, distinct_times: int) -> list[Candidate]:
    return [
        Candidate(
            rid=f"r{rng.getrandbits(24):06x}-{index}",
            reclaimable=rng.randint(1, 8) * 4096,
            last_used=float(rng.randrange(distinct_times)),
            priority=float(rng.randint(-1, 2)),
            reload_cost_s=rng.choice([0.0, rng.uniform(0.001, 0.5)]),
            resource=rng.choice(["kv", "lora"]),
        )
        for index in range(count)
    ]


@pytest.mark.parametrize("policy_name", sorted(REFERENCE_KEYS))
@pytest.mark.parametrize("distinct_times", [3, 400, 2500, 10**9])
def test_large_inputs_match_the_reference_order(policy_name, distinct_times):
    # Sizes and tie densities that drive every branch of the tie handling:
    # few long runs, many short runs, and almost no ties.
    rng = random.Random(distinct_times * 7 + len(policy_name))
    candidates = _random_candidates(rng, 3000, distinct_times)
    policy = POLICY_FACTORIES[policy_name]()
    now = float(distinct_times)
    expected = sorted(candidates, key=REFERENCE_KEYS[policy_name])
    assert policy.rank(candidates, now) == expected


def test_lru_orders_least_recently_used_first_ties_by_rid():
    rng = random.Random(11)
    times = rng.sample(range(1000), 3)
    old, mid, new = sorted(float(t) for t in times)
    size = rng.randint(1, 2**30)
    candidates = [
        Candidate("b", size, mid),
        Candidate("z", size * 3, old),
        Candidate("a", size * 2, mid),
        Candidate("m", size, new),
    ]
    ranked = LRU().rank(candidates, now=new + 1)
    assert [c.rid for c in ranked] == ["z", "a", "b", "m"]
    assert LRU().needs_priority_from is None
    assert LRU().name == "lru"


def test_priority_names_its_resource_and_ranks_by_priority_then_recency():
    rng = random.Random(12)
    policy = Priority("kv")
    assert policy.needs_priority_from == "kv"
    assert policy.name == "priority"
    low, high = sorted(rng.sample(range(-50, 50), 2))
    t1, t2 = sorted(rng.sample(range(1, 10_000), 2))
    candidates = [
        Candidate("old-low", 4096, float(t1), priority=float(low)),
        Candidate("new-high", 4096, float(t2), priority=float(high)),
        Candidate("old-high", 4096, float(t1), priority=float(high)),
        Candidate("same-b", 4096, float(t2), priority=float(low)),
        Candidate("same-a", 4096, float(t2), priority=float(low)),
    ]
    ranked = policy.rank(candidates, now=float(t2))
    assert [c.rid for c in ranked] == ["old-high", "new-high", "old-low", "same-a", "same-b"]


@pytest.mark.parametrize("resource", ["", None, 3])
def test_priority_rejects_a_missing_resource_name(resource):
    with pytest.raises(ValueError, match="resource"):
        Priority(resource)


def test_largest_first_frees_most_bytes_first_then_lru():
    rng = random.Random(13)
    small, big = sorted(rng.sample(range(1, 2**20), 2))
    t1, t2 = sorted(rng.sample(range(1, 10_000), 2))
    candidates = [
        Candidate("small", small, 0.0),
        Candidate("big-new", big, float(t2)),
        Candidate("big-old", big, float(t1)),
    ]
    ranked = LargestFirst().rank(candidates, now=float(t2))
    assert [c.rid for c in ranked] == ["big-old", "big-new", "small"]
    assert LargestFirst().pick(candidates, float(t2), big + 1) == ranked[:2]


def _documented_score(c: Candidate, now: float, aging_s, bandwidth, overhead) -> float:
    reload_s = c.reload_cost_s if c.reload_cost_s > 0 else overhead + c.reclaimable / bandwidth
    idle_s = max(0.0, now - c.last_used)
    return c.reclaimable / max(reload_s, EPS_S) * (1 + idle_s / aging_s)


def test_cost_aware_score_follows_the_documented_formula():
    rng = random.Random(14)
    aging, bandwidth, overhead = rng.uniform(1, 60), rng.uniform(1e8, 5e10), rng.uniform(0, 0.01)
    policy = CostAware(aging_s=aging, default_bandwidth_bps=bandwidth, default_overhead_s=overhead)
    now = rng.uniform(1e3, 1e4)
    candidates = [
        Candidate(
            f"r{i}",
            rng.randint(1, 2**34),
            now - rng.uniform(-5, 500),  # a few last_used lie in the future: idle clamps to 0
            reload_cost_s=rng.choice([0.0, rng.uniform(1e-4, 2.0)]),
        )
        for i in range(200)
    ]
    expected = [_documented_score(c, now, aging, bandwidth, overhead) for c in candidates]
    singles = [policy.score(c, now) for c in candidates]
    batch = policy.scores(candidates, now)
    for want, one, many in zip(expected, singles, batch, strict=True):
        assert math.isclose(one, want, rel_tol=1e-12)
        assert math.isclose(many, want, rel_tol=1e-12)
    # nothing to reclaim scores 0
    empty = Candidate("empty", 0, now - 100.0)
    assert policy.score(empty, now) == 0.0 and policy.scores([empty], now) == [0.0]
    # an unknown cost is estimated from the bytes
    unknown = next(c for c in candidates if c.reload_cost_s == 0.0)
    assert policy.reload_seconds(unknown) == pytest.approx(
        overhead + unknown.reclaimable / bandwidth
    )
    # the ranking is by score, highest first
    ranked = policy.rank(candidates, now)
    ranked_scores = [policy.score(c, now) for c in ranked]
    assert all(a >= b for a, b in zip(ranked_scores, ranked_scores[1:], strict=False))


def test_cost_aware_ages_an_old_small_request_past_a_fresh_large_one():
    rng = random.Random(15)
    aging = rng.uniform(5, 60)
    policy = CostAware(aging_s=aging)
    now = rng.uniform(1e4, 1e5)
    cost = rng.uniform(0.01, 0.1)
    large = Candidate("large", rng.randint(2**28, 2**30), now, reload_cost_s=cost)
    small_bytes = rng.randint(2**16, 2**20)

    def small_idle(idle: float) -> Candidate:
        return Candidate("small", small_bytes, now - idle, reload_cost_s=cost)

    # Fresh, the large one wins; the small one overtakes once its aging factor
    # exceeds the ratio of the two base scores.
    crossover = aging * (large.reclaimable / small_bytes - 1)
    assert [c.rid for c in policy.rank([small_idle(0.0), large], now)] == ["large", "small"]
    before = policy.rank([small_idle(crossover * 0.99), large], now)
    after = policy.rank([small_idle(crossover * 1.01), large], now)
    assert [c.rid for c in before] == ["large", "small"]
    assert [c.rid for c in after] == ["small", "large"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"aging_s": 0.0}, "aging_s"),
        ({"aging_s": -3.0}, "aging_s"),
        ({"aging_s": math.nan}, "aging_s"),
        ({"default_bandwidth_bps": 0}, "default_bandwidth_bps"),
        ({"default_bandwidth_bps": math.inf}, "default_bandwidth_bps"),
        ({"default_overhead_s": -1e-3}, "default_overhead_s"),
    ],
)
def test_cost_aware_rejects_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CostAware(**kwargs)


def test_pick_edge_cases():
    rng = random.Random(16)
    candidates = [Candidate(f"r{i}", rng.randint(1, 10**6), rng.uniform(0, 100)) for i in range(9)]
    policy = LRU()
    assert policy.pick(candidates, 100.0, 0) == []
    everything = sum(c.reclaimable for c in candidates)
    assert policy.pick(candidates, 100.0, everything * 2) == policy.rank(candidates, 100.0)
    assert policy.pick([], 100.0, 5) == []
    for bad in (-1, 2.5, True, None):
        with pytest.raises(ValueError, match="need_bytes"):
            policy.pick(candidates, 100.0, bad)


@pytest.mark.parametrize("now", [math.nan, math.inf, "soon", None])
def test_rank_rejects_a_bad_clock(now):
    rng = random.Random(17)
    candidates = [Candidate("r", rng.randint(1, 99), 1.0)]
    for policy in (LRU(), Priority("kv"), LargestFirst(), CostAware()):
        with pytest.raises(ValueError, match="now"):
            policy.rank(candidates, now)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rid": ""}, "rid"),
        ({"rid": 7}, "rid"),
        ({"reclaimable": -1}, "reclaimable"),
        ({"reclaimable": 2**63}, "reclaimable"),
        ({"reclaimable": 1.5}, "reclaimable"),
        ({"reclaimable": True}, "reclaimable"),
        ({"last_used": math.nan}, "last_used"),
        ({"priority": math.inf}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"reload_cost_s": -0.5}, "reload_cost_s"),
        ({"tier": "device"}, "tier"),
        ({"resource": None}, "resource"),
    ],
)
def test_candidate_rejects_bad_fields(kwargs, field):
    fields = {"rid": "r1", "reclaimable": 4096, "last_used": 1.0, **kwargs}
    with pytest.raises(ValueError, match=field):
        Candidate(**fields)


def test_rank_by_rejects_keys_it_cannot_order():
    rng = random.Random(18)
    candidates = [Candidate(f"r{i}", rng.randint(1, 99), float(i)) for i in range(3)]
    with pytest.raises(ValueError, match="3 candidates"):
        rank_by(candidates, [1.0, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        rank_by(candidates, [1.0, math.nan, 2.0])
    with pytest.raises(ValueError, match="numeric"):
        rank_by(candidates, ["a", "b", "c"])
    with pytest.raises(ValueError, match="numbers"):
        rank_by(candidates, attrgetter("rid"))


def test_rank_by_with_precomputed_keys_and_field_tiebreaks():
    rng = random.Random(19)
    candidates = [
        Candidate(f"r{rng.randrange(10**6)}-{i}", 4096, float(rng.randint(0, 3)))
        for i in range(200)
    ]
    keys = [rng.randint(0, 5) for _ in candidates]
    key_of = {c.rid: k for c, k in zip(candidates, keys, strict=True)}
    ranked = rank_by(candidates, keys, descending=True, then=("last_used", "rid", "resource"))
    assert ranked == sorted(candidates, key=lambda c: (-key_of[c.rid], c.last_used, c.rid))


def test_largest_first_compares_huge_sizes_exactly():
    # 2**60 and 2**60 + 1 are the same float64; the ranking must still tell them apart.
    rng = random.Random(20)
    base = 2**60 + rng.randrange(2**20)
    candidates = [Candidate("a-smaller", base, 1.0), Candidate("b-larger", base + 1, 5.0)]
    ranked = LargestFirst().rank(candidates, 10.0)
    assert [c.rid for c in ranked] == ["b-larger", "a-smaller"]


def test_registry_builds_every_builtin_by_name():
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("largest"), LargestFirst)
    assert make_policy("priority", resource="kv").needs_priority_from == "kv"
    cost = make_policy("cost", aging_s=12.0)
    assert isinstance(cost, CostAware) and cost.aging_s == 12.0
    assert default_registry().names == ("cost", "largest", "lru", "priority")


def test_registry_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'fifo'.*cost, largest, lru, priority"):
        make_policy("fifo")


def test_registry_reports_bad_arguments_by_policy_name():
    with pytest.raises(TypeError, match="'priority'"):
        make_policy("priority")  # the resource is required
    with pytest.raises(TypeError, match="'lru'"):
        make_policy("lru", aging_s=3.0)
    with pytest.raises(ValueError, match="resource"):
        make_policy("priority", resource="")


def test_register_policy_returns_a_new_registry_and_leaks_nothing():
    base = default_registry()
    extended = register_policy("mru", MostRecentFirst, registry=base)
    assert "mru" in extended and "mru" not in base
    assert "mru" not in default_registry()
    assert isinstance(make_policy("mru", registry=extended), MostRecentFirst)
    with pytest.raises(ValueError, match="'mru'"):
        make_policy("mru")
    with pytest.raises(ValueError, match="already registered"):
        extended.with_policy("mru", MostRecentFirst)


def test_register_policy_checks_what_it_is_given():
    with pytest.raises(ValueError, match="name"):
        register_policy("", MostRecentFirst)
    with pytest.raises(TypeError, match="not callable"):
        register_policy("broken", "not a factory")
    registry = register_policy("liar", lambda: object())
    with pytest.raises(TypeError, match="not a Policy"):
        registry.make("liar")
    empty = PolicyRegistry()
    with pytest.raises(ValueError, match="known policies: $"):
        empty.make("lru")
