"""The full §14 check's per-membership pass, compiled (numba ``njit``; engine/invariants.py).

``violations()`` counts each page's memberships and checks each block of every address space.
Done with numpy per space it cost ~35 µs a space (a dozen small-array calls), most of a
replay's closing check; here it is one pass over all memberships. It only reads the state;
``invariants.py`` words every problem it reports.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine.bundle_table import space_of
from ninfer_kv.engine.layout import P
from ninfer_kv.kernels.jit import njit

DEAD, SHORT, NO_DEVICE = 1, 2, 3
"""``scan_memberships``' problems with a block: its slot holds no live page; the page holds
fewer committed columns than the frontier needs; an active space's page has no device
replica."""


@njit(nogil=True)
def scan_memberships(bundles: np.ndarray, idx: np.ndarray, sp_members: np.ndarray,
                     sp_nmem: np.ndarray, sp_committed: np.ndarray, sp_active: np.ndarray,
                     n_slots: int, pg_live: np.ndarray, pg_committed: np.ndarray,
                     pg_device: np.ndarray, no_page: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One pass over the memberships of spaces ``idx`` (of ``bundles``, in that order):

    - ``refs`` / ``arefs``: per slot, the memberships (active ones) that name it (length
      ``size`` = ``n_slots`` or past the largest member);
    - ``twice``: per space, a slot named twice (or a length past the membership array, or
      negative);
    - ``keys``: ``bundle * size + slot`` of every active membership (the writer check);
    - ``problems``: rows (space position, block, kind, columns needed), in space order then
      block order, for each block whose slot is dead (or negative: it names no page, so it is
      counted nowhere), whose page holds fewer
      committed columns than ``committed - block * P`` (at most P), or, in an active space,
      whose page has no device replica."""
    size = n_slots
    total = 0
    for k in range(idx.shape[0]):
        i = idx[k]
        m = min(sp_nmem[i], sp_members.shape[1])
        total += max(m, 0)
        for j in range(m):
            if sp_members[i, j] + 1 > size:
                size = sp_members[i, j] + 1
    refs = np.zeros(size, np.int64)
    arefs = np.zeros(size, np.int64)
    seen = np.full(size, -1, np.int64)
    twice = np.zeros(idx.shape[0], np.bool_)
    keys = np.empty(total, np.int64)
    problems = np.empty((2 * total, 4), np.int64)
    nk = npr = 0
    for k in range(idx.shape[0]):
        i = idx[k]
        c = sp_committed[i]
        act = sp_active[i]
        m = sp_nmem[i]
        if m > sp_members.shape[1] or m < 0:  # a length that counts no membership
            twice[k] = True
            m = min(max(m, 0), sp_members.shape[1])
        for j in range(m):
            s = sp_members[i, j]
            if s < 0 or s >= n_slots or not pg_live[s]:
                problems[npr, 0], problems[npr, 1], problems[npr, 2], problems[npr, 3] = \
                    k, j, DEAD, 0
                npr += 1
                if s < 0:  # damage only: no counts; twice if it repeats an earlier block
                    for jj in range(j):
                        if sp_members[i, jj] == s:
                            twice[k] = True
                    continue
            refs[s] += 1
            if seen[s] == k:
                twice[k] = True
            seen[s] = k
            if act:
                arefs[s] += 1
                keys[nk] = bundles[k] * size + s
                nk += 1
            if s >= n_slots or not pg_live[s]:
                continue
            need = min(max(c - P * j, 0), P)
            if pg_committed[s] < need:
                problems[npr, 0], problems[npr, 1], problems[npr, 2], problems[npr, 3] = \
                    k, j, SHORT, need
                npr += 1
            if act and pg_device[s] == no_page:
                problems[npr, 0], problems[npr, 1], problems[npr, 2], problems[npr, 3] = \
                    k, j, NO_DEVICE, 0
                npr += 1
    return refs, arefs, twice, keys[:nk], problems[:npr]


ABSENT = -(1 << 63)
"""``check_commit``'s mirror: no space of that bundle seen."""

