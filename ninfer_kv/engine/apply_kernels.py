"""``apply``'s page bookkeeping loops, compiled (numba ``njit``; spec §5.1, §5.3, §8.1, §9).

These kernels *write* the pool's arrays, and only ``apply`` (engine/apply*.py,
engine/page_life.py) calls them, so ``apply`` stays the only mutator. Each checks what a
damaged journal could break before it writes (and then returns a code, or the first bad
element, with nothing changed), because numba does not bounds-check: the command side checks
the same rules first (engine/round_kernels.py, engine/decode.py), so a refusal here means a
foreign or damaged journal. ``tests/engine/test_round_kernels.py`` holds them to oracles.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine.bundle_table import space_of
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.page_life_kernels import membership_fault, membership_of
from ninfer_kv.engine.pages import (
    PG_ACTIVE,
    PG_COMMITTED,
    PG_DEVICE,
    PG_EPOCH,
    PG_PINS,
    PG_PROTECTED,
    PG_REFS,
    PG_WRITER,
)
from ninfer_kv.engine.round_kernels import OK
from ninfer_kv.kernels.jit import njit


@njit(nogil=True)
def int32s(raw: bytes) -> np.ndarray:
    """An event's packed int32 field (``events.pack``) as a read-only array, in place: passing
    the ``bytes`` costs what passing an array does, so ``unpack`` in Python (~0.3 µs a field)
    is skipped. Little-endian only (``ninfer_kv.engine`` refuses to load elsewhere)."""
    return np.frombuffer(raw, np.int32)


@njit(nogil=True)
def apply_commit(bundles: np.ndarray, frontiers: np.ndarray, bundle_index: np.ndarray,
                 sp_committed: np.ndarray, sp_nmem: np.ndarray, sp_members: np.ndarray,
                 pg_committed: np.ndarray, sp_active: np.ndarray, pg_live: np.ndarray,
                 pg_writer: np.ndarray) -> int:
    """``apply(CommitFrontiers)``, in event order: pages from the old frontier's block to
    the new one get their committed columns. Returns -1, or the first element naming no
    active space, a frontier outside [its committed frontier, membership] — a commit only
    advances — or a block to write whose slot is no live page the sequence writes (§9.4: the
    single writer; ``round_kernels.check_commit`` checked it on the command side, so this is
    a damaged state: a membership naming another sequence's page, or a slot outside the
    pool). Then nothing is applied. A seq listed twice is checked against the frontier its
    earlier element left."""
    n = bundles.shape[0]
    old = np.empty(n, np.int64)     # each element's committed frontier before it
    idx = np.empty(n, np.int64)     # and its space index (one table lookup per element)
    for j in range(n):
        b = bundles[j]
        i = space_of(bundle_index, b)
        bad = i < 0
        if not bad:
            f = frontiers[j]
            if (not sp_active[i] or f > sp_nmem[i] * P or f < sp_committed[i]
                    or (f + P - 1) // P > sp_members.shape[1]):
                bad = True
            else:
                for blk in range(sp_committed[i] // P, (f + P - 1) // P):
                    s = sp_members[i, blk]
                    if s < 0 or s >= pg_live.shape[0] or not pg_live[s] or pg_writer[s] != b:
                        bad = True
                        break
        if bad:
            for k in range(j - 1, -1, -1):  # undo the frontiers this pass moved
                sp_committed[idx[k]] = old[k]
            return j
        old[j] = sp_committed[i]
        idx[j] = i
        sp_committed[i] = frontiers[j]
    for j in range(n):
        i = idx[j]
        f = frontiers[j]
        for blk in range(old[j] // P, (f + P - 1) // P):
            cols = f - blk * P
            pg_committed[sp_members[i, blk]] = P if cols > P else cols
    return -1


COMMIT_LENGTHS = -2
"""``apply_commit_raw``: the two fields are not equally many int32s."""


@njit(nogil=True)
def apply_commit_raw(b_raw: bytes, f_raw: bytes, bundle_index: np.ndarray,
                     sp_committed: np.ndarray, sp_nmem: np.ndarray, sp_members: np.ndarray,
                     sp_active: np.ndarray, pg_live: np.ndarray, pg: np.ndarray) -> int:
    """``apply_commit`` on the event's packed fields (``int32s``) and the pool's per-slot
    matrix ``pg``; ``COMMIT_LENGTHS`` when their lengths differ (nothing applied)."""
    if len(b_raw) % 4 or len(f_raw) != len(b_raw):
        return COMMIT_LENGTHS
    return apply_commit(int32s(b_raw), int32s(f_raw), bundle_index, sp_committed, sp_nmem,
                        sp_members, pg[PG_COMMITTED], sp_active, pg_live, pg[PG_WRITER])


@njit(nogil=True)
def apply_provisional(b_raw: bytes, f_raw: bytes, bundle_index: np.ndarray,
                      sp_active: np.ndarray, sp_nmem: np.ndarray, sp_provisional: np.ndarray
                      ) -> int:
    """``apply(ProvisionalFrontiers)`` on the event's packed fields (§8.2): each space's
    provisional frontier, in event order (a seq listed twice keeps its last). Returns -1, or
    ``COMMIT_LENGTHS`` when the fields are not equally many int32s, or the first element
    naming no active space or a frontier outside [0, its membership] — then nothing
    changed."""
    if len(b_raw) % 4 or len(f_raw) != len(b_raw):
        return COMMIT_LENGTHS
    bundles, frontiers = int32s(b_raw), int32s(f_raw)
    for j in range(bundles.shape[0]):
        b = bundles[j]
        i = space_of(bundle_index, b)
        if i < 0 or not sp_active[i] or frontiers[j] < 0 or frontiers[j] > sp_nmem[i] * P:
            return j
    for j in range(bundles.shape[0]):
        sp_provisional[space_of(bundle_index, bundles[j])] = frontiers[j]
    return -1


GROW_BAD = 1
"""``apply_grow``: an element names no active space, one listed twice, a negative page count,
or an entitlement past L."""


@njit(nogil=True)
def apply_grow(b_raw: bytes, n_raw: bytes, bundle_index: np.ndarray, sp_active: np.ndarray,
               sp_entitlement: np.ndarray, logical_pages: int) -> tuple[int, int, int]:
    """``apply(Grow)`` on the event's packed fields (§6.2): each space's entitlement grows by
    its page count. Returns (code, j, pages added): ``OK``; ``COMMIT_LENGTHS`` when the
    fields are not equally many int32s; ``GROW_BAD`` at element ``j`` — then nothing
    changed."""
    if len(b_raw) % 4 or len(n_raw) != len(b_raw):
        return COMMIT_LENGTHS, -1, 0
    bundles, pages = int32s(b_raw), int32s(n_raw)
    seen = np.zeros(sp_active.shape[0], np.bool_)
    for j in range(bundles.shape[0]):
        b = bundles[j]
        i = space_of(bundle_index, b)
        if (i < 0 or not sp_active[i] or seen[i] or pages[j] < 0
                or sp_entitlement[i] + pages[j] > logical_pages):
            return GROW_BAD, j, 0
        seen[i] = True
    total = 0
    for j in range(bundles.shape[0]):
        sp_entitlement[space_of(bundle_index, bundles[j])] += pages[j]
        total += pages[j]
    return OK, -1, total


@njit(nogil=True)
def append_members(idx: np.ndarray, slots: np.ndarray, sp_members: np.ndarray,
                   sp_nmem: np.ndarray) -> None:
    """``apply(Materialize)``'s membership part, in event order: slot ``j`` becomes the next
    block of space ``idx[j]`` (the caller made room: ``PoolState.ensure_members``)."""
    for j in range(idx.shape[0]):
        i = idx[j]
        assert 0 <= sp_nmem[i] < sp_members.shape[1]  # a damaged length never writes astray
        sp_members[i, sp_nmem[i]] = slots[j]
        sp_nmem[i] += 1


@njit(nogil=True)
def take_new_pages(slots: np.ndarray, devs: np.ndarray, n_slots: int, slot_bits: np.ndarray,
                   page_bits: np.ndarray, pg_live: np.ndarray) -> tuple[int, int, int, int]:
    """The free-list half of ``materialize`` (``apply(Materialize)``), in event order: slot
    ``slots[j]`` is a free, dead slot below ``n_slots`` or the next never-used one, and
    ``devs[j]`` (unless -1) a free page group; each leaves its free list. Returns (j, slots
    reused, page groups taken, the new ``n_slots``): ``j`` = -1, or the first element that
    breaks the rule, and then nothing is taken (a damaged journal)."""
    nxt = n_slots
    reused = taken = 0
    bad = -1
    for j in range(slots.shape[0]):
        s, d = slots[j], devs[j]
        if s == nxt:
            nxt += 1
        elif 0 <= s < n_slots and s < slot_bits.shape[0] and slot_bits[s] and not pg_live[s]:
            slot_bits[s] = False
            reused += 1
        else:
            bad = j
            break
        if d != -1:
            if 0 <= d < page_bits.shape[0] and page_bits[d]:
                page_bits[d] = False
                taken += 1
            else:
                if s < n_slots:
                    slot_bits[s] = True
                bad = j
                break
    if bad < 0:
        return -1, reused, taken, nxt
    give_back(slots, devs, bad, n_slots, slot_bits, page_bits)  # undo: nothing taken
    return bad, 0, 0, n_slots


@njit(nogil=True)
def give_back(slots: np.ndarray, devs: np.ndarray, upto: int, n_slots: int,
              slot_bits: np.ndarray, page_bits: np.ndarray) -> None:
    """Undo ``take_new_pages`` for elements ``0..upto``: their reused slots and their page
    groups are free again."""
    for k in range(upto):
        s, d = slots[k], devs[k]
        if s < n_slots:
            slot_bits[s] = True
        if d != -1:
            page_bits[d] = True


@njit(nogil=True)
def init_new_pages(slots: np.ndarray, devs: np.ndarray, writers: np.ndarray, active: int,
                   pg_live: np.ndarray, pg: np.ndarray) -> None:
    """``PoolState.init_pages`` in one loop over the pool's per-slot matrix ``pg``: one
    reference, nothing committed or protected, no pin; generations and host fields kept."""
    for j in range(slots.shape[0]):
        s = slots[j]
        pg_live[s] = True
        pg[PG_EPOCH, s] = 0
        pg[PG_COMMITTED, s] = 0
        pg[PG_PROTECTED, s] = 0
        pg[PG_REFS, s] = 1
        pg[PG_ACTIVE, s] = active
        pg[PG_WRITER, s] = writers[j]
        pg[PG_DEVICE, s] = devs[j]
        pg[PG_PINS, s] = 0


NO_SPACE, INACTIVE, NO_GROUP = 1, 2, 3
"""``materialize_plan``'s refusals: a bundle with no space in the pool, a space that is an
inactive checkpoint's, a new page without a page group (§8.1)."""


