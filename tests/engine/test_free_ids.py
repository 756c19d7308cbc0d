"""FreeIds (engine/free_ids.py) against a plain set: a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ninfer_kv.engine.free_ids import FreeIds


class FreeIdsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.size = 40
        self.f = FreeIds(self.size, range(0, 40, 3))
        self.model = set(range(0, 40, 3))

    @rule(ids=st.lists(st.integers(-2, 45), max_size=5))
    def take(self, ids: list[int]) -> None:
        ok = (all(0 <= i < self.size and i in self.model for i in ids)
              and len(set(ids)) == len(ids))
        if ok:
            self.f.take(ids)
            self.model -= set(ids)
        else:
            before = list(self.f)
            with pytest.raises(ValueError):
                self.f.take(ids)
            assert list(self.f) == before  # a refused take changes nothing

    @rule(ids=st.lists(st.integers(-2, 45), max_size=5))
    def give(self, ids: list[int]) -> None:
        ok = (all(0 <= i < self.size and i not in self.model for i in ids)
              and len(set(ids)) == len(ids))
        if ok:
            self.f.give(ids)
            self.model |= set(ids)
        else:
            before = list(self.f)
            with pytest.raises(ValueError):
                self.f.give(ids)
            assert list(self.f) == before

    @rule(i=st.integers(-2, 45))
    def remove(self, i: int) -> None:
        """``remove`` (one id, the fast path Activate's row lease takes)."""
        if 0 <= i < self.size and i in self.model:
            self.f.remove(i)
            self.model.discard(i)
        else:
            before = list(self.f)
            with pytest.raises(ValueError):
                self.f.remove(i)
            assert list(self.f) == before

    @rule(i=st.integers(-2, 45))
    def add(self, i: int) -> None:
        """``add`` (one id, the fast path Finish's row release takes)."""
        if 0 <= i < self.size and i not in self.model:
            self.f.add(i)
            self.model.add(i)
        else:
            before = list(self.f)
            with pytest.raises(ValueError):
                self.f.add(i)
            assert list(self.f) == before

    @rule(n=st.integers(0, 50))
    def lowest(self, n: int) -> None:
        assert self.f.lowest(n) == sorted(self.model)[:n]

    @precondition(lambda self: self.size < 200)  # growth doubles: keep the machine small
    @rule(extra=st.integers(0, 20))
    def grow(self, extra: int) -> None:
        self.f.grow(self.size + extra)
        assert len(self.f.bits) >= self.size + extra
        self.size = len(self.f.bits)  # room may exceed the request (doubling)

    @invariant()
    def agrees(self) -> None:
        assert len(self.f) == len(self.model) and bool(self.f) == bool(self.model)
        assert list(self.f) == sorted(self.model)
        assert all((i in self.f) == (i in self.model) for i in range(-1, self.size + 1))
        assert self.f.lo <= min(self.model, default=self.f.lo)  # lo is a lower bound
        if self.model:
            assert (self.f.first(), self.f.last()) == (min(self.model), max(self.model))
        else:
            with pytest.raises(IndexError):
                self.f.first()


FreeIdsMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                            deadline=None)
TestFreeIds = FreeIdsMachine.TestCase


def test_lowest_tightens_its_bound_and_give_lowers_it() -> None:
    f = FreeIds(64, [30, 31, 50])
    assert f.lowest(2) == [30, 31] and f.lowest(5) == [30, 31, 50]
    assert f.lo == 30
    f.take([30, 31, 50])
    assert f.lowest(1) == [] and len(f) == 0
    f.give([1])
    assert f.lo == 1 and f.lowest(1) == [1]


def test_remove_of_the_lowest_keeps_lo_a_bound_and_first_exact() -> None:
    """``remove`` advances ``lo`` past the id it took only when that id was ``lo``; ``first``
    (its fast path reads ``bits[lo]``) stays the lowest free id."""
    f = FreeIds(10, range(10))
    for want in range(1, 5):
        f.remove(want - 1)
        assert f.lo <= want and f.first() == want
    f.remove(7)                       # not the lowest: lo stays
    assert f.first() == 4 and list(f) == [4, 5, 6, 8, 9]
    f.give([2])
    assert f.first() == 2


def test_add_of_a_numpy_integer_keeps_plain_ints() -> None:
    """``lo`` and what ``first`` returns stay plain ints (an Activate's row is journaled as
    one; msgspec refuses numpy integers), whatever integer type ``add`` was given."""
    import numpy as np

    f = FreeIds(10, range(10))
    for i in range(6):
        f.remove(i)
    f.add(np.int64(3))
    assert type(f.lo) is int and type(f.first()) is int and f.first() == 3
