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
    __slots__ = ("capacity", "by_off", "by_size", "live")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.by_off: SortedDict = SortedDict()   # offset -> size (free)
        self.by_size: SortedList = SortedList()  # (size, offset) (free)
        self.live: SortedDict = SortedDict()     # offset -> size (allocated)
        if capacity:
            self._add_free(0, capacity)

    # --- queries (never mutate) ------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return sum(self.by_off.values())

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())

    def best_fit(self, size: int) -> int | None:
        i = self.by_size.bisect_left((_align(size), -1))
        return None if i == len(self.by_size) else self.by_size[i][1]

    def plan(self, releases: Iterable[int], sizes: Sequence[int]) -> list[int] | None:
        """Offsets for ``sizes`` after freeing the live extents at ``releases`` — or None if
        the recipe does not fit. Simulated on a copy; this allocator is unchanged."""
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

    def copy(self) -> ExtentAllocator:
        c = ExtentAllocator(0)
        c.capacity = self.capacity
        c.by_off = SortedDict(self.by_off)
        c.by_size = SortedList(self.by_size)
        c.live = SortedDict(self.live)
        return c

    # --- mutations (apply only) ------------------------------------------------------------
    def _add_free(self, off: int, size: int) -> None:
        self.by_off[off] = size
        self.by_size.add((size, off))

    def _del_free(self, off: int) -> int:
        size = self.by_off.pop(off)
        self.by_size.remove((size, off))
        return size

    def allocate(self, off: int, size: int) -> None:
        """Carve ``size`` bytes at the start of the free extent at ``off``."""
        size = _align(size)
        free = self._del_free(off)
        assert free >= size, f"extent at {off} holds {free} B < {size} B"
        if free > size:
            self._add_free(off + size, free - size)
        self.live[off] = size

    def free(self, off: int) -> None:
        size = self.live.pop(off)
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
        if self.free_bytes + self.live_bytes != self.capacity:
            out.append("host arena: free + live != capacity")
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
