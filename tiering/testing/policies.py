"""The request-policy contract, as a function a user can run on their own policy.

    from tiering.testing.policies import check_policy
    check_policy(MyPolicy)                  # a factory (called for a fresh policy)
    check_policy(MyPolicy(aging_s=5.0))     # or one instance

It raises AssertionError (naming the rule broken, the policy and the case)
unless, for every one of ``cases`` seeded random candidate lists (ties on every
field are common, sizes span 1 byte to 2**63 - 1; up to 40 candidates, and one
case in ``LARGE_EVERY`` up to ``LARGE_CASE``, long enough for the partial
ordering of a prefix to be used), the policy:

- is a ``tiering.policies.base.Policy``;
- ``rank`` returns every candidate exactly once, in a new list;
- is deterministic: the same ranking again, from a tuple, from a shuffle of the
  input, and (given a factory) from a second, fresh policy;
- ``pick`` returns the shortest prefix of the ranking that covers the need;
- ``order`` of the columns agrees with ``rank``, a limited ``order`` is a prefix
  of the full one, and ``pick_rows`` agrees with ``pick``;
- when ``needs_reclaimable`` is False, orders the same without the bytes, or
  with them shuffled;
- never mutates its input (the same records, in the same order, afterwards),
  nor the columns of a batch it orders (even one whose flags it could flip).

``check_policy(policy, candidates=..., now=..., rng=...)`` checks one given
case instead (a property-based test draws them). Returns a ``PolicyCheck``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from tiering.policies.base import Policy, check_now
from tiering.policies.candidate import Candidate, CandidateBatch
from tiering.types import Tier

__all__ = ["PolicyCheck", "check_policy", "expected_pick", "random_candidates", "same_batch"]


#: Every this many cases, one of up to ``LARGE_CASE`` candidates.
LARGE_EVERY = 25
LARGE_CASE = 1500


class PolicyCheck(NamedTuple):
    """What ``check_policy`` checked: the policy's name, how many cases, how many
    candidates in all."""

    name: str
    cases: int
    candidates: int


def expected_pick(ranked: Sequence[Candidate], need: int) -> list[Candidate]:
    """The shortest prefix of ``ranked`` whose bytes cover ``need`` (all of it if none does)."""
    if need == 0:
        return []
    total = 0
    for index, candidate in enumerate(ranked):
        total += candidate.reclaimable
        if total >= need:
            return list(ranked[: index + 1])
    return list(ranked)


def same_batch(batch: CandidateBatch, **changes) -> CandidateBatch:
    """``batch`` rebuilt through the checking constructor, with ``changes`` to its columns."""
    columns = {
        "reclaimable": batch.reclaimable,
        "priority": batch.priority,
        "reload_cost_s": batch.reload_cost_s,
        "resources": batch.resources.tolist(),
        "tier": batch.tier,
        **changes,
    }
    return CandidateBatch(batch.rids.tolist(), batch.last_used, **columns)


_RESOURCES = ("kv", "lora", "")


def random_candidates(rng: random.Random, max_count: int = 40) -> list[Candidate]:
    """Up to ``max_count`` candidates, unique by (rid, resource), drawn so that ties on
    every sort key are common and sizes and times span wide ranges."""
    count = rng.randint(0, max_count)
    seen: set[tuple[str, str]] = set()
    out: list[Candidate] = []
    for _ in range(count):
        rid = "".join(rng.choice("abcxyz019-") for _ in range(rng.randint(1, 5)))
        resource = rng.choice(_RESOURCES)
        if (rid, resource) in seen:
            continue
        seen.add((rid, resource))
        size_kind = rng.randrange(3)
        if size_kind == 0:
            reclaimable = rng.randint(1, 4) * 4096
        elif size_kind == 1:
            reclaimable = rng.randint(1, 2**40)
        else:
            reclaimable = rng.randint(2**62, 2**63 - 1)
        last_used = float(rng.randint(0, 4)) if rng.random() < 0.5 else rng.uniform(0.0, 1e6)
        priority = rng.choice([-1.0, 0.0, 2.5]) if rng.random() < 0.5 else rng.uniform(-1e3, 1e3)
        cost = 0.0 if rng.random() < 0.3 else rng.uniform(1e-6, 10.0)
        out.append(Candidate(rid, reclaimable, last_used, rng.choice([Tier.DEVICE, Tier.HOST]),
                             priority, cost, resource))
    return out


def check_policy(
    policy_or_factory: Policy | Callable[[], Policy],
    *,
    cases: int = 200,
    seed: int = 0,
    candidates: Sequence[Candidate] | None = None,
    now: float | None = None,
    rng: random.Random | None = None,
) -> PolicyCheck:
    """Check the request-policy contract (module docstring); AssertionError if broken.

    ``policy_or_factory``: a ``Policy``, or a callable returning a fresh one.
    ``cases`` seeded random lists (``seed``), unless ``candidates`` (with ``now``)
    gives the one case to check; ``rng`` then draws the shuffles and needs.
    """
    if isinstance(cases, bool) or not isinstance(cases, int) or cases < 1:
        raise ValueError(f"check_policy: cases must be an int >= 1, got {cases!r}")
    if isinstance(policy_or_factory, Policy):
        policy, factory = policy_or_factory, None
    elif callable(policy_or_factory):
        policy, factory = policy_or_factory(), policy_or_factory
    else:
        raise TypeError(
            f"check_policy: expected a Policy or a callable returning one, got "
            f"{policy_or_factory!r}"
        )
    _require(isinstance(policy, Policy), policy, "be a tiering.policies.base.Policy",
             f"got {type(policy).__name__}")
    name = getattr(policy, "name", type(policy).__name__)
    if candidates is not None:
        if now is None:
            raise ValueError("check_policy: candidates= needs now=")
        check_now(now)
        given = list(candidates)
        for index, candidate in enumerate(given):
            if not isinstance(candidate, Candidate):
                raise ValueError(f"check_policy: candidates[{index}] is a "
                                 f"{type(candidate).__name__}, not a Candidate")
        _check_case(policy, factory, given, float(now), rng or random.Random(seed))
        return PolicyCheck(name, 1, len(given))
    draw = random.Random(seed)
    total = 0
    for index in range(cases):
        # every LARGE_EVERY-th case draws up to LARGE_CASE candidates: more than half
        # of those pass the 512 rows above which ``tiering.policies.ordering`` orders a
        # prefix by selection instead of a full sort
        large = index % LARGE_EVERY == LARGE_EVERY - 1
        case = random_candidates(draw, LARGE_CASE if large else 40)
        _check_case(policy, factory, case, draw.uniform(0.0, 2e6), draw)
        total += len(case)
    return PolicyCheck(name, cases, total)


def _require(ok: bool, policy: object, rule: str, detail: str = "") -> None:
    if not ok:
        name = getattr(policy, "name", type(policy).__name__)
        raise AssertionError(
            f"policy {name!r} breaks the contract: it must {rule}" + (f" ({detail})" if detail
                                                                       else "")
        )


def _check_case(policy: Policy, factory: Callable[[], Policy] | None,
                candidates: list[Candidate], now: float, rng: random.Random) -> None:
    """One case; a policy that raises on valid candidates breaks the contract too."""
    try:
        _check_one(policy, factory, candidates, now, rng)
    except AssertionError:
        raise
    except Exception as exc:
        _require(False, policy, "order any valid candidates without raising",
                 f"{len(candidates)} candidates, now={now!r}: {type(exc).__name__}: {exc}")


def _check_one(policy: Policy, factory: Callable[[], Policy] | None,
               candidates: list[Candidate], now: float, rng: random.Random) -> None:
    n = len(candidates)
    where = f"{n} candidates, now={now!r}"
    snapshot = list(candidates)

    ranked = policy.rank(candidates, now)
    _require(isinstance(ranked, list), policy, "return a list from rank", where)
    _require(ranked is not candidates, policy, "return a new list from rank", where)
    _require(len(ranked) == n and Counter(ranked) == Counter(candidates), policy,
             "rank every candidate exactly once", where)
    _require(policy.rank(candidates, now) == ranked, policy,
             "rank the same input the same way twice", where)
    _require(policy.rank(tuple(candidates), now) == ranked, policy,
             "rank a tuple as it ranks the same list", where)
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    _require(policy.rank(shuffled, now) == ranked, policy,
             "rank a shuffle of the input the same way (ties broken by rid, then resource)",
             where)
    if factory is not None:
        _require(factory().rank(candidates, now) == ranked, policy,
                 "rank the same way in a fresh instance", where)

    total = sum(c.reclaimable for c in candidates)
    need = rng.randint(0, total + 4096)
    picked = policy.pick(shuffled, now, need)
    _require(picked == expected_pick(ranked, need), policy,
             "pick the shortest prefix of its ranking that covers the need",
             f"{where}, need={need}")

    batch = CandidateBatch.from_candidates(shuffled)
    columns = _columns(batch)
    order = policy.order(batch, now)
    _require(isinstance(order, np.ndarray) and order.dtype == np.int64, policy,
             "return an int64 array from order", where)
    _require([shuffled[i] for i in order.tolist()] == ranked, policy,
             "order the columns as rank orders the records", where)
    limit = rng.randint(0, n + 2)
    prefix = policy.order(batch, now, limit)
    _require(min(limit, n) <= len(prefix) <= n and prefix.tolist() == order.tolist()[:len(prefix)],
             policy, "return a prefix of the full order for a limit", f"{where}, limit={limit}")
    rows = policy.pick_rows(batch, now, need)
    _require([shuffled[i] for i in rows.tolist()] == picked, policy,
             "pick the same rows from columns as records", f"{where}, need={need}")

    if not policy.needs_reclaimable and n:
        sizes = batch.reclaimable.tolist()
        rng.shuffle(sizes)
        for reclaimable in (None, np.array(sizes, dtype=np.int64)):
            blind = same_batch(batch, reclaimable=reclaimable)
            rule = "order without the bytes when needs_reclaimable is False"
            try:
                blind_order = policy.order(blind, now).tolist()
            except Exception as exc:  # it read the bytes it said it does not need
                _require(False, policy, rule, f"{where}: {type(exc).__name__}: {exc}")
            _require(blind_order == order.tolist(), policy, rule, where)

    _require(_same_columns(_columns(batch), columns), policy,
             "never change the columns of the batch it orders", where)
    _require(candidates == snapshot
             and all(a is b for a, b in zip(candidates, snapshot, strict=True)),
             policy, "never mutate its input", where)


_COLUMNS = ("rids", "resources", "reclaimable", "last_used", "priority", "reload_cost_s")


def _columns(batch: CandidateBatch) -> dict[str, np.ndarray | None]:
    """Copies of every column of ``batch`` (reading them gathers them, once)."""
    return {name: None if (col := getattr(batch, name)) is None else col.copy()
            for name in _COLUMNS}


def _same_columns(now_: dict, before: dict) -> bool:
    return all(
        (a is None and b is None)
        or (a is not None and b is not None and a.dtype == b.dtype
            and np.array_equal(a, b))
        for a, b in ((now_[k], before[k]) for k in _COLUMNS)
    )
