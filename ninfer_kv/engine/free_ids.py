"""``FreeIds``: the free device page groups, slots or rows of a pool (spec §5.2).

A bitmap over the id space, the count of set bits, and ``lo``, a lower bound of the lowest
free id. Commands pick the lowest free ids (locality; nothing depends on contiguity, §4.2):
``lowest(n)`` is one compiled scan from ``lo`` that stops at the ``n``-th free id, so it
touches little more than the ids it returns (and tightens ``lo``). ``take`` (ids leave the
set) keeps ``lo`` a lower bound; ``give`` (ids return) lowers it. A batch costs one compiled
pass, not one tree update per id.

An id is either free or not: giving a free id or taking a taken one raises ``ValueError`` (a
double free is a bug or a damaged journal, and replay stops on it), so "the free list holds
an id twice" cannot be represented. The id space grows (``grow``) for slots, which are
allocated past the end when none is free.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator

import numpy as np

from ninfer_kv.kernels.jit import njit

_INTS = (int, np.integer)


@njit(nogil=True)
def _lowest(bits: np.ndarray, lo: int, n: int) -> tuple[np.ndarray, int]:
    """(the ``n`` lowest set bits at or above ``lo``, the lowest set bit or ``lo``'s new
    bound): one pass from ``lo`` that stops at the ``n``-th hit."""
    out = np.empty(n, np.int64)
    k = 0
    i = lo
    first = -1
    while k < n and i < bits.shape[0]:
        if bits[i]:
            if first < 0:
                first = i
            out[k] = i
            k += 1
        i += 1
    if first < 0:  # nothing free from lo to where the scan stopped
        first = i
    return out[:k], first


@njit(nogil=True)
def _flip(bits: np.ndarray, ids: np.ndarray, want: bool) -> int:
    """Set ``bits[ids]`` to ``not want`` if every one is ``want`` (so no id twice) and in
    range: -1; else the first offending index, with ``bits`` as it was."""
    n = bits.shape[0]
    for j in range(ids.shape[0]):
        i = ids[j]
        if i < 0 or i >= n or bits[i] != want:
            for k in range(j):
                bits[ids[k]] = want
            return j
        bits[i] = not want
    return -1


class FreeIds:
    __slots__ = ("bits", "n", "lo")

    def __init__(self, size: int, ids: Iterable[int] = ()) -> None:
        self.bits = np.zeros(max(size, 1), np.bool_)
        self.n = 0
        self.lo = 0
        self.give(np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)  # 1.4 ms less
                  if isinstance(ids, range) else np.fromiter(ids, np.int64))  # for 65k ids

    # --- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __contains__(self, i: object) -> bool:
        return isinstance(i, _INTS) and 0 <= i < len(self.bits) and bool(self.bits[i])

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.bits).tolist())

    def __repr__(self) -> str:
        return f"FreeIds({list(self)[:8]}{'...' if self.n > 8 else ''}, n={self.n})"

    def lowest(self, n: int) -> list[int]:
        """The ``n`` lowest free ids, ascending (fewer if fewer are free)."""
        if n == 1:  # one id (a COW tail's slot and page): probe from ``lo`` before the scan
            if not self.n:
                return []
            bits, lo = self.bits, self.lo
            for i in range(lo, min(lo + 4, len(bits))):
                if bits[i]:
                    self.lo = i  # nothing below i is free
                    return [i]
        return self.lowest_array(n).tolist()

    def lowest_array(self, n: int) -> np.ndarray:
        """``lowest`` as an int64 array."""
        out, self.lo = _lowest(self.bits, self.lo, min(n, self.n))
        return out

    def first(self) -> int:
        """The lowest free id (``IndexError`` when none is)."""
        if self.n and self.bits[self.lo]:  # ``lo`` bounds the lowest free id from below
            return self.lo
        got = self.lowest(1)
        if not got:
            raise IndexError("no free id")
        return got[0]

    def last(self) -> int:
        """The highest free id (``IndexError`` when none is)."""
        hit = np.flatnonzero(self.bits)
        if not len(hit):
            raise IndexError("no free id")
        return int(hit[-1])

    # --- changing --------------------------------------------------------------------------------
    def take(self, ids: np.ndarray | list[int]) -> None:
        """``ids`` are no longer free; ``ValueError`` (and no change) if one is not free,
        appears twice or lies outside the id space."""
        ids = self._change(ids, True, "which is not free")
        self.n -= len(ids)

    def give(self, ids: np.ndarray | list[int]) -> None:
        """``ids`` become free; ``ValueError`` (and no change) if one already is, appears
        twice or lies outside the id space."""
        ids = self._change(ids, False, "which is already free")
        self.n += len(ids)
        if len(ids):
            self.lo = min(self.lo, int(ids.min()))

    def _change(self, ids: np.ndarray | list[int], free: bool, why: str) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        j = _flip(self.bits, ids, free) if len(ids) else -1
        if j >= 0:
            verb = "take" if free else "give"
            raise ValueError(f"{verb} of id {int(ids[j])} (index {j}), {why} (or appears twice, "
                             f"or lies outside [0, {len(self.bits)}))")
        return ids

    def add(self, i: int) -> None:
        """``give([i])`` for one id, without the array round trip."""
        i = operator.index(i)  # a plain int: ``lo`` is one, and numpy ints do not mix
        if not (0 <= i < len(self.bits)) or self.bits[i]:
            self.give([i])  # raises the ValueError that names the rule
        self.bits[i] = True
        self.n += 1
        if i < self.lo:
            self.lo = i

    def remove(self, i: int) -> None:
        """``take([i])`` for one id, without the array round trip."""
        if not (0 <= i < len(self.bits) and self.bits[i]):
            self.take([i])  # raises the ValueError that names the rule
        self.bits[i] = False
        self.n -= 1
        if i == self.lo:  # it was the lowest free id: the next one up bounds the rest
            self.lo = i + 1

    def grow(self, size: int) -> None:
        """Room for ids below ``size`` (new ids are not free)."""
        if size > len(self.bits):
            bits = np.zeros(max(size, 2 * len(self.bits)), np.bool_)
            bits[:len(self.bits)] = self.bits
            self.bits = bits
