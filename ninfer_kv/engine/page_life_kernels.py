"""The compiled half of a page's life (engine/page_life.py; spec §5.1, §5.3, §14): memberships
judged (``membership_fault``), references dropped (``unref_slots``), garbage found
(``dead_slots``) and collected (``free_dead``).

Like engine/apply_kernels.py, these kernels write the pool's arrays and only ``apply`` calls
them; each refuses (a code or the first bad index, nothing changed) what a damaged journal
could break before it writes, because numba does not bounds-check.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine.pages import PG_ACTIVE, PG_DEVICE, PG_GEN, PG_PINS, PG_REFS, PG_WRITER
from ninfer_kv.engine.round_kernels import OK
from ninfer_kv.kernels.jit import njit


@njit(nogil=True)
def dead_slots(slots: np.ndarray, pg_refs: np.ndarray, pg_pins: np.ndarray) -> np.ndarray:
    """The distinct slots of ``slots`` with no reference and no pin (garbage, §5.3),
    ascending."""
    out = np.empty(slots.shape[0], np.int64)
    k = 0
    for j in range(slots.shape[0]):
        s = slots[j]
        if pg_refs[s] == 0 and pg_pins[s] == 0:
            out[k] = s
            k += 1
    return np.unique(out[:k])


@njit(nogil=True)
def unref_slots(slots: np.ndarray, bundle: int, active: bool, pg_live: np.ndarray,
                pg_refs: np.ndarray, pg_active: np.ndarray, pg_writer: np.ndarray,
                pg_pins: np.ndarray, pg_device: np.ndarray, page_bits: np.ndarray,
                slot_bits: np.ndarray) -> int:
    """A space drops its references to ``slots`` (an active space also its writer right):
    ``unref``'s counting half, a slot listed twice counted twice. Refused whole (the first
    bad index returned, nothing changed; -1 when done) unless every slot is a live page
    holding a reference (a membership holds live pages only, §14) and every page left
    without references or pins can be freed (``freeable``: ``collect`` then cannot fail)."""
    for j in range(slots.shape[0]):
        s = slots[j]
        if s < 0 or s >= pg_live.shape[0] or not pg_live[s] or pg_refs[s] <= 0:
            return j
    for j in range(slots.shape[0]):
        pg_refs[slots[j]] -= 1
    for j in range(slots.shape[0]):
        s = slots[j]
        if pg_refs[s] > 0 or (pg_refs[s] == 0 and pg_pins[s] != 0):
            continue
        d = pg_device[s]  # garbage (or refs below zero): freeable(s), inlined
        if pg_refs[s] < 0 or s >= slot_bits.shape[0] or slot_bits[s] or (
                d != -1 and (d < 0 or d >= page_bits.shape[0] or page_bits[d])):
            for k in range(slots.shape[0]):  # undone: the counts as they were
                pg_refs[slots[k]] += 1
            return j
    for j in range(slots.shape[0]):
        s = slots[j]
        if active:
            pg_active[s] -= 1
            if pg_writer[s] == bundle:
                pg_writer[s] = -1
    return -1


@njit(nogil=True)
def membership_fault(slots: np.ndarray, pg_live: np.ndarray) -> int:
    """-1 when ``slots`` (a membership, by logical block) names distinct live pages (§14), else
    the first block naming a slot outside the pool, a dead page, or (then) one an earlier block
    names too. numba indexes without bounds checks and wraps a negative index, so every
    handler reads a membership through this (``page_life.members_of``) before it writes."""
    n = slots.shape[0]
    for k in range(n):
        s = slots[k]
        if s < 0 or s >= pg_live.shape[0] or not pg_live[s]:
            return k
    if n < 2:
        return -1
    lo, hi = slots.min(), slots.max()
    seen = np.zeros(((hi - lo) >> 6) + 1, np.uint64)  # a bit per slot in [lo, hi]: O(n)
    for k in range(n):
        d = slots[k] - lo
        bit = np.uint64(1) << np.uint64(d & 63)
        if seen[d >> 6] & bit:
            return k
        seen[d >> 6] |= bit
    return -1


@njit(nogil=True)
def first_unfreeable(slots: np.ndarray, pg_live: np.ndarray, pg_device: np.ndarray,
                     page_bits: np.ndarray, slot_bits: np.ndarray) -> int:
    """The first index of ``slots`` that is not ``freeable``, or -1."""
    for j in range(slots.shape[0]):
        if not freeable(slots[j], pg_live, pg_device, page_bits, slot_bits):
            return j
    return -1


@njit(nogil=True)
def freeable(s: int, pg_live: np.ndarray, pg_device: np.ndarray, page_bits: np.ndarray,
             slot_bits: np.ndarray) -> bool:
    """Slot ``s`` is a live page whose slot and device page group (if any) are leased, so
    garbage collection can give both back (§5.3). ``unref_slots`` and ``free_dead`` inline
    this test: a call per slot costs ~45 ns there (numba does not inline it), 4x their loop."""
    if s < 0 or s >= slot_bits.shape[0] or s >= pg_live.shape[0]:
        return False
    if not pg_live[s] or slot_bits[s]:
        return False
    d = pg_device[s]
    if d == -1:
        return True
    if d < 0 or d >= page_bits.shape[0]:
        return False
    return not page_bits[d]


@njit(nogil=True)
def free_dead(dead: np.ndarray, pg_live: np.ndarray, pg_device: np.ndarray,
              pg_gen: np.ndarray, page_bits: np.ndarray, slot_bits: np.ndarray
              ) -> tuple[int, int, int, int]:
    """``collect``'s freeing half for the distinct garbage slots ``dead``: device page groups
    and slots back to their free lists, generations advanced (§5.3). Checked first: every
    slot live and not free, every page group in range and not free — else (j, 0, 0, 0) with
    the first bad index and nothing changed. Returns (-1, page groups freed, lowest page
    group freed or -1, lowest slot)."""
    for j in range(dead.shape[0]):
        s = dead[j]  # freeable(s), inlined
        if s < 0 or s >= slot_bits.shape[0] or s >= pg_live.shape[0]:
            return j, 0, 0, 0
        d = pg_device[s]
        if not pg_live[s] or slot_bits[s] or (d != -1 and (d < 0 or d >= page_bits.shape[0]
                                                            or page_bits[d])):
            return j, 0, 0, 0
    freed = 0
    low = -1
    for j in range(dead.shape[0]):
        s = dead[j]
        d = pg_device[s]
        if d != -1:
            page_bits[d] = True
            freed += 1
            if low < 0 or d < low:
                low = d
        pg_device[s] = -1
        pg_live[s] = False
        pg_gen[s] += 1
        slot_bits[s] = True
    return -1, freed, low, dead[0] if dead.shape[0] else -1


MEMBERS_FAULT, UNREF_FAULT = 1, 2
"""``drop_membership``'s refusals (else ``OK``): the membership breaks §14 (a length outside
its row, a slot that is no live page or one an earlier block names), or a page it names
cannot drop a reference (``unref_slots``' rule)."""


@njit(nogil=True)
def membership_of(i: int, sp_members: np.ndarray, sp_nmem: np.ndarray, pg_live: np.ndarray
                  ) -> tuple[np.ndarray, int]:
    """Space ``i``'s membership (a view of its row) and -1 when it is sound
    (``page_life.members_of``'s rule: a length within its row, distinct live pages), else
    the first bad block (-2: a length outside its row)."""
    n = sp_nmem[i]
    if n < 0 or n > sp_members.shape[1]:
        return sp_members[i, :0], -2
    slots = sp_members[i, :n]
    return slots, membership_fault(slots, pg_live)


@njit(nogil=True)
def drop_membership(i: int, keep: int, bundle: int, active: bool, sp_members: np.ndarray,
                    sp_nmem: np.ndarray, pg_live: np.ndarray, pg: np.ndarray,
                    page_bits: np.ndarray, slot_bits: np.ndarray
                    ) -> tuple[int, int, int, int, int, int]:
    """``page_life.unref`` of the blocks from ``keep`` (>= 0) of space ``i``'s membership
    (``members_of`` of the whole first) in one call, for a pool that holds no host replica
    (Finish without retention and Release: ``keep`` 0; Trim): the membership judged, the
    references of its blocks from ``keep`` dropped (``unref_slots``, which checks that every
    page left as garbage can be freed), then the garbage collected (``free_dead``). The
    membership's length is the caller's to cut. Returns (code, j, page groups freed, the
    lowest freed or -1, slots freed, the lowest freed or -1): on ``MEMBERS_FAULT`` (``j`` the
    block, -2 a bad length) or ``UNREF_FAULT`` (``j`` the block) nothing changed."""
    pg_refs, pg_pins, pg_device = pg[PG_REFS], pg[PG_PINS], pg[PG_DEVICE]
    whole, k = membership_of(i, sp_members, sp_nmem, pg_live)
    if k != -1:
        return MEMBERS_FAULT, k, 0, -1, 0, -1
    keep = min(keep, whole.shape[0])
    slots = whole[keep:]
    j = unref_slots(slots, bundle, active, pg_live, pg_refs, pg[PG_ACTIVE], pg[PG_WRITER],
                    pg_pins, pg_device, page_bits, slot_bits)
    if j >= 0:
        return UNREF_FAULT, keep + j, 0, -1, 0, -1
    # collect: ``dead_slots`` without its sort (a membership names each slot once), then
    # ``free_dead``, which cannot refuse: unref_slots checked every garbage page freeable
    dead = np.empty(slots.shape[0], np.int64)
    n_dead = 0
    low_slot = -1
    for k in range(slots.shape[0]):
        s = slots[k]
        if pg_refs[s] == 0 and pg_pins[s] == 0:
            dead[n_dead] = s
            n_dead += 1
            low_slot = s if low_slot < 0 else min(low_slot, s)
    j, freed, low, _ = free_dead(dead[:n_dead], pg_live, pg_device, pg[PG_GEN], page_bits,
                                 slot_bits)
    assert j < 0
    return OK, -1, freed, low, n_dead, low_slot
