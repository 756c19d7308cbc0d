"""The decode round's per-sequence loops, compiled (numba ``njit``; spec §8.1, §8.2, §9.4).

A decode round touches every running sequence three times: resolve and check the mapping
request, check the commit (frontier range and write permission), apply the commit. Done with
numpy each step costs a dozen small-array calls (~1 µs each); one compiled call per command
(``map_round``, ``commit_round``) costs one. These kernels only *read* the store's state
(``publish_rows`` writes the block tables the boundary publishes); the loops that write it are
``apply``'s, in engine/apply_kernels.py, so ``apply`` stays the only mutator.

The check kernels return ``(code, j)``: ``OK``, or the first refused element ``j`` and why.
The command then re-runs its plain-Python check for that element to raise the precise typed
error (engine/decode.py), so there is one wording of every refusal.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine.bundle_table import space_of
from ninfer_kv.engine.free_ids import _lowest
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import PG_PINS, PG_PROTECTED, PG_WRITER
from ninfer_kv.kernels.jit import njit

OK = 0
UNKNOWN = 1      # not a sequence of this pool, or an inactive checkpoint
DUPLICATE = 2    # the same sequence twice in one batch
FRONTIER = 3     # a frontier outside its range
ENTITLEMENT = 4  # more pages than the entitlement (§8.1)
WRITE = 5        # §9.4 write permission
CEILING = 6      # a commit frontier above the logical ceiling S (§3.2)


@njit(nogil=True)
def resolve(bundles: np.ndarray, bundle_index: np.ndarray, sp_active: np.ndarray
            ) -> tuple[np.ndarray, int, int]:
    """(space index of each bundle, code, j): every bundle an active space of the pool, none
    twice."""
    n = bundles.shape[0]
    idx = np.empty(n, np.int64)
    seen = np.zeros(sp_active.shape[0], np.bool_)
    for j in range(n):
        b = bundles[j]
        i = space_of(bundle_index, b)
        if i < 0 or not sp_active[i]:
            return idx, UNKNOWN, j
        if seen[i]:
            return idx, DUPLICATE, j
        seen[i] = True
        idx[j] = i
    return idx, OK, -1


@njit(nogil=True)
def plan_mapping(idx: np.ndarray, tokens: np.ndarray, sp_nmem: np.ndarray,
                 sp_entitlement: np.ndarray, logical_pages: int) -> tuple[int, int, int]:
    """(pages to materialize, code, j) for ``ensure_mapped_many``: each ``tokens`` within
    [0, L*P] and its pages within the entitlement."""
    total = 0
    for j in range(idx.shape[0]):
        t = tokens[j]
        if t < 0 or t > logical_pages * P:  # before the division: no overflow near 2**63
            return 0, FRONTIER, j
        need = (t + P - 1) // P
        i = idx[j]
        have = sp_nmem[i]
        if need > have:
            if need > sp_entitlement[i]:
                return 0, ENTITLEMENT, j
            total += need - have
    return total, OK, -1


@njit(nogil=True)
def check_commit(bundles: np.ndarray, idx: np.ndarray, frontiers: np.ndarray,
                 sp_committed: np.ndarray, sp_nmem: np.ndarray, sp_members: np.ndarray,
                 pg_writer: np.ndarray, pg_pins: np.ndarray, pg_protected: np.ndarray
                 ) -> tuple[int, int, int]:
    """(code, j, block) for ``commit_many``: each frontier within [committed, membership],
    and every block the new columns land in writable by its sequence (§9.4: the single
    writer, no pin, nothing protected at or above the first column written)."""
    for j in range(idx.shape[0]):
        i = idx[j]
        f = frontiers[j]
        old = sp_committed[i]
        if f < old or f > sp_nmem[i] * P:
            return FRONTIER, j, -1
        lo = old // P
        for blk in range(lo, (f + P - 1) // P):
            first = old - blk * P if blk == lo else 0
            s = sp_members[i, blk]
            if pg_writer[s] != bundles[j] or pg_pins[s] != 0 or pg_protected[s] > first:
                return WRITE, j, blk
    return OK, -1, -1


@njit(nogil=True)
def grow_plan(bundles: np.ndarray, idx: np.ndarray, tokens: np.ndarray, sp_nmem: np.ndarray,
              total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """After ``plan_mapping`` found ``total`` pages to materialize: (the sequence of each new
    page, in batch order; the sequences that grow; the first new block of each)."""
    need_b = np.empty(total, np.int64)
    grown = np.empty(bundles.shape[0], np.int64)
    first = np.empty(bundles.shape[0], np.int64)
    k = g = 0
    for j in range(bundles.shape[0]):
        have = sp_nmem[idx[j]]
        need = (tokens[j] + P - 1) // P
        if need > have:
            grown[g] = bundles[j]
            first[g] = have
            g += 1
            for _ in range(need - have):
                need_b[k] = bundles[j]
                k += 1
    return need_b[:k], grown[:g], first[:g]


@njit(nogil=True)
def publish_rows(bundles: np.ndarray, starts: np.ndarray, bundle_index: np.ndarray,
                 sp_active: np.ndarray, sp_row: np.ndarray, sp_members: np.ndarray,
                 sp_nmem: np.ndarray, pg_device: np.ndarray, host_tables: np.ndarray,
                 published: np.ndarray, pg_live: np.ndarray) -> tuple[int, np.ndarray]:
    """The boundary's table-slice writes (``DeviceState.write_table`` for a batch, §13): the
    row of sequence ``bundles[j]`` gets the device pages of its blocks ``starts[j]..`` and the
    entries after them that an earlier write mapped are unmapped. A sequence without an
    active space (finished or released since it was touched) is skipped: it has no row.

    Returns (-1, rows) where rows[k] = (row, start, end of what changed), one per row written
    (the caller copies ``[start, end)`` to a device table), or (j, _) when sequence j's row
    lies outside the table, its membership is longer than the row, or a block to write names
    a slot that is no live page — which only a damaged state holds (nothing written from j
    on): the table would map another sequence's page group, or be written past its row."""
    out = np.empty((bundles.shape[0], 3), np.int64)
    n = 0
    for j in range(bundles.shape[0]):
        b = bundles[j]
        k = space_of(bundle_index, b)
        if k < 0 or not sp_active[k]:
            continue
        r, start = sp_row[k], starts[j]
        if r < 0 or r >= host_tables.shape[0]:
            return j, out[:n]
        if sp_nmem[k] > host_tables.shape[1] or sp_nmem[k] > sp_members.shape[1]:
            return j, out[:n]
        end = max(start, sp_nmem[k])
        for i in range(start, end):
            s = sp_members[k, i]
            if s < 0 or s >= pg_live.shape[0] or not pg_live[s]:
                return j, out[:n]
        for i in range(start, end):
            host_tables[r, i] = pg_device[sp_members[k, i]]
        hi = max(end, published[r])
        for i in range(end, hi):
            host_tables[r, i] = -1
        published[r] = end
        out[n, 0], out[n, 1], out[n, 2] = r, start, hi
        n += 1
    return -1, out[:n]