@njit(nogil=True)
def materialize_plan(bundles: np.ndarray, devs: np.ndarray, bundle_index: np.ndarray,
                     sp_active: np.ndarray, sp_nmem: np.ndarray
                     ) -> tuple[np.ndarray, int, int, int]:
    """``apply(Materialize)``'s checks and sizing in one pass: (space index of each new
    page's bundle, code, j, the membership width ``append_members`` reaches). ``code`` is
    ``OK`` or the first refusal (``NO_SPACE``, ``INACTIVE``, ``NO_GROUP``, ``BAD_LENGTH``)
    at element ``j``; a bundle may repeat (one sequence, several new pages)."""
    n = bundles.shape[0]
    idx = np.empty(n, np.int64)
    extra = np.zeros(sp_nmem.shape[0], np.int64)
    width = 0
    for j in range(n):
        b = bundles[j]
        i = space_of(bundle_index, b)
        if i < 0:
            return idx, NO_SPACE, j, 0
        if not sp_active[i]:
            return idx, INACTIVE, j, 0
        if devs[j] < 0:
            return idx, NO_GROUP, j, 0
        if sp_nmem[i] < 0:
            return idx, BAD_LENGTH, j, 0
        idx[j] = i
        extra[i] += 1
        width = max(width, sp_nmem[i] + extra[i])
    return idx, OK, -1, width


