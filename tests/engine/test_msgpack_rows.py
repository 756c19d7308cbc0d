"""``encode_rows`` writes exactly what msgspec writes for ``table.tolist()`` — the snapshot
and the digest depend on it byte for byte (tests/journal/test_digest_golden.py pins the
digests themselves)."""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine.msgpack_rows import encode_live_columns, encode_rows

EDGES = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -31,
         -32, -33, -127, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]
VALUES = st.one_of(st.sampled_from(EDGES), st.integers(-2**63, 2**63 - 1),
                   st.integers(-300, 300))


def same(table: np.ndarray) -> bool:
    return bytes(encode_rows(table)) == msgspec.msgpack.encode(table.tolist())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 20), st.integers(0, 18), st.data())
def test_encode_rows_is_msgspecs_encoding(n: int, m: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(VALUES, min_size=n * m, max_size=n * m))
    assert same(np.array(values, np.int64).reshape(n, m))


def test_array_headers_past_16_and_65536_rows() -> None:
    for n in (15, 16, 65535, 65536, 70000):
        assert same(np.arange(n * 2, dtype=np.int64).reshape(n, 2) - n)
    assert same(np.zeros((3, 16), np.int64)) and same(np.zeros((1, 70000), np.int64))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 14), st.integers(0, 30), st.data())
def test_live_columns_are_the_page_tables_encoding(fields: int, width: int,
                                                   data: st.DataObject) -> None:
    """``encode_live_columns(pg, live, n)`` is ``encode_rows`` of the rows ``[j, *pg[:, j]]``
    of the live columns below ``n`` (``state.page_table``'s table): a dead column, and any
    column from ``n`` on, is left out."""
    values = data.draw(st.lists(VALUES, min_size=fields * width, max_size=fields * width))
    pg = np.array(values, np.int64).reshape(fields, width)
    live = np.array(data.draw(st.lists(st.booleans(), min_size=width, max_size=width)),
                    np.bool_)
    n = data.draw(st.integers(0, width))
    cols = np.flatnonzero(live[:n])
    table = np.concatenate([cols[:, None], pg[:, cols].T], axis=1).astype(np.int64)
    want = msgspec.msgpack.encode(table.tolist())
    assert bytes(encode_live_columns(pg, live, n)) == bytes(encode_rows(table)) == want


def test_live_columns_past_16_rows_and_large_slots() -> None:
    pg = np.arange(13 * 70000, dtype=np.int64).reshape(13, 70000) - 400000
    live = np.ones(70000, np.bool_)
    live[::7] = False
    cols = np.flatnonzero(live)
    table = np.concatenate([cols[:, None], pg[:, cols].T], axis=1)
    assert bytes(encode_live_columns(pg, live, 70000)) == bytes(encode_rows(table))
