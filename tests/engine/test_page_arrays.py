"""Pages as arrays (engine/pool.py, pages.py): views, growth, and the snapshot built from the
arrays agreeing with the views."""

from __future__ import annotations

from pathlib import Path

from ninfer_kv.engine.apply import _new_page
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import page_tuples
from ninfer_kv.engine.store import KVStore
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


def test_a_page_in_the_slot_past_the_arrays_grows_them() -> None:
    """Slots outnumber device pages once checkpoints live on the host only: a CopyTail into
    the next never-used slot, right at the arrays' end, must grow them (it raised
    IndexError)."""
    p = PoolState("main", 16, 1, 4)
    p.init_pages(list(range(16)), [NO_PAGE] * 16, NO_PAGE, False)
    assert p.n_slots == len(p.pg_live) == 16
    page = _new_page(p, 16, 3, 7)
    assert (p.n_slots, page.device, page.writer, page.refs) == (17, 3, 7, 1)
    assert 3 not in p.free_pages


def test_snapshot_pages_equal_the_views(tmp_path: Path) -> None:
    """page_tuples (arrays) == LogicalKVPage.as_tuple (views), host replicas included."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    a = checkpoint_at(s, 150)
    s.offload(a)
    step(s)
    s.activate_from(a, 100, 160, 64)  # Fork mid-page: a COW tail, shared pages
    step(s)
    for p in s.state.pools.values():
        views = [list(pg.as_tuple()) for pg in p.pages if pg is not None]
        assert views and page_tuples(p) == views
        assert any(pg.host is not None for pg in p.pages if pg is not None) or p.name != "main"
    s.close()