NO_ROOM, BAD_SLOT, LENGTHS, TOO_WIDE, BAD_LENGTH = 4, 5, 6, 7, 8
"""``materialize``'s other answers: the arrays must grow first (nothing changed), a slot or
page group that is not free (``take_new_pages``' rule), fields of different lengths, a
membership past L, a membership of negative length (a damaged state)."""


@njit(nogil=True)
def materialize(b_raw: bytes, s_raw: bytes, d_raw: bytes, n_slots: int, logical_pages: int,
                bundle_index: np.ndarray, sp_active: np.ndarray, sp_nmem: np.ndarray,
                sp_members: np.ndarray, slot_bits: np.ndarray, page_bits: np.ndarray,
                pg_live: np.ndarray, pg: np.ndarray) -> tuple[int, int, int, int, int]:
    """``apply(Materialize)`` in one call (§5.2, §8.1), on the event's packed fields
    (sequences, slots, page groups): ``materialize_plan``'s checks, no membership past L,
    ``take_new_pages``, then ``init_new_pages`` (each page written by its sequence) and
    ``append_members``. Returns (code, j, a, b, c):

    - ``OK``: (slots reused, page groups taken, the new ``n_slots``) in a, b, c;
    - ``NO_ROOM``: the memberships need width ``a`` or the page arrays length ``b``; nothing
      changed, the caller grows them and calls again (a kernel cannot replace arrays). Every
      rule is checked first, so a damaged event never makes the arrays grow: the width is
      at most L, and each never-used slot takes a free page group;
    - ``LENGTHS``, a ``materialize_plan`` refusal, ``TOO_WIDE`` (``a`` = the width) or
      ``BAD_SLOT`` at element ``j``: nothing changed."""
    if len(b_raw) % 4 or len(s_raw) != len(b_raw) or len(d_raw) != len(b_raw):
        return LENGTHS, -1, 0, 0, 0
    return materialize_fields(int32s(b_raw), int32s(s_raw), int32s(d_raw), n_slots,
                              logical_pages, bundle_index, sp_active, sp_nmem, sp_members,
                              slot_bits, page_bits, pg_live, pg)