@njit(nogil=True)
def map_round(bundles: np.ndarray, bundle_index: np.ndarray, sp_active: np.ndarray,
              tokens: np.ndarray, sp_nmem: np.ndarray, sp_entitlement: np.ndarray,
              logical_pages: int, slot_bits: np.ndarray, slot_lo: int, slot_free: int,
              n_slots: int, page_bits: np.ndarray, page_lo: int, page_free: int
              ) -> tuple[int, int, int, int, int, int, int, np.ndarray]:
    """``ensure_mapped_many``'s whole plan in one call: ``resolve`` and ``plan_mapping``
    (code, j, and the space index of element ``j``), then for the ``total`` new pages
    ``grow_plan`` (the sequence of each, the ``g`` sequences that grow and their first new
    block), the slots (lowest free ones, then never-used ones from ``n_slots``, as
    ``PoolState.pick_slot_array``) and the page groups (lowest free, as
    ``FreeIds.lowest_array``), with the free lists' new ``lo`` bounds. Reads only.

    Returns (code, j, i, total, g, slot_lo, page_lo, out): one int32 array (boxing an array
    costs ~0.3 µs, so there is one) holding, in this order, the ``total`` sequences, slots and
    page groups of the new pages — ``Materialize``'s three fields as they are packed — then
    the ``g`` grown sequences and their first new blocks."""
    none = np.empty(0, np.int32)
    idx, code, j = resolve(bundles, bundle_index, sp_active)
    if code != OK:
        return code, j, -1, 0, 0, slot_lo, page_lo, none
    total, code, j = plan_mapping(idx, tokens, sp_nmem, sp_entitlement, logical_pages)
    if code != OK:  # grow_plan may only run on a plan that passed: it trusts ``total``
        return code, j, idx[j], 0, 0, slot_lo, page_lo, none
    need_b, grown, first = grow_plan(bundles, idx, tokens, sp_nmem, total)
    g = grown.shape[0]
    out = np.empty(3 * total + 2 * g, np.int32)
    out[:total] = need_b
    reuse, slot_lo = _lowest(slot_bits, slot_lo, min(total, slot_free))
    r = reuse.shape[0]
    out[total:total + r] = reuse
    for k in range(r, total):
        out[total + k] = n_slots + k - r
    pages, page_lo = _lowest(page_bits, page_lo, min(total, page_free))
    out[2 * total:2 * total + pages.shape[0]] = pages
    # fewer free page groups than pages (reservations forbid it): -1 entries, which
    # apply(Materialize) refuses (a new page without a page group), stopping the store
    out[2 * total + pages.shape[0]:3 * total] = -1
    out[3 * total:3 * total + g] = grown
    out[3 * total + g:] = first
    return code, j, -1, total, g, slot_lo, page_lo, out