C_NO_SPACE, C_ORDER, C_DEAD, C_SHORT, C_RANGE, C_NEGATIVE = 1, 2, 3, 4, 5, 6
"""``check_commit``'s problems: a bundle without a space (in the pool or the checker's
mirror); frontiers out of order; a dead slot, short columns or columns out of range in a
block the commit moved across; a negative slot (the caller raises as a page read would)."""


@njit(nogil=True)
def check_commit(b_raw: bytes, bundle_index: np.ndarray, sp_committed: np.ndarray,
                 sp_nmem: np.ndarray, sp_protected: np.ndarray, sp_members: np.ndarray,
                 n_slots: int, pg_live: np.ndarray, pg_committed: np.ndarray,
                 pg_protected: np.ndarray, mirror_index: np.ndarray, mirror: np.ndarray
                 ) -> np.ndarray:
    """The incremental checker's CommitFrontiers (``incremental_index.check_commit``), after
    apply, on the event's packed seqs: per bundle, ``protected <= committed <= membership``,
    then every block between the committed frontier the checker last saw (``mirror[k]``,
    updated here; ``k`` is ``b``'s entry in the bundle table ``mirror_index``) and the new
    one holds a live page with the columns the frontier needs and columns in range. Returns
    problem rows (kind, bundle or slot, then the values the message names), in order; a
    negative slot is the last row."""
    bundles = np.frombuffer(b_raw, np.int32)
    rows = np.empty((max(8, 2 * bundles.shape[0]), 6), np.int64)
    n = 0
    for j in range(bundles.shape[0]):
        if n + 2 >= rows.shape[0]:  # at most two rows per block: room for the next block
            grown = np.empty((2 * rows.shape[0], 6), np.int64)
            grown[:n] = rows[:n]
            rows = grown
        b = bundles[j]
        k = space_of(bundle_index, b)
        km = space_of(mirror_index, b)
        oc = mirror[km] if 0 <= km < mirror.shape[0] else ABSENT
        if k < 0 or oc == ABSENT:
            rows[n, 0], rows[n, 1] = C_NO_SPACE, b
            n += 1
            continue
        c, m = sp_committed[k], sp_nmem[k]
        mirror[km] = c
        if not sp_protected[k] <= c <= m * P:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3], rows[n, 4] = \
                C_ORDER, b, sp_protected[k], c, m * P
            n += 1
        if oc < c:
            i, hi = oc // P, (c + P - 1) // P
        else:
            i, hi = c // P, (oc + P - 1) // P
        hi = min(hi, m, sp_members.shape[1])
        i = max(i, 0)  # a negative frontier (damage, reported above or at its event): from 0
        while i < hi:
            if n + 2 >= rows.shape[0]:
                grown = np.empty((2 * rows.shape[0], 6), np.int64)
                grown[:n] = rows[:n]
                rows = grown
            s = sp_members[k, i]
            if s < 0:
                rows[n, 0], rows[n, 1] = C_NEGATIVE, s
                return rows[:n + 1]
            if s >= n_slots or not pg_live[s]:
                rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = C_DEAD, b, i, s
                n += 1
            else:
                pc, pr = pg_committed[s], pg_protected[s]
                need = min(c - i * P, P)
                if pc < need:
                    rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3], rows[n, 4], rows[n, 5] = \
                        C_SHORT, b, i, s, pc, need
                    n += 1
                if not 0 <= pr <= pc <= P:
                    rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = C_RANGE, s, pr, pc
                    n += 1
            i += 1
    return rows[:n]


B_DEAD, B_SHORT, B_RANGE, B_INDEX = 1, 2, 3, 4
"""``check_blocks``' rows."""