@njit(nogil=True)
def materialize_fields(bundles: np.ndarray, slots: np.ndarray, devs: np.ndarray, n_slots: int,
                       logical_pages: int, bundle_index: np.ndarray, sp_active: np.ndarray,
                       sp_nmem: np.ndarray, sp_members: np.ndarray, slot_bits: np.ndarray,
                       page_bits: np.ndarray, pg_live: np.ndarray, pg: np.ndarray
                       ) -> tuple[int, int, int, int, int]:
    """``materialize`` on the fields as equally long int32 arrays (replay's decode rounds
    read them straight from the journal's bytes: engine/record_kernels.py)."""
    idx, code, j, width = materialize_plan(bundles, devs, bundle_index, sp_active, sp_nmem)
    if code != OK:
        return code, j, 0, 0, 0
    if width > logical_pages:
        return TOO_WIDE, -1, width, 0, 0
    j, reused, taken, n_new = take_new_pages(slots, devs, n_slots, slot_bits, page_bits,
                                             pg_live)
    if j >= 0:
        return BAD_SLOT, j, 0, 0, 0
    if width > sp_members.shape[1] or n_new > pg_live.shape[0] or n_new > pg.shape[1]:
        give_back(slots, devs, slots.shape[0], n_slots, slot_bits, page_bits)
        return NO_ROOM, -1, width, n_new, 0
    init_new_pages(slots, devs, bundles, 1, pg_live, pg)
    append_members(idx, slots, sp_members, sp_nmem)
    return OK, -1, reused, taken, n_new