@njit(nogil=True)
def commit_round(bundles: np.ndarray, bundle_index: np.ndarray, sp_active: np.ndarray,
                 frontiers: np.ndarray, sp_committed: np.ndarray, sp_nmem: np.ndarray,
                 sp_members: np.ndarray, pg: np.ndarray, ceiling: int
                 ) -> tuple[int, int, int, int, np.ndarray]:
    """``commit_many``'s checks in one call (``pg``: the pool's per-slot matrix,
    ``PoolState.pg``): ``resolve``, no frontier above ``ceiling`` (the
    logical ceiling S, §3.2: ``CEILING``), then ``check_commit``. Returns (code, j, block,
    the space index of element ``j``, out): on ``OK``, ``out`` is one int32 array holding the
    sequences then the frontiers — ``CommitFrontiers``' two fields as ``pack`` writes them
    (one array to box, not two to convert). Reads only."""
    none = np.empty(0, np.int32)
    idx, code, j = resolve(bundles, bundle_index, sp_active)
    if code != OK:
        return code, j, -1, -1, none
    for j in range(bundles.shape[0]):
        if frontiers[j] > ceiling:
            return CEILING, j, -1, idx[j], none
    code, j, blk = check_commit(bundles, idx, frontiers, sp_committed, sp_nmem, sp_members,
                                pg[PG_WRITER], pg[PG_PINS], pg[PG_PROTECTED])
    if code != OK:
        return code, j, blk, idx[j], none
    n = bundles.shape[0]
    out = np.empty(2 * n, np.int32)
    out[:n] = bundles
    out[n:] = frontiers
    return code, j, blk, -1, out


