"""``PagePool``: one tier's slots, free list and byte ledger.

Bad input is refused by name and changes nothing (checked against a snapshot and
``check_integrity``); a hypothesis state machine drives random allocate / release /
transfer sequences against a plain model of who holds which slot.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.core.pools import PagePool
from tiering.errors import PoolIntegrityError


def _snapshot(pool: PagePool) -> tuple:
    return pool.holdings(), pool.free_pages, pool.used_bytes


def _pool_with_two_owners() -> tuple[PagePool, list[int], list[int]]:
    pool = PagePool("device", 8, 64)
    a = pool.allocate("a", 3)
    b = pool.allocate("b", 2)
    pool.check_integrity({"a": a, "b": b})
    return pool, a, b


@pytest.mark.parametrize("field,value", [
    ("num_pages", 0), ("num_pages", True), ("num_pages", 2.5), ("num_pages", "4"),
    ("page_bytes", 0), ("page_bytes", False), ("page_bytes", 64.0), ("page_bytes", None),
])
def test_construction_refuses_what_is_not_a_positive_int_by_name(field, value):
    kw = {"num_pages": 4, "page_bytes": 64, field: value}
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1, got {value!r}"):
        PagePool("device", **kw)


@pytest.mark.parametrize("call,match", [
    (lambda p, a, b: p.allocate("c", True), "allocate needs a page count"),
    (lambda p, a, b: p.allocate("c", 1.0), "allocate needs a page count"),
    (lambda p, a, b: p.allocate("c", -1), "allocate needs a page count"),
    (lambda p, a, b: p.allocate(None, 1), "owner must not be None"),
    (lambda p, a, b: p.can_allocate(2.0), "can_allocate needs a page count"),
    (lambda p, a, b: p.release("a", [a[0], a[0]]), "repeats a slot"),
    (lambda p, a, b: p.release("a", [True]), "slot True is not a slot index"),
    (lambda p, a, b: p.release("a", [float(a[0])]), "is not a slot index"),
    (lambda p, a, b: p.release("a", [-1]), "slot -1 is not a slot index"),
    (lambda p, a, b: p.release("a", [8]), "slot 8 is not a slot index"),
    (lambda p, a, b: p.release("a", [a[0], b[0]]), "slot 3 is held by 'b'"),
    (lambda p, a, b: p.transfer_ownership("a", "t", [-1]), "slot -1 is not a slot index"),
    (lambda p, a, b: p.transfer_ownership("a", "t", [a[0], a[0]]), "repeats a slot"),
    (lambda p, a, b: p.transfer_ownership("a", None, a), "cannot pass to owner None"),
    (lambda p, a, b: p.transfer_ownership("a", "t", [a[0], b[0]]), "is not held by 'a'"),
])
def test_bad_calls_are_refused_by_name_and_change_nothing(call, match):
    pool, a, b = _pool_with_two_owners()
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=match):
        call(pool, a, b)
    assert _snapshot(pool) == before
    pool.check_integrity({"a": a, "b": b})


def test_a_shortage_is_none_and_changes_nothing():
    pool, a, b = _pool_with_two_owners()
    before = _snapshot(pool)
    assert pool.allocate("c", 4) is None and not pool.can_allocate(4)
    assert _snapshot(pool) == before
    assert pool.allocate("c", 3) == [5, 6, 7] and pool.free_pages == 0
    pool.check_integrity({"a": a, "b": b, "c": [5, 6, 7]})


def test_numpy_counts_and_slots_are_taken_as_plain_ints():
    pool = PagePool("host", 6, 32)
    got = pool.allocate("a", np.int64(3))
    assert got == [0, 1, 2] and all(type(s) is int for s in got)
    assert type(pool.used_bytes) is int and pool.used_bytes == 96
    pool.release("a", np.array([1, 2]))
    assert pool.allocate("b", 2) == [1, 2]
    assert all(type(s) is int for s in pool._free)
    pool.check_integrity({"a": [0], "b": [1, 2]})


def test_check_integrity_finds_a_slot_the_records_do_not_name():
    pool, a, b = _pool_with_two_owners()
    with pytest.raises(PoolIntegrityError, match="owner 'b'"):
        pool.check_integrity({"a": a})
    pool._used_bytes += 64  # the ledger drifts from the slots
    with pytest.raises(PoolIntegrityError, match="ledger"):
        pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / release / transfer against a model: owner -> slots."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool("device", 12, 16)
        self.model: dict[str, list[int]] = {}
        self.n = 0

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        owner = f"o{self.n}"
        self.n += 1
        free = self.pool.free_pages
        got = self.pool.allocate(owner, n)
        if n > free:
            assert got is None and self.pool.free_pages == free
            return
        assert len(got) == n and len(set(got)) == n
        held = {s for slots in self.model.values() for s in slots}
        assert not held & set(got), "a slot handed out twice"
        if got:
            self.model[owner] = got

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release_some(self, data):
        owner = data.draw(st.sampled_from(sorted(self.model)))
        slots = self.model[owner]
        part = data.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1))
        self.pool.release(owner, part)
        rest = [s for s in slots if s not in part]
        if rest:
            self.model[owner] = rest
        else:
            del self.model[owner]

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def refused_release_of_anothers_slot(self, data):
        a, b = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True,
                                  min_size=2, max_size=2))
        before = _snapshot(self.pool)
        with pytest.raises(ValueError, match="is held by"):
            self.pool.release(a, [self.model[a][0], self.model[b][0]])
        assert _snapshot(self.pool) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def transfer(self, data):
        owner = data.draw(st.sampled_from(sorted(self.model)))
        new = f"t{self.n}"
        self.n += 1
        self.pool.transfer_ownership(owner, new, self.model[owner])
        self.model[new] = self.model.pop(owner)

    @invariant()
    def agrees_with_the_model(self):
        self.pool.check_integrity(self.model)
        used = sum(len(v) for v in self.model.values())
        assert self.pool.used_pages == used
        assert self.pool.used_bytes == used * 16


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
