"""engine/effects.py: a boundary's device effects keep their order, and the tail copies run in
batches whose pairs are independent (one kernel call per plane runs a batch concurrently)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ninfer_kv.engine.effects import batches
from ninfer_kv.engine.layout import PlaneOrder
from ninfer_kv.journal import events as ev
from ninfer_kv.kernels.copy import copy_tails


def tail(pool: str, src: int, dst: int) -> ev.CopyTail:
    return ev.CopyTail(1, pool, 0, dst, 0, src, 5)


def restore(pool: str) -> ev.DeviceRestore:
    return ev.DeviceRestore(pool, ev.pack([0]), ev.pack([0]))


def test_a_batch_ends_where_a_copy_depends_on_it_or_the_pool_or_a_restore_changes() -> None:
    a, b, c = tail("main", 1, 2), tail("main", 3, 4), tail("main", 2, 5)  # c reads a's page
    d, e = tail("main", 6, 4), tail("main", 7, 3)  # d writes b's page twice, e writes b's read
    f, r = tail("mtp", 1, 2), restore("main")
    assert list(batches([a, b, c])) == [[a, b], [c]]
    assert list(batches([a, b, d])) == [[a, b], [d]]
    assert list(batches([a, b, e])) == [[a, b], [e]]
    assert list(batches([a, f, b])) == [[a], [f], [b]]
    assert list(batches([a, r, b])) == [[a], r, [b]]
    assert list(batches([])) == []


copies = st.lists(st.tuples(st.sampled_from(["main", "mtp", "restore"]),
                            st.integers(0, 6), st.integers(0, 6)), max_size=12)


@given(copies)
def test_batches_keep_the_order_and_hold_independent_copies(spec: list[tuple[str, int, int]]
                                                            ) -> None:
    effects = [restore("main") if p == "restore" else tail(p, s, d) for p, s, d in spec]
    out = list(batches(effects))
    flat = [x for b in out for x in (b if isinstance(b, list) else [b])]
    assert flat == effects                        # every effect once, in emission order
    for b in out:
        if not isinstance(b, list):
            continue
        assert b and len({e.pool for e in b}) == 1
        writes = [e.page for e in b]
        assert len(set(writes)) == len(writes)    # no page written twice
        assert not any(e.src_page in writes and e.src_page != e.page for e in b)
        # what the kernel wrapper accepts (it validates before looking at the planes)
        copy_tails([], PlaneOrder.PAGE_MAJOR, [e.src_page for e in b], writes,
                   [e.columns for e in b])
