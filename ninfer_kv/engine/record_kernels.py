"""Replay's decode rounds straight from the journal's bytes: one compiled call applies a
stretch of records whose events are all ``CommitFrontiers`` and ``Materialize`` of one pool
(in the 1,000-request Mooncake journal, 84% of the records), without building a Python
object per record or per event.

It reads a record's payload as the journal writes it (docs/journal-format.md: a msgpack
array of events, each an ``array_like`` struct ``[tag, pool, field...]`` with ``bytes``
fields as msgpack bin) and accepts only that exact shape: an array of at most
``MAX_EVENTS`` events, each ``["commit", pool, bin, bin]`` or ``["mat", pool, bin, bin, bin]``
with this pool's name, fields of equally many int32s, and nothing after the last event.
Everything else — another event kind or pool, a field msgspec would read but this parser
does not, a malformed record — is not judged here: the call stops *before* that record and
the caller decodes it with msgspec and ``apply``s it (so a record that does not decode, or an
event refused by its rule, gets exactly the error plain replay gives it).

Each accepted event is applied by the kernel ``apply`` itself calls for it
(``apply_kernels.apply_commit``, ``apply_kernels.materialize_fields``), in event order. Those
check first and change nothing when they refuse, so the call stops before an event they
refuse, or one whose arrays must grow (``NO_ROOM``), and hands it back: the caller's ``apply``
grows the arrays and applies it, or raises naming the record and event.
``tests/engine/test_record_kernels.py`` holds it to event-by-event replay.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine.apply_kernels import apply_commit, materialize_fields
from ninfer_kv.engine.pages import PG_COMMITTED, PG_WRITER
from ninfer_kv.engine.round_kernels import OK
from ninfer_kv.kernels.jit import njit

COMMIT_TAG = np.frombuffer(b"commit", np.uint8)
"""``CommitFrontiers``' tag (``events.CommitFrontiers``; a test holds them equal)."""
MAT_TAG = np.frombuffer(b"mat", np.uint8)
"""``Materialize``'s tag."""
MAX_EVENTS = 64
"""Records of more events are left to the caller (a decode round writes one or two)."""
COMMIT, MAT = 0, 1
NOT_TAKEN = -1
"""The parser's answer for bytes it does not take (the caller decodes them)."""


@njit(nogil=True)
def _byte(buf: np.ndarray, p: int) -> int:
    return np.int64(buf[p])


@njit(nogil=True)
def _be(buf: np.ndarray, p: int, n: int) -> int:
    """The ``n``-byte big-endian unsigned integer at ``p``."""
    v = 0
    for k in range(n):
        v = (v << 8) | _byte(buf, p + k)
    return v


@njit(nogil=True)
def _sized(buf: np.ndarray, p: int, end: int, c8: int, c16: int, c32: int) -> tuple[int, int]:
    """(length, start of what follows the header) of the value at ``p`` whose type byte is
    ``c8``, ``c16`` or ``c32`` — msgpack's forms with an 8-, 16- or 32-bit big-endian length —
    or (``NOT_TAKEN``, ``NOT_TAKEN``), also when the header is cut short."""
    c = _byte(buf, p)
    if c == c8 and p + 2 <= end:
        return _byte(buf, p + 1), p + 2
    if c == c16 and p + 3 <= end:
        return _be(buf, p + 1, 2), p + 3
    if c == c32 and p + 5 <= end:
        return _be(buf, p + 1, 4), p + 5
    return NOT_TAKEN, NOT_TAKEN


@njit(nogil=True)
def array_header(buf: np.ndarray, p: int, end: int) -> tuple[int, int]:
    """(items, position after the header) of the msgpack array at ``p``, or (``NOT_TAKEN``,
    ``NOT_TAKEN``). Like the two below, it passes on a ``NOT_TAKEN`` position it is given,
    so a parse checks once, at its end."""
    if p < 0 or p >= end:
        return NOT_TAKEN, NOT_TAKEN
    c = _byte(buf, p)
    if c & 0xf0 == 0x90:  # fixarray
        return c & 0x0f, p + 1
    return _sized(buf, p, end, -1, 0xdc, 0xdd)  # array 16, 32 (no 8-bit form)


@njit(nogil=True)
def str_equal(buf: np.ndarray, p: int, end: int, want: np.ndarray) -> int:
    """The position after the msgpack str at ``p`` when it is ``want``'s bytes, else
    ``NOT_TAKEN``."""
    if p < 0 or p >= end:
        return NOT_TAKEN
    c = _byte(buf, p)
    if c & 0xe0 == 0xa0:  # fixstr
        n, p = c & 0x1f, p + 1
    else:
        n, p = _sized(buf, p, end, 0xd9, 0xda, 0xdb)  # str 8, 16, 32
    if n != want.shape[0] or p + n > end:  # n = NOT_TAKEN is no length of a name
        return NOT_TAKEN
    for k in range(n):
        if buf[p + k] != want[k]:
            return NOT_TAKEN
    return p + n