@njit(nogil=True)
def check_blocks(members: np.ndarray, nmem: int, c: int, lo: int, hi: int, k: int,
                 n_slots: int, pg_live: np.ndarray, pg_committed: np.ndarray,
                 pg_protected: np.ndarray) -> np.ndarray:
    """The incremental checker's frontier-block check (``incremental_index.columns``) on
    blocks ``lo..hi`` of a membership (``members[:nmem]``) at committed frontier ``c``: each
    holds the columns the frontier needs; blocks below ``k`` also hold a live page with its
    columns in range. Rows (kind, block, slot, x, y): ``B_DEAD`` (slot), ``B_SHORT`` (slot,
    committed, need), ``B_RANGE`` (slot, protected, committed), ``B_INDEX`` (a block or slot
    no list index reaches: the caller raises IndexError as a list read did; the rows before
    it stand). A negative block counts from the end, as a list index does (a negative
    frontier: damage the space checks report)."""
    rows = np.empty((max(hi - lo, 0) * 2 + 1, 5), np.int64)
    n = 0
    for i in range(lo, hi):
        j = i if i >= 0 else nmem + i
        if not 0 <= j < nmem:
            rows[n, 0], rows[n, 1] = B_INDEX, i
            return rows[:n + 1]
        s = members[j]
        if s < 0:
            rows[n, 0], rows[n, 1], rows[n, 2] = B_INDEX, i, s
            return rows[:n + 1]
        if s >= n_slots or not pg_live[s]:
            if i < k:
                rows[n, 0], rows[n, 1], rows[n, 2] = B_DEAD, i, s
                n += 1
            continue
        pc = pg_committed[s]
        need = min(c - i * P, P)
        if pc < need:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3], rows[n, 4] = B_SHORT, i, s, pc, need
            n += 1
        if i < k and not 0 <= pg_protected[s] <= pc <= P:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3], rows[n, 4] = \
                B_RANGE, i, s, pg_protected[s], pc
            n += 1
    return rows[:n]


@njit(nogil=True)
def _active(space_index: np.ndarray, space_active: np.ndarray, b: int) -> bool:
    """Whether the mirror holds ``b`` as an active space (an id it does not hold: no)."""
    k = space_of(space_index, b)
    return 0 <= k < space_active.shape[0] and space_active[k] != 0


# check_slots' rows: (kind, a, b, c); incremental_index.check_pages words them in order
(K_RELEASED_NOT_FREE, K_OUT_OF_RANGE, K_DOUBLE_LEASE, K_LEASE_OUTSIDE, K_ON_FREE_LIST,
 K_FREE_SLOT_LIVE, K_DEAD_REFS, K_REFS, K_ACTIVE_REFS, K_COLUMNS, K_WRITER, K_SHARED_WRITER,
 K_NO_DEVICE, K_PINS, K_NOT_RECYCLED, K_MIRROR_SHORT, K_WRITER_NOT_MEMBER, K_LOST) = range(1, 19)
NO = -1  # pages.NO_PAGE (a slot without a device lease; a page without a writer)


