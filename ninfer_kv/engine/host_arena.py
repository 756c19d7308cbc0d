"""HostKVArena: one startup-fixed host buffer and its bounded variable-size extent allocator
(spec §3.3, §5.3).

* ``ExtentAllocator`` is logical state (it lives in ``StoreState`` and only ``apply`` mutates
  it): free extents indexed by offset and by (size, offset); best fit — the smallest free
  extent that holds the request, lowest offset on ties; freed extents coalesce with their
  neighbours. Invariant: ``free_bytes + sum(live extent sizes) == capacity`` and no two
  extents (free or live) overlap.
* ``plan`` proves that a whole recipe of releases and allocations fits the extent geometry
  before any event is emitted (free_bytes alone is no proof, spec §5.3).
* ``HostArenaBuffer`` is the data: pinned torch memory (plain memory without CUDA), or a file
  mapped with mmap when the store has a persistence directory, flushed before a publish.

Extents are charged by real packed bytes (``pages * PageBytes`` of their pool, §5.3), so Main
and backend layouts of different strides share one arena.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Sequence

import torch
from sortedcontainers import SortedDict, SortedList

from ninfer_kv.journal.fs import open_private

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ExtentAllocator:
    """Free and live extents. ``free_total`` / ``live_total`` are running sums of their sizes
    (so occupancy is O(1)); ``violations`` recomputes them."""

    __slots__ = ("capacity", "by_off", "by_size", "live", "free_total", "live_total")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.by_off: SortedDict = SortedDict()   # offset -> size (free)
        self.by_size: SortedList = SortedList()  # (size, offset) (free)
        self.live: SortedDict = SortedDict()     # offset -> size (allocated)
        self.free_total = 0
        self.live_total = 0
        if capacity:
            self._add_free(0, capacity)

    @classmethod
    def restore(cls, capacity: int, free: Iterable[tuple[int, int]],
                live: Iterable[tuple[int, int]]) -> ExtentAllocator:
        """The allocator a snapshot describes: free and live (offset, size) extents."""
        h = cls(0)
        h.capacity = capacity
        for off, size in free:
            h._add_free(off, size)
        h.live = SortedDict(dict(live))
        h.live_total = sum(h.live.values())
        return h

    # --- queries (never mutate) ------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.free_total

    @property
    def live_bytes(self) -> int:
        return self.live_total

    def best_fit(self, size: int) -> int | None:
        i = self.by_size.bisect_left((_align(size), -1))
        return None if i == len(self.by_size) else self.by_size[i][1]

    def plan(self, releases: Iterable[int], sizes: Sequence[int]) -> list[int] | None:
        """Offsets for ``sizes`` after freeing the live extents at ``releases`` — or None if
        the recipe does not fit. This allocator is unchanged. Without releases (every
        ``offload``) best fit runs on an overlay — O(len(sizes) log n), not a copy of the
        index."""
        releases = list(releases)
        if not releases:
            return self._plan_overlay(sizes)
        sim = self.copy()
        for off in releases:
            sim.free(off)
        out = []
        for size in sizes:
            off = sim.best_fit(size)
            if off is None:
                return None
            sim.allocate(off, size)
            out.append(off)
        return out

    def _plan_overlay(self, sizes: Sequence[int]) -> list[int] | None:
        """``plan([], sizes)``: allocate carves the head of the best-fit extent and frees
        nothing, so the free set after each step is the original extents not yet carved
        (``used``) plus the remainders this plan made (``rest``)."""
        used: set[int] = set()
        rest = SortedList()
        cursor: dict[int, int] = {}  # per size: index in by_size before which all is too small/used
        out = []
        for size in sizes:
            need = _align(size)
            i = cursor.get(need)
            if i is None:
                i = self.by_size.bisect_left((need, -1))
            while i < len(self.by_size) and self.by_size[i][1] in used:
                i += 1
            cursor[need] = i
            orig = self.by_size[i] if i < len(self.by_size) else None
            j = rest.bisect_left((need, -1))
            mine = rest[j] if j < len(rest) else None
            if orig is None and mine is None:
                return None
            if mine is not None and (orig is None or mine < orig):
                rest.pop(j)
                free, off = mine
            else:
                assert orig is not None
                used.add(orig[1])
                free, off = orig
            if free > need:
                rest.add((free - need, off + need))
            out.append(off)
        return out

    def copy(self) -> ExtentAllocator:
        c = ExtentAllocator(0)
        c.capacity = self.capacity
        c.by_off = SortedDict(self.by_off)
        c.by_size = SortedList(self.by_size)
        c.live = SortedDict(self.live)
        c.free_total, c.live_total = self.free_total, self.live_total
        return c

    # --- mutations (apply only) ------------------------------------------------------------
    def _add_free(self, off: int, size: int) -> None:
        self.by_off[off] = size
        self.by_size.add((size, off))
        self.free_total += size

    def _del_free(self, off: int) -> int:
        size = self.by_off.pop(off)
        self.by_size.remove((size, off))
        self.free_total -= size
        return size

    def allocate(self, off: int, size: int) -> None:
        """Carve ``size`` bytes at the start of the free extent at ``off``."""
        size = _align(size)
        free = self._del_free(off)
        assert free >= size, f"extent at {off} holds {free} B < {size} B"
        if free > size:
            self._add_free(off + size, free - size)
        self.live[off] = size
        self.live_total += size

    def free(self, off: int) -> None:
        size = self.live.pop(off)
        self.live_total -= size
        i = self.by_off.bisect_left(off)
        if i > 0:  # coalesce with the free extent before
            prev = self.by_off.keys()[i - 1]
            if prev + self.by_off[prev] == off:
                off, size = prev, size + self._del_free(prev)
        nxt = off + size
        if nxt in self.by_off:  # ... and the one after
            size += self._del_free(nxt)
        self._add_free(off, size)

    def violations(self) -> list[str]:
        out = []
        spans = sorted([(o, s, "free") for o, s in self.by_off.items()]
                       + [(o, s, "live") for o, s in self.live.items()])
        pos = 0
        for o, s, kind in spans:
            if o != pos:
                out.append(f"host arena: gap or overlap at {pos} (next {kind} extent at {o})")
            pos = o + s
        if pos != self.capacity:
            out.append(f"host arena: extents end at {pos}, capacity {self.capacity}")
        free, live = sum(self.by_off.values()), sum(self.live.values())
        if free + live != self.capacity:
            out.append("host arena: free + live != capacity")
        if (free, live) != (self.free_total, self.live_total):
            out.append(f"host arena: running totals free {self.free_total} / live "
                       f"{self.live_total} B, extents sum to {free} / {live} B")
        if sorted(self.by_size) != sorted((s, o) for o, s in self.by_off.items()):
            out.append("host arena: size index out of step with offset index")
        return out


class HostArenaBuffer:
    """The bytes: pinned memory, plain memory, or a persistent mmap'ed file."""

    def __init__(self, capacity: int, path: str | None = None, pin: bool | None = None) -> None:
        self.capacity = capacity
        self.path = path
        self._mmap: mmap.mmap | None = None
        if path is not None:
            # the caller validated the journal against this capacity before calling (a refused
            # open never resizes the file); a size that still differs is a damaged file, whose
            # checkpoints recovery then drops by their CRCs
            self._fd = open_private(path, os.O_RDWR | os.O_CREAT)
            try:
                if os.fstat(self._fd).st_size != capacity:
                    os.ftruncate(self._fd, capacity)
                if capacity:  # every block now: a sparse file that the disk cannot fill later
                    os.posix_fallocate(self._fd, 0, capacity)  # faults (SIGBUS) in a D2H copy
                self._mmap = mmap.mmap(self._fd, capacity) if capacity else None
            except OSError:
                os.close(self._fd)
                raise
            self.data = (torch.frombuffer(self._mmap, dtype=torch.uint8) if capacity
                         else torch.empty(0, dtype=torch.uint8))
        else:
            pin = torch.cuda.is_available() if pin is None else pin
            self.data = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)

    def pages(self, offset: int, n: int, page_bytes: int) -> torch.Tensor:
        """The packed host pages of an extent as a ``[n, page_bytes]`` view."""
        return self.data[offset:offset + n * page_bytes].view(n, page_bytes)

    def flush(self) -> None:
        """Make written bytes durable before their publish event is journaled."""
        if self._mmap is not None:
            self._mmap.flush()

    def close(self) -> None:
        if self._mmap is not None:
            del self.data
            self._mmap.close()
            os.close(self._fd)
            self._mmap = None