@njit(nogil=True)
def provisional_round(bundles: np.ndarray, bundle_index: np.ndarray, sp_active: np.ndarray,
                      frontiers: np.ndarray, sp_nmem: np.ndarray
                      ) -> tuple[int, int, int, np.ndarray]:
    """``set_provisional_many``'s checks in one call (§8.2): every sequence an active space
    of the pool, none twice, each frontier within [0, its membership]. Returns (code, j, the
    space index of element ``j``, out): on ``OK``, ``out`` holds ``ProvisionalFrontiers``'
    two fields as ``pack`` writes them (as ``commit_round``). Reads only."""
    none = np.empty(0, np.int32)
    idx, code, j = resolve(bundles, bundle_index, sp_active)
    if code != OK:
        return code, j, -1, none
    for j in range(bundles.shape[0]):
        f = frontiers[j]
        if f < 0 or f > sp_nmem[idx[j]] * P:
            return FRONTIER, j, idx[j], none
    n = bundles.shape[0]
    out = np.empty(2 * n, np.int32)
    out[:n] = bundles
    out[n:] = frontiers
    return OK, -1, -1, out


@njit(nogil=True)
def without_device(slots: np.ndarray, pg_device: np.ndarray) -> np.ndarray:
    """The slots of ``slots`` whose page has no device replica (Host-only, §5.1), in order."""
    out = np.empty(slots.shape[0], np.int64)
    k = 0
    for j in range(slots.shape[0]):
        if pg_device[slots[j]] < 0:
            out[k] = slots[j]
            k += 1
    return out[:k]


@njit(nogil=True)
def active_bundles(sp_active: np.ndarray, sp_bundle: np.ndarray) -> np.ndarray:
    """The bundles of the pool's active spaces, ascending: O(spaces), not O(bundle ids)."""
    out = np.empty(sp_active.shape[0], np.int64)
    k = 0
    for i in range(sp_active.shape[0]):
        if sp_active[i] and sp_bundle[i] >= 0:
            out[k] = sp_bundle[i]
            k += 1
    return np.sort(out[:k])


@njit(nogil=True)
def grow_pool(ids: np.ndarray, bundle_index: np.ndarray, sp_committed: np.ndarray,
              sp_entitlement: np.ndarray, sp_budget: np.ndarray, ceiling: int,
              logical_pages: int, window: int, cushion: int, step: int, lead: int,
              available: int) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """``grow`` in one pool (§6.2), sequences ``ids`` in order (first come, first served):
    each is entitled up to ``committed + window + cushion`` tokens (never past its budget, 0
    meaning ``ceiling``; plus the MTP ``lead``; at most L pages) from what is ``available``.
    Returns (pages granted each; the token frontier each *short* sequence's entitlement
    covers, -1 for the others; pages granted in all; pages missing for the short ones —
    what a retry needs freed, counting the window pages earlier sequences take first — or 0;
    how many are short).
    A sequence is short when its entitlement cannot cover the next ``step`` and the cushion.
    Reads only."""
    n = ids.shape[0]
    got = np.zeros(n, np.int64)
    cover = np.full(n, -1, np.int64)
    before = ahead = granted = 0  # earlier sequences' wants; what they still lack; grants
    worst = n_short = 0
    for j in range(n):
        b = ids[j]
        i = space_of(bundle_index, b)
        if i < 0:  # commands activate every pool; a damaged journal could leave one out
            raise ValueError("grow: an active sequence has no space in this pool (§7.1)")
        c, e = sp_committed[i], sp_entitlement[i]
        budget = sp_budget[i] if sp_budget[i] else ceiling
        target = min(budget, c + window + cushion) + lead
        want = max(min(logical_pages, -(-target // P)) - e, 0)
        g = min(max(available - before, 0), want)
        before += want
        e += g
        need = -(-min(min(budget, c + step + cushion) + lead, logical_pages * P) // P)
        if need > e:
            worst = max(worst, ahead + need - e) if n_short else ahead + need - e
            n_short += 1
            cover[j] = max(c, e * P - lead)
        ahead += want - g
        got[j] = g
        granted += g
    return got, cover, granted, worst - (available - granted) if n_short else 0, n_short