FORK_ACTIVE_SOURCE, FORK_BAD_TARGET, FORK_BAD_COUNT, FORK_DEAD_PAGE = 1, 2, 3, 4
"""``fork_pages``' refusals, in the order it checks them."""


@njit(nogil=True)
def fork_pages(src_i: int, dst_i: int, full_pages: int, sp_active: np.ndarray,
               sp_committed: np.ndarray, sp_provisional: np.ndarray, sp_protected: np.ndarray,
               sp_members: np.ndarray, sp_nmem: np.ndarray, pg_live: np.ndarray,
               pg_refs: np.ndarray, pg_active: np.ndarray) -> int:
    """``apply(Fork)``'s checks and page half (§9.2): space ``src_i`` an inactive checkpoint,
    ``dst_i`` a different space without pages, ``full_pages`` within the source's membership
    and committed frontier, its whole membership sound (``membership_fault``, within its
    row) — else the first refusal code, and nothing changed. Then the first ``full_pages``
    blocks of ``src_i`` become ``dst_i``'s (active) membership, each page gaining a
    reference, and ``dst_i`` is committed to them: its committed, provisional and protected
    frontiers all at their end (the shared prefix is immutable, §9.4). Returns ``OK``."""
    if sp_active[src_i]:
        return FORK_ACTIVE_SOURCE
    if src_i == dst_i or sp_nmem[dst_i] != 0 or full_pages * P > sp_committed[src_i]:
        return FORK_BAD_TARGET
    if not 0 <= full_pages <= sp_nmem[src_i]:
        return FORK_BAD_COUNT
    if sp_nmem[src_i] > sp_members.shape[1] or membership_fault(
            sp_members[src_i, :sp_nmem[src_i]], pg_live) >= 0:
        return FORK_DEAD_PAGE
    for k in range(full_pages):
        s = sp_members[src_i, k]
        pg_refs[s] += 1       # a membership holds a slot once: no repeated index
        pg_active[s] += 1
        sp_members[dst_i, k] = s
    sp_nmem[dst_i] = full_pages
    sp_committed[dst_i] = sp_provisional[dst_i] = sp_protected[dst_i] = full_pages * P
    return OK


@njit(nogil=True)
def retain_pages(slots: np.ndarray, bundle: int, committed: int, pg_active: np.ndarray,
                 pg_writer: np.ndarray, pg_protected: np.ndarray) -> None:
    """``apply(Finish(retain))``'s page half (§7.2, §9.4): block ``k`` of the finished
    sequence (slot ``slots[k]``, a membership ``page_life.members_of`` checked) loses its
    active reference and ``bundle``'s writer right, and its protected coverage grows to the
    committed columns of that block."""
    for k in range(slots.shape[0]):
        s = slots[k]
        pg_active[s] -= 1
        if pg_writer[s] == bundle:
            pg_writer[s] = -1
        cols = min(P, committed - P * k)
        if cols > pg_protected[s]:
            pg_protected[s] = cols


@njit(nogil=True)
def retain_membership(i: int, bundle: int, committed: int, sp_members: np.ndarray,
                      sp_nmem: np.ndarray, pg_live: np.ndarray, pg: np.ndarray) -> int:
    """``apply(Finish(retain))``'s page half for space ``i`` in one call: its membership
    judged as ``page_life.members_of`` does (``membership_of``), then ``retain_pages`` on
    the rows of ``pg``. Returns -1, or the first bad block (-2: a length outside its row)
    with nothing changed."""
    slots, k = membership_of(i, sp_members, sp_nmem, pg_live)
    if k == -1:
        retain_pages(slots, bundle, committed, pg[PG_ACTIVE], pg[PG_WRITER], pg[PG_PROTECTED])
    return k