@njit(nogil=True)
def check_slots(slots: np.ndarray, n_slots: int, pg_live: np.ndarray, pg_device: np.ndarray,
                pg_refs: np.ndarray, pg_active: np.ndarray, pg_pins: np.ndarray,
                pg_protected: np.ndarray, pg_committed: np.ndarray, pg_writer: np.ndarray,
                pg_host_off: np.ndarray, free_slot_bits: np.ndarray, free_page_bits: np.ndarray,
                capacity: int, n_mirror: int, refs: np.ndarray, arefs: np.ndarray,
                owners: np.ndarray, space_index: np.ndarray,
                space_active: np.ndarray, dev: np.ndarray, lease: np.ndarray,
                want: np.ndarray) -> tuple[np.ndarray, int]:
    """The incremental checker's page checks on ``slots`` (each >= 0), in slot order, after
    moving its own device-lease index to what each page holds now: ``dev`` (slot -> device
    page seen) and ``lease`` (device page in [0, capacity) -> slot, -1 none). ``refs`` /
    ``arefs``: the memberships / active memberships it counted per slot; ``owners``: per slot
    the XOR of the seqs whose memberships hold it (with one membership: that seq);
    ``space_active``: 1 when a seq has an active space, at its entry in the bundle table
    ``space_index``; ``want``: per element of
    ``slots``, the pins its pending transfers and queued copies explain.

    Returns (rows, change of the number of leased pages in range). A row names one problem,
    or asks the caller to finish a check it keeps outside: ``K_LEASE_OUTSIDE`` (a lease of a
    device page id outside [0, capacity), kept in a dict), ``K_WRITER`` (is the writer of a
    page in several memberships an active member: the caller's space mirror),
    ``K_MIRROR_SHORT`` (the slot is at or past ``n_mirror``, the slots the mirror has seen, or
    past its arrays: the caller raises; every slot before it was checked). A slot at or past
    ``n_slots`` reads as dead."""
    rows = np.empty((64, 4), np.int64)
    n = 0
    leased = 0
    nfp = free_page_bits.shape[0]
    for j in range(slots.shape[0]):
        if n + 16 > rows.shape[0]:  # at most 13 rows per slot
            grown = np.empty((2 * rows.shape[0], 4), np.int64)
            grown[:n] = rows[:n]
            rows = grown
        s = slots[j]
        if s >= n_mirror or s >= refs.shape[0]:
            rows[n, 0], rows[n, 1] = K_MIRROR_SHORT, s
            return rows[:n + 1], leased
        live = s < n_slots and pg_live[s]
        old = dev[s]
        new = pg_device[s] if live else NO
        if old != new:
            if old != NO:
                if 0 <= old < capacity:
                    if lease[old] == s:
                        lease[old] = NO
                        leased -= 1
                else:
                    rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_LEASE_OUTSIDE, old, s, 0
                    n += 1
                if not (0 <= old < nfp and free_page_bits[old]):
                    rows[n, 0], rows[n, 1], rows[n, 2] = K_RELEASED_NOT_FREE, old, s
                    n += 1
            if new != NO:
                if 0 <= new < capacity:
                    o = lease[new]
                    if o == NO:
                        lease[new] = s
                        leased += 1
                    elif o != s:
                        rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_DOUBLE_LEASE, new, o, s
                        n += 1
                else:
                    rows[n, 0], rows[n, 1], rows[n, 2] = K_OUT_OF_RANGE, new, s
                    n += 1
                    rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_LEASE_OUTSIDE, new, s, 1
                    n += 1
                if 0 <= new < nfp and free_page_bits[new]:
                    rows[n, 0], rows[n, 1], rows[n, 2] = K_ON_FREE_LIST, new, s
                    n += 1
            dev[s] = new
        if live and s < free_slot_bits.shape[0] and free_slot_bits[s]:
            rows[n, 0], rows[n, 1] = K_FREE_SLOT_LIVE, s
            n += 1
        if not live:
            if refs[s]:
                rows[n, 0], rows[n, 1], rows[n, 2] = K_DEAD_REFS, s, refs[s]
                n += 1
            continue
        r, a, pr = refs[s], arefs[s], pg_refs[s]
        if pr != r:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_REFS, s, pr, r
            n += 1
        if pg_active[s] != a:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_ACTIVE_REFS, s, pg_active[s], a
            n += 1
        if not 0 <= pg_protected[s] <= pg_committed[s] <= P:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = \
                K_COLUMNS, s, pg_protected[s], pg_committed[s]
            n += 1
        w = pg_writer[s]
        if w != NO:
            if r > 1:  # which membership is the writer's: the caller's mirror knows
                rows[n, 0], rows[n, 1], rows[n, 2] = K_WRITER, s, w
                n += 1
            elif not (r == 1 and owners[s] == w and _active(space_index, space_active, w)):
                rows[n, 0], rows[n, 1], rows[n, 2] = K_WRITER_NOT_MEMBER, s, w
                n += 1
            if pr > 1:
                rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_SHARED_WRITER, s, pr, w
                n += 1
        if new == NO and a:
            rows[n, 0], rows[n, 1], rows[n, 2] = K_NO_DEVICE, s, a
            n += 1
        pins = pg_pins[s]
        if pins != want[j]:
            rows[n, 0], rows[n, 1], rows[n, 2], rows[n, 3] = K_PINS, s, pins, want[j]
            n += 1
        if pr == 0 and pins == 0 and pg_host_off[s] < 0:
            rows[n, 0], rows[n, 1] = K_NOT_RECYCLED, s
            n += 1
        elif new == NO and pg_host_off[s] < 0:  # held (a reference or a pin), on no tier
            rows[n, 0], rows[n, 1] = K_LOST, s
            n += 1
    return rows[:n], leased
