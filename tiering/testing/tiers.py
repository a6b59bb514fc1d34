"""The contracts of ``tiering.core.tiers.Tier`` and ``Link``, as mixins a user's test class
takes in, and a hypothesis state machine over a tier's ledger.

    from tiering.testing.tiers import LinkContract, TierContract, tier_ledger_machine

    class TestMyTier(TierContract):
        def make_tier(self, capacity_pages):
            return MyTier("cxl", Role.HOST, capacity_pages)

        def corrupt_tier(self, tier):  # optional: break its ledger behind its back
            tier._count += 1

    class TestMyLink(LinkContract):
        def make_link(self):  # the link and the two tiers it joins, in its direction
            a, b = PageTier("host", Role.HOST, 64), MyTier("cxl", Role.HOST, 64)
            return MyLink("host", "cxl"), a, b

    TestMyTierLedger = tier_ledger_machine(lambda cap: MyTier("cxl", Role.HOST, cap)).TestCase

The test methods use plain ``assert`` and ``unittest.SkipTest``, so the mixins work in a
pytest class and in a ``unittest.TestCase``. Each uses seeded random owners and sizes.
"""

from __future__ import annotations

import random
import unittest
from collections.abc import Callable, Hashable
from typing import Any

from tiering.core.tiers import Copy, Link, PageTier, Role, Tier

__all__ = ["LinkContract", "TierContract", "tier_ledger_machine"]

_BAD_PAGES = (-1, -7, True, 1.0, 2.5, "3", None)


def _snapshot(tier: Tier) -> tuple:
    return (tier.used_pages, tier.free_pages, tier.used_bytes, dict(tier.owners()))