@njit(nogil=True)
def bin_field(buf: np.ndarray, p: int, end: int) -> tuple[int, int, int]:
    """(start, bytes, position after) of the msgpack bin at ``p``, or (``NOT_TAKEN``, 0,
    ``NOT_TAKEN``)."""
    if p < 0 or p >= end:
        return NOT_TAKEN, 0, NOT_TAKEN
    n, s = _sized(buf, p, end, 0xc4, 0xc5, 0xc6)  # bin 8, 16, 32
    if n < 0 or s + n > end:
        return NOT_TAKEN, 0, NOT_TAKEN
    return s, n, s + n


@njit(nogil=True)
def record_shape(buf: np.ndarray, lo: int, hi: int, pool: np.ndarray, with_mat: bool,
                 out: np.ndarray) -> int:
    """The events of the payload ``buf[lo:hi]`` when it has the one shape this module
    applies (the module docstring; ``Materialize`` only ``with_mat``), each as a row of
    ``out``: (kind, start of its first, second and third field, int32s per field). Returns
    how many, or ``NOT_TAKEN``: the caller decodes the record. (A field that does not parse
    makes the position ``NOT_TAKEN``, which every later step passes on; the event's row is
    written only once its fields parsed, so no row holds a start of -1, which a slice would
    wrap around to the buffer's end.)"""
    n, p = array_header(buf, lo, hi)
    if n > out.shape[0]:
        return NOT_TAKEN
    for e in range(n):
        k, p = array_header(buf, p, hi)
        if k == 4:
            kind, p = COMMIT, str_equal(buf, p, hi, COMMIT_TAG)
        elif k == 5 and with_mat:
            kind, p = MAT, str_equal(buf, p, hi, MAT_TAG)
        else:
            return NOT_TAKEN
        p = str_equal(buf, p, hi, pool)
        s1, n1, p = bin_field(buf, p, hi)
        s2, n2, p = bin_field(buf, p, hi)
        s3, n3 = 0, n1
        if kind == MAT:
            s3, n3, p = bin_field(buf, p, hi)
        if p < 0 or n1 % 4 or n2 != n1 or n3 != n1:
            return NOT_TAKEN
        out[e, 0], out[e, 1], out[e, 2], out[e, 3], out[e, 4] = kind, s1, s2, s3, n1 // 4
    return n if p == hi else NOT_TAKEN


@njit(nogil=True)
def apply_rounds(buf: np.ndarray, lo: np.ndarray, hi: np.ndarray, r: int, r_end: int,
                 pool: np.ndarray, with_mat: bool, n_slots: int, logical_pages: int,
                 bundle_index: np.ndarray, sp_committed: np.ndarray, sp_nmem: np.ndarray,
                 sp_members: np.ndarray, sp_active: np.ndarray, slot_bits: np.ndarray,
                 page_bits: np.ndarray, pg_live: np.ndarray, pg: np.ndarray
                 ) -> tuple[int, int, int, int, int, int, int]:
    """Apply records ``r .. r_end - 1`` (payloads ``buf[lo[r]:hi[r]]``) while each has the
    shape ``record_shape`` accepts and its kernels accept each event. Returns (the record it
    stopped at — ``r_end`` when it applied them all —, the event of that record to apply
    next, events applied, slots reused, page groups taken, the new ``n_slots``, new pages):
    the record's events before that one are applied; that one and the rest are not."""
    rows = np.empty((MAX_EVENTS, 5), np.int64)
    events = reused = taken = new = 0
    while r < r_end:
        n = record_shape(buf, lo[r], hi[r], pool, with_mat, rows)
        if n < 0:
            return r, 0, events, reused, taken, n_slots, new
        for e in range(n):
            kind, s1, s2, s3, m = rows[e, 0], rows[e, 1], rows[e, 2], rows[e, 3], rows[e, 4]
            # unaligned int32 views of the segment's bytes: little-endian hosts that read
            # unaligned words only (``ninfer_kv.engine`` refuses to load elsewhere)
            bundles = buf[s1:s1 + 4 * m].view(np.int32)
            second = buf[s2:s2 + 4 * m].view(np.int32)
            if kind == COMMIT:
                if apply_commit(bundles, second, bundle_index, sp_committed, sp_nmem,
                                sp_members, pg[PG_COMMITTED], sp_active, pg_live,
                                pg[PG_WRITER]) != -1:
                    return r, e, events, reused, taken, n_slots, new
            else:
                code, _, x, y, z = materialize_fields(
                    bundles, second, buf[s3:s3 + 4 * m].view(np.int32), n_slots,
                    logical_pages, bundle_index, sp_active, sp_nmem, sp_members, slot_bits,
                    page_bits, pg_live, pg)
                if code != OK:
                    return r, e, events, reused, taken, n_slots, new
                reused += x
                taken += y
                n_slots = z
                new += m
            events += 1
        r += 1
    return r, 0, events, reused, taken, n_slots, new
