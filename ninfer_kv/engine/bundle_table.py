"""bundle id -> space index of one pool (``PoolState.bundle_index``), for compiled loops.

An open-addressing hash table in one int64 array of shape ``(capacity, 2)``: column 0 holds
a bundle id, ``EMPTY`` or ``GONE`` (a removed entry), column 1 that bundle's space index.

Why a hash table and not an array indexed by bundle id: ids are handed out in order for the
journal's whole life (``apply`` asserts it), so such an array grew by 8 bytes per pool for
every sequence ever admitted and never shrank (a server admitting 1,000 requests a second:
0.7-1.4 GB a day per pool, the array doubling). Here memory follows the spaces that exist.

Invariants (``check``; ``SpaceMap`` in engine/pool.py is the only writer):

* capacity is a power of two, and live plus ``GONE`` entries stay at most half of it, so
  every probe sequence meets an ``EMPTY`` entry;
* each live id is reachable from its home (``home``) by linear probing over non-``EMPTY``
  entries, and appears once;
* every key is a seq id (>= 0), ``EMPTY`` or ``GONE``.

The home of an id is a multiplicative (Fibonacci) hash of it, masked to the capacity. Not the
id itself: long-lived checkpoints left a solid block of entries that the window of
newer ids wrapped onto, and every lookup then stepped over the whole block (a review measured
decode rounds 10-25x slower with 1,000 retained checkpoints). A lookup or insert also stops
after ``capacity`` probes, so a damaged table cannot loop.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.kernels.jit import njit

EMPTY = -1
GONE = -2
MIN_CAPACITY = 64


def new_table(capacity: int = MIN_CAPACITY) -> np.ndarray:
    assert capacity >= 1 and capacity & (capacity - 1) == 0, f"capacity {capacity}: a power of 2"
    return np.full((capacity, 2), EMPTY, np.int64)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio, odd
_S32 = np.uint64(32)


@njit(nogil=True)
def home(bundle: int, mask: int) -> int:
    """The first entry probed for ``bundle`` (>= 0) in a table of ``mask + 1`` entries (at
    most 2**32): Fibonacci hashing, bits 32 and up of ``bundle * 2**64 / phi``. Consecutive
    ids spread evenly, and so do ids a power of two apart."""
    return np.int64(((np.uint64(bundle) * _GOLDEN) >> _S32) & np.uint64(mask))


@njit(nogil=True)
def space_of(table: np.ndarray, bundle: int) -> int:
    """The space index of ``bundle``, or -1 when it has none (a negative id has none).
    Not ``inline="always"``: numba's IR inlining of this loop made a 256-id lookup pass
    4x slower; LLVM inlines the call by itself."""
    if bundle < 0:
        return -1
    mask = table.shape[0] - 1
    h = home(bundle, mask)
    for _ in range(table.shape[0]):
        k = table[h, 0]
        if k == bundle:
            return table[h, 1]
        if k == EMPTY:
            return -1
        h = (h + 1) & mask
    return -1


@njit(nogil=True)
def lookup(table: np.ndarray, bundle: int) -> int:
    """``space_of`` callable from Python (tests, cold paths)."""
    return space_of(table, bundle)


FULL = -1
"""``_place``: no ``EMPTY`` or ``GONE`` entry on the probe path (only a damaged table)."""


@njit(nogil=True)
def _place(table: np.ndarray, bundle: int, index: int) -> int:
    """Put ``bundle`` (absent) at the first ``EMPTY`` or ``GONE`` entry of its probe
    sequence; returns 1 when it took a ``GONE`` entry (one tombstone fewer), else 0, or
    ``FULL`` (nothing written) when a pass over the table found neither."""
    mask = table.shape[0] - 1
    h = home(bundle, mask)
    for _ in range(table.shape[0]):
        k = table[h, 0]
        if k < 0:
            table[h, 0] = bundle
            table[h, 1] = index
            return 1 if k == GONE else 0
        h = (h + 1) & mask
    return FULL


@njit(nogil=True)
def _remove(table: np.ndarray, bundle: int) -> bool:
    mask = table.shape[0] - 1
    h = home(bundle, mask)
    for _ in range(table.shape[0]):
        k = table[h, 0]
        if k == bundle:
            table[h, 0] = GONE
            table[h, 1] = EMPTY
            return True
        if k == EMPTY:
            return False
        h = (h + 1) & mask
    return False


@njit(nogil=True)
def _rebuilt(table: np.ndarray, capacity: int) -> np.ndarray:
    """The live entries of ``table`` in a fresh one of ``capacity`` entries (more than
    twice as many: every placement finds room)."""
    out = np.full((capacity, 2), EMPTY, np.int64)
    for h in range(table.shape[0]):
        if table[h, 0] >= 0:
            _place(out, table[h, 0], table[h, 1])
    return out


@njit(nogil=True)
def unreachable(table: np.ndarray) -> np.ndarray:
    """Entries holding a live id that probing for that id does not stop at: stops earlier
    (the id is listed twice) or never (an ``EMPTY`` entry or a full pass comes first). One
    compiled pass: ``check`` runs in every full §14 check."""
    mask = table.shape[0] - 1
    out = np.empty(table.shape[0], np.int64)
    n = 0
    for h in range(table.shape[0]):
        b = table[h, 0]
        if b < 0:
            continue
        g = home(b, mask)
        for _ in range(table.shape[0]):
            k = table[g, 0]
            if k == b or k == EMPTY:
                break
            g = (g + 1) & mask
        if g != h or table[g, 0] != b:
            out[n] = h
            n += 1
    return out[:n]


class BundleTable:
    """The table of one pool and its counts. ``array`` is what compiled loops take; it is
    replaced (never resized in place) when the table is rebuilt."""

    __slots__ = ("array", "live", "gone")

    def __init__(self) -> None:
        self.array = new_table()
        self.live = 0
        self.gone = 0

    def insert(self, bundle: int, index: int) -> None:
        """Map ``bundle`` (not in the table: ``SpaceMap`` asserts it) to ``index``."""
        assert bundle >= 0 and index >= 0, f"bundle {bundle} -> space index {index}"
        cap = self.array.shape[0]
        if 2 * (self.live + self.gone + 1) > cap:  # keep an EMPTY entry on every probe path
            while 4 * (self.live + 1) > cap:
                cap *= 2
            while cap > MIN_CAPACITY and 8 * (self.live + 1) < cap:
                cap //= 2
            self.array = _rebuilt(self.array, cap)
            self.gone = 0
        took = _place(self.array, bundle, index)
        assert took != FULL, f"bundle table of {cap} entries has no free entry (damaged)"
        self.gone -= took
        self.live += 1

    def remove(self, bundle: int) -> None:
        """Unmap ``bundle``; one already absent (a damaged state lost it: §14 reports that
        before) is left absent, so the event dropping its space applies whole."""
        if _remove(self.array, bundle):
            self.live -= 1
            self.gone += 1

    def items(self) -> dict[int, int]:
        """bundle -> space index of every live entry."""
        keys = self.array[:, 0]
        live = keys >= 0
        return dict(zip(keys[live].tolist(), self.array[live, 1].tolist(), strict=True))

    def check(self) -> list[str]:
        """What breaks the invariants above (empty when none)."""
        a = self.array
        cap = a.shape[0]
        out = []
        if cap < 1 or cap & (cap - 1):
            return [f"bundle table capacity {cap} is not a power of two"]
        keys = a[:, 0]
        for h in np.flatnonzero(keys < GONE)[:4].tolist():  # probing treats one as GONE
            out.append(f"bundle table entry {h} holds key {int(keys[h])}: neither a seq id "
                       f"nor EMPTY ({EMPTY}) / GONE ({GONE})")
        live, gone = int((keys >= 0).sum()), int((keys == GONE).sum())
        if (live, gone) != (self.live, self.gone):
            out.append(f"bundle table counts {self.live} live / {self.gone} removed, holds "
                       f"{live} / {gone}")
        if 2 * (live + gone) > cap:
            out.append(f"bundle table of {cap} entries holds {live} live and {gone} removed "
                       "ones: past half full, a probe may not meet an empty entry")
        for h in unreachable(a).tolist():
            b = int(keys[h])
            out.append(f"bundle {b} at entry {h} is not found by probing from its home "
                       f"{home(b, cap - 1)} (or is listed twice)")
        return out


def from_dense(dense: np.ndarray) -> np.ndarray:
    """The table of a dense map (``dense[bundle]`` = space index, -1 = none): for tests and
    tools that state a pool's map as an array."""
    t = BundleTable()
    for b in np.flatnonzero(np.asarray(dense) >= 0).tolist():
        t.insert(b, int(dense[b]))
    return t.array