class TierContract:
    """What every ``Tier`` does. Define ``make_tier(capacity_pages) -> Tier`` (an empty
    tier of that many pages); optionally ``corrupt_tier(tier)`` (make its ledger
    inconsistent), which ``test_check_integrity_catches_a_broken_ledger`` then needs."""

    seeds = (0, 1, 2)

    def make_tier(self, capacity_pages: int) -> Tier:  # pragma: no cover - the user's
        raise NotImplementedError("define make_tier(capacity_pages) in the test class")

    def corrupt_tier(self, tier: Tier) -> None:
        raise unittest.SkipTest("no corrupt_tier(tier) defined for this tier")

    # -- the rules ---------------------------------------------------------------------------

    def test_a_new_tier_is_empty_and_sound(self) -> None:
        for seed in self.seeds:
            cap = random.Random(seed).randint(1, 500)
            t = self.make_tier(cap)
            assert isinstance(t, Tier), f"make_tier returned {t!r}, not a Tier"
            assert isinstance(t.role, Role), f"{t!r}: role {t.role!r} is not a tiering.types.Tier"
            assert t.capacity_pages == cap and t.used_pages == 0 and t.free_pages == cap
            assert dict(t.owners()) == {}
            assert t.capacity_bytes == cap * t.page_bytes and t.free_bytes == t.capacity_bytes
            t.check_integrity()

    def test_reserve_and_release_keep_the_ledger_per_owner(self) -> None:
        for seed in self.seeds:
            rng = random.Random(seed)
            cap = rng.randint(50, 400)
            t = self.make_tier(cap)
            want: dict[Hashable, int] = {}
            for _ in range(200):
                owner = f"r{rng.randrange(8)}"
                if rng.random() < 0.6:
                    n = rng.randint(0, 40)
                    fits = sum(want.values()) + n <= cap
                    assert t.reserve(owner, n) is fits, f"reserve({owner!r}, {n}) with " \
                        f"{t.free_pages} free"
                    if fits and n:
                        want[owner] = want.get(owner, 0) + n
                else:
                    n = rng.choice([None, rng.randint(0, want.get(owner, 0))])
                    gave = t.release(owner, n)
                    expect = want.get(owner, 0) if n is None else n
                    assert gave == expect, f"release({owner!r}, {n}) gave {gave}, not {expect}"
                    left = want.get(owner, 0) - expect
                    if left:
                        want[owner] = left
                    else:
                        want.pop(owner, None)
                assert dict(t.owners()) == want
                assert t.used_pages == sum(want.values()) and t.free_pages == cap - t.used_pages
                assert t.used_bytes == t.used_pages * t.page_bytes
                for o in (f"r{i}" for i in range(8)):
                    assert t.held(o) == want.get(o, 0)
            t.check_integrity()
            for owner in list(want):
                assert t.release(owner) == want.pop(owner)
            assert t.used_pages == 0 and dict(t.owners()) == {}

    def test_a_refused_reserve_changes_nothing(self) -> None:
        for seed in self.seeds:
            rng = random.Random(seed)
            cap = rng.randint(2, 100)
            t = self.make_tier(cap)
            held = rng.randint(1, cap)
            assert t.reserve("a", held)
            before = _snapshot(t)
            for n in (cap - held + 1, cap + rng.randint(1, 50)):
                assert t.reserve(rng.choice(["a", "b"]), n) is False
                assert _snapshot(t) == before, f"a refused reserve of {n} changed the tier"
            t.check_integrity()

    def test_bad_input_raises_naming_it_and_changes_nothing(self) -> None:
        rng = random.Random(self.seeds[0])
        t = self.make_tier(100)
        assert t.reserve("a", rng.randint(5, 30))
        before = _snapshot(t)
        for bad in _BAD_PAGES:
            calls = [lambda bad=bad: t.reserve("a", bad)]
            if bad is not None:  # release("a", None) gives back all it holds
                calls.append(lambda bad=bad: t.release("a", bad))
            for call in calls:
                try:
                    call()
                except ValueError as e:
                    assert "pages" in str(e), f"the message {e} does not name pages"
                else:
                    raise AssertionError(f"pages={bad!r} was accepted")
                assert _snapshot(t) == before, f"pages={bad!r} changed the tier"
        try:
            t.reserve(None, 1)
        except ValueError as e:
            assert "owner" in str(e), f"the message {e} does not name the owner"
        else:
            raise AssertionError("a None owner was accepted")
        try:
            t.release("a", t.held("a") + 1)
        except ValueError as e:
            assert "'a'" in str(e), f"the message {e} does not name the owner"
        else:
            raise AssertionError("releasing more than the owner holds was accepted")
        assert _snapshot(t) == before
        t.check_integrity()

    def test_zero_pages_and_unknown_owners(self) -> None:
        t = self.make_tier(10)
        assert t.reserve("a", 0) is True and dict(t.owners()) == {} and t.used_pages == 0
        assert t.release("nobody") == 0 and t.release("nobody", 0) == 0
        assert t.held("nobody") == 0
        t.check_integrity()

    def test_check_integrity_catches_a_broken_ledger(self) -> None:
        t = self.make_tier(100)
        assert t.reserve("a", 10) and t.reserve("b", 3)
        t.check_integrity()
        self.corrupt_tier(t)
        try:
            t.check_integrity()
        except AssertionError as e:
            assert t.name in str(e), f"the message {e} does not name the tier"
        else:
            raise AssertionError("check_integrity passed a corrupted ledger")


