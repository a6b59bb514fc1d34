"""Victim-ranking policies: one shared contract, then each policy's own behaviour.

Size: over 700 lines: the shared contract runs over every policy, then each policy's own
cases; they share the batch builders defined here.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiering.policies import (
    LRU,
    Candidate,
    CostAware,
    LargestFirst,
    OrderCursor,
    Policy,
    PolicyRegistry,
    Priority,
    default_registry,
    make_policy,
    rank_by,
    register_policy,
)
from tiering.policies.candidate import CandidateBatch
from tiering.policies.cost_aware import EPS_S
from tiering.policies.ordering import check_keys, order_rows

from tiering.testing.policies import PolicyCheck, check_policy, expected_pick, same_batch
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
    st.integers(1, 4).map(lambda k: k * 4096),
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


@pytest.mark.parametrize("policy_name", sorted(POLICY_FACTORIES))
@settings(max_examples=150, deadline=None)
@given(candidates=_candidate_lists, now=st.floats(0.0, 2e6, allow_nan=False),
       seed=st.integers(0, 2**32 - 1))
def test_policy_contract(policy_name, candidates, now, seed):
    """The shared contract (``tiering.testing.policies.check_policy``) on drawn cases."""
    check = check_policy(POLICY_FACTORIES[policy_name], candidates=candidates, now=now,
                         rng=random.Random(seed))
    assert check == PolicyCheck(check.name, 1, len(candidates))


@pytest.mark.parametrize("policy_name", sorted(POLICY_FACTORIES))
def test_policy_contract_on_its_own_seeded_cases(policy_name):
    """What a user runs on their policy: seeded cases, no test framework needed."""
    check = check_policy(POLICY_FACTORIES[policy_name], cases=60, seed=7)
    assert check.cases == 60 and check.candidates > 60 * 5  # real, non-trivial lists
    assert check_policy(POLICY_FACTORIES[policy_name](), cases=5).cases == 5


@dataclass(frozen=True)
class _DropsOne(Policy):
    name = "drops-one"

    def rank(self, candidates, now):
        return sorted(candidates, key=lambda c: (c.last_used, c.rid, c.resource))[1:]


@dataclass(frozen=True)
class _InputOrderTies(Policy):
    """Stable on last_used alone: ties come out in input order (not by rid)."""

    name = "input-order-ties"

    def rank(self, candidates, now):
        return sorted(candidates, key=attrgetter("last_used"))


@dataclass(frozen=True)
class _SortsInPlace(Policy):
    name = "sorts-in-place"

    def rank(self, candidates, now):
        if isinstance(candidates, list):
            candidates.sort(key=lambda c: (c.last_used, c.rid, c.resource))
            return list(candidates)
        return sorted(candidates, key=lambda c: (c.last_used, c.rid, c.resource))


@dataclass(frozen=True)
class _BlindClaimButReads(LargestFirst):
    """Says it orders without the bytes, but orders by them."""

    name = "blind-claim"

    @property
    def needs_reclaimable(self):
        return False


def _alternating_factory():
    """Each policy it makes ranks the other way round from the last: a factory whose
    instances do not agree (hidden state), which a single instance would never show."""
    made = []

    def make():
        made.append(None)
        return LRU() if len(made) % 2 else _NewestFirst()

    return make


@dataclass(frozen=True)
class _NewestFirst(Policy):
    name = "newest-first"

    def rank(self, candidates, now):
        return rank_by(candidates, attrgetter("last_used"), descending=True)


@pytest.mark.parametrize(
    "broken, rule",
    [
        (_DropsOne, "rank every candidate exactly once"),
        (_InputOrderTies, "rank a shuffle of the input the same way"),
        (_SortsInPlace, "never mutate its input"),
        (_BlindClaimButReads, "order without the bytes"),
        (_alternating_factory(), "rank the same way in a fresh instance"),
        (lambda: "not a policy", "be a tiering.policies.base.Policy"),
    ],
)
def test_check_policy_rejects_a_broken_policy(broken, rule):
    with pytest.raises(AssertionError, match=re.escape(rule)):
        check_policy(broken, cases=50, seed=3)


def test_check_policy_refuses_bad_arguments():
    with pytest.raises(ValueError, match="cases must be an int >= 1"):
        check_policy(LRU, cases=0)
    with pytest.raises(TypeError, match="expected a Policy or a callable"):
        check_policy(42)
    with pytest.raises(ValueError, match="candidates= needs now="):
        check_policy(LRU, candidates=[])


def _cost_reference(c: Candidate, now: float) -> tuple:
    return (-CostAware().score(c, now), c.rid, c.resource)


# Reference orders, written as one tuple sort each: the specification the fast
# implementations (sort keys, partial selection, tie runs) must reproduce.
REFERENCE_KEYS = {
    "lru": lambda c, now: (c.last_used, c.rid, c.resource),
    "priority": lambda c, now: (-c.priority, c.last_used, c.rid, c.resource),
    "largest": lambda c, now: (-c.reclaimable, c.last_used, c.rid, c.resource),
    "cost": _cost_reference,
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
    expected = sorted(candidates, key=lambda c: REFERENCE_KEYS[policy_name](c, now))
    assert policy.rank(candidates, now) == expected
    # a prefix: only the rows that can be in it are sorted
    batch = CandidateBatch.from_candidates(candidates)
    for limit in (1, 2, 17, 300, 1499, 1501, 3000, 5000):
        prefix = policy.order(batch, now, limit).tolist()
        assert len(prefix) >= min(limit, 3000)
        assert [candidates[i] for i in prefix] == expected[: len(prefix)]
    # and the smallest covering prefix for a byte need, read in chunks
    need = rng.randint(1, sum(c.reclaimable for c in candidates) // 3)
    assert policy.pick(candidates, now, need) == expected_pick(expected, need)


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
    # nothing to reclaim is not a candidate at all
    with pytest.raises(ValueError, match=r"'empty': reclaimable must be an int in \[1, 2\*\*63\)"):
        Candidate("empty", 0, now - 100.0)
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


# -- the columnar path -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_order_rows_matches_a_tuple_sort_for_any_prefix(data):
    # sizes on both sides of the partial-selection threshold; keys from tiny
    # pools (many ties on every level), ints and floats, huge ints, -0.0
    n = data.draw(st.one_of(st.integers(0, 40), st.integers(500, 2500)), label="n")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    pools = [
        lambda: rng.integers(0, 3, n),
        lambda: rng.choice([-0.0, 0.0, 1.5, -2.0], n),
        lambda: rng.random(n),
        lambda: rng.integers(2**62, 2**62 + 3, n) * rng.choice([-1, 1], n),
    ]
    count = data.draw(st.integers(0, 3), label="keys")
    picks = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    keys = check_keys([pools[i]() for i in picks], n)
    rid_pool = [f"r{i}" for i in range(data.draw(st.integers(1, max(1, n)), label="rids"))]
    rids = np.array([rid_pool[i] for i in rng.integers(0, len(rid_pool), n)] + [""], object)[:n]
    resources = np.array(list(rng.choice(["kv", "lora", ""], n)) + [""], object)[:n]
    expected = sorted(
        range(n), key=lambda i: (*(k[i].item() for k in keys), rids[i], resources[i])
    )
    tuples = [(*(k[i].item() for k in keys), rids[i], resources[i]) for i in range(n)]
    ids = SimpleNamespace(rids=rids, resources=resources)
    whole = order_rows(keys, ids).tolist()
    assert [tuples[i] for i in whole] == [tuples[i] for i in expected]
    assert sorted(whole) == list(range(n))
    limit = data.draw(st.integers(0, n + 3), label="limit")
    prefix = order_rows(keys, ids, limit).tolist()
    assert min(limit, n) <= len(prefix) <= n
    assert [tuples[i] for i in prefix] == [tuples[i] for i in expected[: len(prefix)]]


def test_check_keys_refuses_what_it_cannot_order():
    rng = random.Random(40)
    n = rng.randint(2, 9)
    with pytest.raises(ValueError, match="key 0 has shape"):
        check_keys([np.zeros(n + 1)], n)
    with pytest.raises(ValueError, match="key 1 must be numeric"):
        check_keys([np.zeros(n), np.array(["a"] * n)], n)
    with pytest.raises(ValueError, match="key 0 contains NaN"):
        check_keys([np.full(n, math.nan)], n)
    assert check_keys([np.ones(n, dtype=bool)], n)[0].dtype.kind == "i"


def _random_batch(rng: random.Random, n: int) -> CandidateBatch:
    return CandidateBatch(
        [f"r{rng.randrange(10**6)}-{i}" for i in range(n)],
        [rng.uniform(0, 100) for _ in range(n)],
        reclaimable=[rng.randint(1, 2**40) for _ in range(n)],
        priority=[rng.uniform(-5, 5) for _ in range(n)],
        reload_cost_s=[rng.choice([0.0, rng.uniform(0.001, 2)]) for _ in range(n)],
        resources=[rng.choice(["kv", "lora"]) for _ in range(n)],
        tier=rng.choice([Tier.DEVICE, Tier.HOST]),
    )


def test_batch_records_equal_records_built_the_checked_way():
    rng = random.Random(41)
    batch = _random_batch(rng, 50)
    rows = [rng.randrange(50) for _ in range(20)]
    expected = [
        Candidate(
            batch.rids[i], int(batch.reclaimable[i]), float(batch.last_used[i]), batch.tier,
            float(batch.priority[i]), float(batch.reload_cost_s[i]), batch.resources[i],
        )
        for i in rows
    ]
    got = batch.records(rows)
    assert got == expected
    assert [hash(c) for c in got] == [hash(c) for c in expected]
    assert all(type(c.reclaimable) is int and type(c.last_used) is float for c in got)
    sizes = [rng.randint(1, 2**50) for _ in rows]
    assert [c.reclaimable for c in batch.records(rows, reclaimable=sizes)] == sizes
    assert len(batch.records()) == 50
    # records given are records returned
    records = batch.records()
    again = CandidateBatch.from_candidates(records)
    assert all(a is b for a, b in zip(again.records(), records, strict=True))
    assert again.records([3], reclaimable=[7])[0] == replace(records[3], reclaimable=7)
    with pytest.raises(IndexError, match="out of range"):
        batch.records([50])
    with pytest.raises(ValueError, match="reclaimable"):
        batch.records(rows, reclaimable=[-1] * len(rows))
    blind = same_batch(batch, reclaimable=None)
    with pytest.raises(ValueError, match="not asked"):
        blind.records(rows)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rids": ["a", ""]}, "rids"),
        ({"rids": ["a", 7]}, "rids"),
        ({"last_used": [1.0, math.nan]}, "last_used"),
        ({"last_used": [1.0]}, "last_used"),
        ({"last_used": ["1.0", "2.0"]}, "last_used"),
        ({"priority": [0.0, math.inf]}, "priority"),
        ({"reload_cost_s": [0.0, -0.5]}, "reload_cost_s"),
        ({"reclaimable": [1, -1]}, "reclaimable"),
        ({"reclaimable": [1, 2**63]}, "reclaimable"),
        ({"reclaimable": [1.0, 2.5]}, "reclaimable"),
        ({"reclaimable": [True, False]}, "reclaimable"),
        ({"resources": ["kv", None]}, "resources"),
        ({"resources": ["kv"]}, "resources"),
        ({"tier": "device"}, "tier"),
    ],
)
def test_batch_rejects_bad_columns_by_name(change, field):
    rng = random.Random(42)
    columns = {"rids": ["a", "b"], "last_used": [rng.random(), rng.random()], **change}
    with pytest.raises(ValueError, match=field):
        CandidateBatch(columns.pop("rids"), columns.pop("last_used"), **columns)


def test_batch_is_read_only_and_of_registered_still_checks_numbers():
    rng = random.Random(43)
    batch = _random_batch(rng, 8)
    for column in (batch.rids, batch.resources, batch.reclaimable, batch.last_used,
                   batch.priority, batch.reload_cost_s):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = column[1]
    rids = np.array([f"r{i}" for i in range(3)], dtype=object)
    names = np.array(["kv"] * 3, dtype=object)
    made = CandidateBatch.of_registered(rids, names, np.array([1.0, 2.0, 3.0]))
    assert len(made) == 3 and made.reclaimable is None
    assert made.rids is rids and not rids.flags.writeable  # taken over, not copied
    with pytest.raises(ValueError, match="last_used"):
        CandidateBatch.of_registered(rids, names, np.array([1.0, math.nan, 3.0]))
    with pytest.raises(ValueError, match="object array"):
        CandidateBatch.of_registered(["r0", "r1", "r2"], names, np.zeros(3))


class OverriddenLRU(LRU):
    """A subclass of a built-in that overrides rank: newest first."""

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (-c.last_used, c.rid, c.resource))


class NoOrder(Policy):
    """Defines no way to order at all."""


class Forger(Policy):
    """Returns records it was not given."""

    def rank(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return [replace(c, priority=c.priority + 1.0) for c in candidates]


def test_the_most_derived_ordering_method_is_used():
    rng = random.Random(44)
    batch = _random_batch(rng, 30)
    records = batch.records()
    now = 200.0
    overridden = OverriddenLRU()
    assert overridden.needs_reclaimable  # ranked from records, which carry the bytes
    assert not LRU().needs_reclaimable
    newest = [records[i] for i in overridden.order(batch, now).tolist()]
    assert newest == overridden.rank(records, now)
    assert newest == list(reversed(LRU().rank(records, now)))
    with pytest.raises(ValueError, match="reclaimable"):
        overridden.order(same_batch(batch, reclaimable=None), now)
    with pytest.raises(TypeError, match="NoOrder defines none"):
        NoOrder().rank(records, now)
    with pytest.raises(ValueError, match="exactly once"):
        Forger().order(batch, now)
    # one record object listed twice is two candidates, for rank-only policies too
    twice = [records[0], *records[1:5], records[0]]
    for policy in (MostRecentFirst(), LRU()):
        assert policy.pick(twice, now, 1 << 62) == policy.rank(twice, now)
        assert len(policy.rank(twice, now)) == 6


def test_order_cursor_reads_the_order_in_chunks():
    rng = random.Random(45)
    batch = _random_batch(rng, 2000)
    now = 50.0
    for policy in (LRU(), Priority("kv"), LargestFirst(), CostAware(), MostRecentFirst()):
        whole = policy.order(batch, now).tolist()
        cursor = OrderCursor(policy, batch, now)
        read: list[int] = []
        assert cursor.take(0).tolist() == []
        while cursor.read < len(batch):
            read += cursor.take(rng.choice([1, 7, 64, 700])).tolist()
        assert read == whole
        assert cursor.take(5).tolist() == []
        sizes = batch.reclaimable
        chunk = OrderCursor(policy, batch, now).take_for(float(sizes.sum()) / 10, None)
        assert len(chunk) == OrderCursor.FIRST_ROWS
        first = OrderCursor(policy, batch, now).take_for(float(sizes[0]) * 40, float(sizes[0]))
        assert 40 <= len(first) <= 100
    with pytest.raises(ValueError, match="limit"):
        LRU().order(batch, now, -1)
    with pytest.raises(ValueError, match="reclaimable"):
        LRU().pick_rows(same_batch(batch, reclaimable=None), now, 10)
    with pytest.raises(ValueError, match="need_bytes"):
        LRU().pick_rows(batch, now, -3)


class _IdsNeverRead:
    """Ids that fail the test if they are read."""

    @property
    def rids(self) -> np.ndarray:
        raise AssertionError("ids were read, but no rows tie")

    resources = rids


def test_order_rows_reads_ids_only_when_rows_tie():
    rng = random.Random(46)
    n = rng.randint(600, 900)
    distinct = check_keys([np.array(rng.sample(range(10**6), n), dtype=np.float64)], n)
    expected = np.argsort(distinct[0]).tolist()
    assert order_rows(distinct, _IdsNeverRead()).tolist() == expected
    assert order_rows(distinct, _IdsNeverRead(), 10).tolist() == expected[:10]
    tied = check_keys([np.zeros(n)], n)
    with pytest.raises(AssertionError, match="ids were read"):
        order_rows(tied, _IdsNeverRead())


def test_a_registry_of_another_kind_names_its_kind_and_checks_its_product():
    """``tiering.policies.registry.Registry`` serves any kind of policy: the messages name the
    kind, and ``make`` refuses a factory that returns something else."""
    from tiering.policies.registry import Registry

    class Widget:
        pass

    class WidgetRegistry(Registry):
        kind = "widget policy"
        product = Widget
        __slots__ = ()

    base = WidgetRegistry({"w": Widget})
    grown = base.with_policy("bad", lambda: 3)
    assert type(grown) is WidgetRegistry and base.names == ("w",)
    assert grown.names == ("bad", "w") and isinstance(grown.make("w"), Widget)
    with pytest.raises(TypeError, match="widget policy 'bad': factory returned int, not a Widget"):
        grown.make("bad")
    with pytest.raises(ValueError, match="unknown widget policy 'x'; known widget policies: bad, w"):
        grown.make("x")
    with pytest.raises(ValueError, match="widget policy 'w' is already registered"):
        grown.with_policy("w", Widget)
    with pytest.raises(ValueError, match="a widget policy name must be a non-empty str"):
        WidgetRegistry({"": Widget})


def test_batch_columns_read_back_and_are_read_only():
    rng = random.Random(43)
    batch = _random_batch(rng, 7)
    for name in ("rids", "resources", "reclaimable", "last_used", "priority", "reload_cost_s"):
        before = np.array(getattr(batch, name), copy=True)
        assert len(before) == 7
        with pytest.raises(AttributeError, match=f"CandidateBatch.{name} is read-only"):
            setattr(batch, name, None)
        assert np.array_equal(getattr(batch, name), before)  # nothing changed


# -- bad input is refused by name, twins order the same way, the contract
# -- catches what it promised to catch ------------------------------------------------------

_BUILTINS = [LRU(), Priority("kv"), LargestFirst(), CostAware()]


@pytest.mark.parametrize("policy", _BUILTINS, ids=lambda p: p.name)
@pytest.mark.parametrize("count", [6, 700])
def test_rows_sharing_a_request_id_order_the_same_whatever_the_input_order(policy, count):
    """A list may hold one request twice (two records, one (rid, resource)); where they tie
    on every key the order used to follow the input order."""
    rng = random.Random(count)
    records = [Candidate(f"r{i % 3}", rng.randint(1, 2**40), 7.0, Tier.DEVICE, 1.5,
                         rng.choice([0.0, rng.uniform(0.1, 2.0)]), "kv")
               for i in range(count)]
    now = 50.0
    want = policy.rank(records, now)
    for _ in range(3):
        shuffled = list(records)
        rng.shuffle(shuffled)
        assert policy.rank(shuffled, now) == want
        batch = CandidateBatch.from_candidates(shuffled)
        prefix = policy.order(batch, now, 5)
        assert [shuffled[i] for i in prefix.tolist()] == want[: len(prefix)]
    # negative control: the twins really differ, so an input-order tie-break would show
    assert len({(c.reclaimable, c.reload_cost_s) for c in records}) > 1


@pytest.mark.parametrize("policy", _BUILTINS, ids=lambda p: p.name)
@pytest.mark.parametrize("bad, what", [
    (["a", "b"], "item 0 is a str"),
    ([Candidate("a", 5, 1.0), None], "item 1 is a NoneType"),
    ([SimpleNamespace(rid="a", reclaimable=5, last_used=1.0, tier=Tier.DEVICE,
                      priority=0.0, reload_cost_s=0.0, resource="")], "not a Candidate"),
])
def test_rank_and_pick_refuse_what_is_not_a_candidate_by_name(policy, bad, what):
    with pytest.raises(ValueError, match=what):
        policy.rank(bad, 1.0)
    with pytest.raises(ValueError, match=what):
        policy.pick(bad, 1.0, 3)


@pytest.mark.parametrize("bad", [iter([Candidate("a", 5, 1.0)]), "ab", 7])
def test_rank_and_pick_refuse_what_is_not_a_sequence(bad):
    for call in (lambda: LRU().rank(bad, 1.0), lambda: LRU().pick(bad, 1.0, 3)):
        with pytest.raises(ValueError, match="must be a sequence"):
            call()


@pytest.mark.parametrize("keys, what", [
    (5, "got int"),
    ("ab", "got str"),
    ({"a": 1}, "got dict"),
    ((x for x in ()), "got generator"),
])
def test_sort_keys_that_are_not_a_tuple_of_columns_are_refused_by_name(keys, what):
    class Garbage(Policy):
        name = "garbage"

        def sort_keys(self, batch, now):
            return keys

    batch = _random_batch(random.Random(5), 4)
    with pytest.raises(ValueError, match=f"sort keys must be a tuple of 1-D arrays, {what}"):
        Garbage().order(batch, 1.0)


def test_a_bare_array_of_keys_is_refused_not_split_into_scalars():
    batch = _random_batch(random.Random(6), 3)
    for bare in (batch.last_used, np.stack([batch.last_used, batch.priority])):
        with pytest.raises(ValueError, match="got ndarray"):
            check_keys(bare, 3)
    assert len(check_keys((batch.last_used, batch.priority), 3)) == 2


@pytest.mark.parametrize("rows", [[0.5], [True], np.array([1.0])])
def test_batch_records_refuses_rows_that_are_not_ints(rows):
    batch = _random_batch(random.Random(7), 3)
    with pytest.raises(ValueError, match="rows must be ints"):
        batch.records(rows)
    assert batch.records([2])[0].rid == batch.rids[2]


def test_the_registry_refuses_a_wrong_registry_and_odd_names_by_name():
    with pytest.raises(TypeError, match="make_policy: registry must be a PolicyRegistry"):
        make_policy("lru", registry={"lru": LRU})
    with pytest.raises(TypeError, match="register_policy: registry must be a PolicyRegistry"):
        register_policy("mine", LRU, registry=3)
    with pytest.raises(ValueError, match=r"unknown policy \[\]"):
        make_policy([])
    assert [] not in default_registry() and 3 not in default_registry()
    assert "lru" in default_registry()


def test_a_registry_cannot_be_changed_in_place():
    registry = register_policy("mine", LRU)
    with pytest.raises(AttributeError, match="never changes"):
        registry._factories = {}
    with pytest.raises(AttributeError, match="never changes"):
        del registry._factories
    assert registry.names == ("cost", "largest", "lru", "mine", "priority")
    assert isinstance(registry.make("mine"), LRU)


class _WritesColumns(Policy):
    """Flips a column writeable and overwrites it: the batch is no longer what was asked."""

    name = "writes-columns"

    def sort_keys(self, batch, now):
        column = batch.last_used
        column.flags.writeable = True
        column[:] = column[::-1].copy()
        return (np.zeros(len(batch)),)


class _ShortPrefix(LRU):
    """A limited order shorter than the limit: the cursor under pick raises."""

    def order(self, batch, now, limit=None):
        rows = super().order(batch, now, limit)
        return rows if limit is None else rows[: max(0, limit - 1)]


@pytest.mark.parametrize("broken, rule", [
    (_WritesColumns, "never change the columns of the batch it orders"),
    (_ShortPrefix, "order any valid candidates without raising"),
])
def test_check_policy_catches_a_policy_that_changes_columns_or_raises(broken, rule):
    with pytest.raises(AssertionError, match=re.escape(rule)):
        check_policy(broken, cases=50, seed=11)


@pytest.mark.parametrize("policy", _BUILTINS, ids=lambda p: p.name)
def test_ordering_leaves_every_column_of_the_batch_as_it_was(policy):
    batch = _random_batch(random.Random(12), 600)
    before = {name: getattr(batch, name).copy() for name in
              ("rids", "resources", "reclaimable", "last_used", "priority", "reload_cost_s")}
    policy.order(batch, 3.0)
    policy.order(batch, 3.0, 7)
    policy.pick_rows(batch, 3.0, int(batch.reclaimable.sum() // 3))
    for name, column in before.items():
        assert np.array_equal(getattr(batch, name), column), name
        assert not getattr(batch, name).flags.writeable, name


def test_check_policy_blames_bad_given_candidates_on_the_caller():
    with pytest.raises(ValueError, match=r"candidates\[1\] is a str"):
        check_policy(LRU(), candidates=[Candidate("a", 5, 1.0), "b"], now=1.0)
    with pytest.raises(ValueError, match="now must be a finite number"):
        check_policy(LRU(), candidates=[Candidate("a", 5, 1.0)], now=math.nan)


@pytest.mark.parametrize("bad", [None, [1, 2], "rows", SimpleNamespace(last_used=np.ones(2))])
def test_order_and_pick_rows_refuse_what_is_not_a_batch_by_name(bad):
    for policy in _BUILTINS:
        with pytest.raises(ValueError, match="batch must be a CandidateBatch"):
            policy.order(bad, 1.0)
        with pytest.raises(ValueError, match="batch must be a CandidateBatch"):
            policy.pick_rows(bad, 1.0, 3)
    with pytest.raises(ValueError, match="batch must be a CandidateBatch"):
        OrderCursor(LRU(), bad, 1.0)


def test_order_cursor_refuses_a_bad_policy_or_count_and_keeps_its_place():
    batch = _random_batch(random.Random(13), 9)
    with pytest.raises(ValueError, match="policy must be a Policy"):
        OrderCursor(3, batch, 1.0)
    cursor = OrderCursor(LRU(), batch, 1.0)
    first = cursor.take(2)
    for bad in (1.5, True, "2", None):
        with pytest.raises(ValueError, match="count must be an int"):
            cursor.take(bad)
    assert cursor.read == 2
    rest = cursor.take(100)
    assert np.concatenate([first, rest]).tolist() == LRU().order(batch, 1.0).tolist()


def test_cost_scores_refuse_a_batch_without_bytes_or_a_non_candidate_by_name():
    rng = random.Random(14)
    policy = CostAware()
    blind = CandidateBatch(["a", "b"], [rng.uniform(0, 9), rng.uniform(0, 9)])
    with pytest.raises(ValueError, match="reclaimable bytes were not asked for"):
        policy.batch_scores(blind, 10.0)
    with pytest.raises(ValueError, match="batch must be a CandidateBatch"):
        policy.batch_scores([Candidate("a", 5, 1.0)], 10.0)
    with pytest.raises(ValueError, match="candidate must be a Candidate"):
        policy.score(SimpleNamespace(reclaimable=5, last_used=1.0, reload_cost_s=0.0), 10.0)
    full = same_batch(blind, reclaimable=[rng.randint(1, 2**30), rng.randint(1, 2**30)])
    records = full.records()
    assert policy.batch_scores(full, 10.0).tolist() == [policy.score(c, 10.0) for c in records]


@pytest.mark.parametrize("rids, resources, what", [
    ("ab", "", "rids must be a sequence of str, got str"),
    (7, "", "rids must be a sequence of str, got int"),
    (b"ab", "", "rids must be a sequence of str, got bytes"),
    (["a", "b"], 3, "resources must be a sequence of str, got int"),
])
def test_a_batch_refuses_ids_that_are_not_a_sequence_of_str(rids, resources, what):
    rng = random.Random(15)
    with pytest.raises(ValueError, match=what):
        CandidateBatch(rids, [rng.uniform(0, 9), rng.uniform(0, 9)], resources=resources)
    ok = CandidateBatch(["a", "b"], [rng.uniform(0, 9), rng.uniform(0, 9)], resources="kv")
    assert ok.resources.tolist() == ["kv", "kv"]


class _WrongPrefixWhenLong(LRU):
    """Correct below 512 rows; for a long batch its limited order is the reverse order."""

    def order(self, batch, now, limit=None):
        rows = super().order(batch, now)
        if limit is None or len(batch) < 512:
            return rows if limit is None else super().order(batch, now, limit)
        return rows[::-1].copy()


def test_check_policy_also_checks_long_candidate_lists():
    # its limited order is wrong: pick (which reads a limited order) or the prefix rule fails
    with pytest.raises(AssertionError, match="shortest prefix of its ranking|prefix of the full"):
        check_policy(_WrongPrefixWhenLong, cases=50, seed=2)
    assert check_policy(LRU, cases=50, seed=2).candidates > 1000


@pytest.mark.parametrize("policy", [LargestFirst(), CostAware()], ids=lambda p: p.name)
def test_a_policy_that_reads_the_bytes_refuses_a_batch_without_them_by_name(policy):
    rng = random.Random(18)
    blind = CandidateBatch([f"r{i}" for i in range(5)], [rng.uniform(0, 9) for _ in range(5)])
    with pytest.raises(ValueError, match=f"policy '{policy.name}' orders by the reclaimable"):
        policy.order(blind, 10.0)
    # the bytes-blind policies still order it
    assert sorted(LRU().order(blind, 10.0).tolist()) == list(range(5))
    full = Priority("kv").order(blind, 10.0).tolist()
    prefix = Priority("kv").order(blind, 10.0, 2).tolist()
    assert sorted(full) == list(range(5)) and len(prefix) >= 2 and prefix == full[: len(prefix)]


def test_a_registry_is_made_from_a_mapping_only():
    with pytest.raises(TypeError, match="PolicyRegistry: factories must be a mapping"):
        PolicyRegistry([("lru", LRU)])
    assert PolicyRegistry({"lru": LRU}).names == ("lru",)


@pytest.mark.parametrize("then", [("nope",), "rid", (3,), ("tier",), None])
def test_rank_by_refuses_tie_fields_it_cannot_order_by_name(then):
    rng = random.Random(19)
    records = [Candidate(f"r{i}", rng.randint(1, 99), 1.0) for i in range(4)]
    for some in (records, records[:1]):
        with pytest.raises(ValueError, match="then must be a tuple of field names"):
            rank_by(some, attrgetter("last_used"), then=then)
    ordered = rank_by(records, attrgetter("last_used"), then=["reclaimable", "rid"])
    assert ordered == sorted(records, key=attrgetter("reclaimable", "rid"))


def test_a_policy_that_does_not_read_the_bytes_does_not_gather_them(monkeypatch):
    """``order`` checked ``batch.reclaimable`` before the policy's ``reads_reclaimable``, so
    every order of a records batch gathered the bytes column, even for LRU and priority."""
    import tiering.policies.candidate as candidate_module

    gathered: list[int] = []
    real = candidate_module._GATHER["_reclaimable"]
    monkeypatch.setitem(candidate_module._GATHER, "_reclaimable",
                        lambda records: gathered.append(len(records)) or real(records))
    rng = random.Random(21)
    records = [Candidate(f"r{i}", rng.randint(1, 2**40), rng.uniform(0, 99), Tier.DEVICE,
                         rng.uniform(-5, 5), 0.0, "kv") for i in range(50)]
    for blind in (LRU(), Priority("kv")):
        batch = CandidateBatch.from_candidates(records)
        rows = blind.order(batch, 100.0)
        assert sorted(rows.tolist()) == list(range(50))
        blind.order(batch, 100.0, 5)
    assert gathered == []
    # the control: a policy that reads the bytes gathers them, once per batch
    batch = CandidateBatch.from_candidates(records)
    LargestFirst().order(batch, 100.0)
    LargestFirst().order(batch, 100.0, 5)
    assert gathered == [50]


def test_a_registry_pickles_and_copies_as_its_entries():
    """A registry is an immutable value, yet pickling or deep-copying one (to hand it to a
    worker process) raised TypeError: cannot pickle 'mappingproxy' object."""
    import copy
    import pickle

    from tiering.policies import LRU, default_registry, make_policy, register_policy
    from tiering.policies.blocks import default_block_registry, make_block_policy

    mine = register_policy("mine", LRU)
    for reg in (default_registry(), mine, default_block_registry()):
        for back in (pickle.loads(pickle.dumps(reg)), copy.deepcopy(reg)):
            assert type(back) is type(reg) and back.names == reg.names
            with pytest.raises(AttributeError, match="never changes"):
                back._factories = {}
    assert isinstance(make_policy("mine", registry=pickle.loads(pickle.dumps(mine))), LRU)
    blocks = pickle.loads(pickle.dumps(default_block_registry()))
    assert make_block_policy("lru", registry=blocks, capacity=3).name == "lru"