class LinkContract:
    """What every ``Link`` does. Define ``make_link() -> (link, src tier, dst tier)``: a
    fresh link and the two tiers it joins, in its direction."""

    seeds = (0, 1, 2)

    def make_link(self) -> tuple[Link, Tier, Tier]:  # pragma: no cover - the user's
        raise NotImplementedError("define make_link() in the test class")

    def _made(self) -> tuple[Link, Tier, Tier]:
        link, a, b = self.make_link()
        assert isinstance(link, Link), f"make_link returned {link!r}, not a Link"
        assert (link.src, link.dst) == (a.name, b.name), \
            f"{link!r} does not join {a.name!r} -> {b.name!r}"
        return link, a, b

    def test_a_copy_reports_what_it_copied_and_lands_after_it_is_issued(self) -> None:
        for seed in self.seeds:
            rng = random.Random(seed)
            link, a, b = self._made()
            assert link.bytes_copied == 0 and link.copies == 0
            now = rng.uniform(0, 1e3)
            total = 0
            for i in range(20):
                now += rng.uniform(0, 1.0)
                nbytes = rng.randint(0, 1 << 20)
                owner = f"r{rng.randrange(5)}"
                c = link.copy(a, b, owner, nbytes, now=now)
                assert isinstance(c, Copy), f"copy returned {c!r}"
                assert (c.src, c.dst, c.owner, c.nbytes, c.layers) == \
                    (a.name, b.name, owner, nbytes, None)
                assert link.name in c.links
                assert c.done >= c.started >= now, f"{c} lands before it was issued at {now}"
                total += nbytes
                assert link.bytes_copied == total and link.copies == i + 1

    def test_layers_are_reported(self) -> None:
        link, a, b = self._made()
        c = link.copy(a, b, "r", 4096, now=1.0, layers=[3, 0, 7])
        assert c.layers == (3, 0, 7)

    def test_a_copy_moves_no_pages(self) -> None:
        link, a, b = self._made()
        rng = random.Random(self.seeds[0])
        if a.capacity_pages:
            assert a.reserve("r", rng.randint(1, a.capacity_pages))
        before = (_snapshot(a), _snapshot(b))
        link.copy(a, b, "r", a.page_bytes * max(1, a.held("r")), now=5.0)
        assert (_snapshot(a), _snapshot(b)) == before, "a copy changed a tier's ledger"

    def test_bad_input_raises_and_counts_nothing(self) -> None:
        link, a, b = self._made()
        other = PageTier(f"{a.name}-other", Role.DISK, 8, a.page_bytes)
        bad_calls: list[tuple[str, Callable[[], Any]]] = [
            ("the reversed direction", lambda: link.copy(b, a, "r", 10, now=0.0)),
            ("a foreign source", lambda: link.copy(other, b, "r", 10, now=0.0)),
            ("a foreign destination", lambda: link.copy(a, other, "r", 10, now=0.0)),
        ]
        for nb in (-1, True, 1.5, "8", None):
            bad_calls.append((f"nbytes={nb!r}", lambda nb=nb: link.copy(a, b, "r", nb, now=0.0)))
        for layers in ([], [-1], [1.0], "ab"):
            bad_calls.append((f"layers={layers!r}",
                              lambda layers=layers: link.copy(a, b, "r", 8, now=0.0,
                                                              layers=layers)))
        for what, call in bad_calls:
            try:
                call()
            except ValueError as e:
                assert link.name in str(e), f"{what}: the message {e} does not name the link"
            else:
                raise AssertionError(f"{what} was accepted")
            assert link.bytes_copied == 0 and link.copies == 0, f"{what} was counted"


def tier_ledger_machine(make_tier: Callable[[int], Tier], capacity_pages: int = 64) -> type:
    """A hypothesis ``RuleBasedStateMachine`` over the ledger of ``make_tier(capacity_pages)``:
    random reserves (refused ones change nothing), releases (bad ones raise and change
    nothing), a model of who holds what, and after every step ``check_integrity`` and the
    used and free counts against the model. Run it with its ``.TestCase``."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    owners = st.sampled_from(["a", "b", "c", ("blocks",)])

    class TierLedger(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tier = make_tier(capacity_pages)
            self.want: dict[Hashable, int] = {}

        @rule(owner=owners, n=st.integers(0, capacity_pages + 4))
        def reserve(self, owner: Hashable, n: int) -> None:
            before = _snapshot(self.tier)
            fits = sum(self.want.values()) + n <= capacity_pages
            assert self.tier.reserve(owner, n) is fits
            if not fits:
                assert _snapshot(self.tier) == before
            elif n:
                self.want[owner] = self.want.get(owner, 0) + n

        @rule(owner=owners, data=st.data())
        def release(self, owner: Hashable, data: st.DataObject) -> None:
            has = self.want.get(owner, 0)
            n = data.draw(st.one_of(st.none(), st.integers(0, has)))
            expect = has if n is None else n
            assert self.tier.release(owner, n) == expect
            if has - expect:
                self.want[owner] = has - expect
            else:
                self.want.pop(owner, None)

        @rule(owner=owners, extra=st.integers(1, 5))
        def release_too_much(self, owner: Hashable, extra: int) -> None:
            before = _snapshot(self.tier)
            try:
                self.tier.release(owner, self.want.get(owner, 0) + extra)
            except ValueError:
                pass
            else:
                raise AssertionError("releasing more than held was accepted")
            assert _snapshot(self.tier) == before

        @invariant()
        def ledger_matches_the_model(self) -> None:
            t = self.tier
            t.check_integrity()
            assert dict(t.owners()) == self.want
            assert t.used_pages == sum(self.want.values())
            assert t.free_pages == capacity_pages - t.used_pages >= 0

    TierLedger.__name__ = TierLedger.__qualname__ = "TierLedger"
    return TierLedger
