"""Findings of an outside review of continuations (Move, truncate) and the commit ceiling."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import FrontierError, WritePermissionError
from ninfer_kv.journal.events import Move
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import running, step, write_tokens


def test_a_moved_sequence_truncates_into_its_own_full_pages(tmp_path: Path) -> None:
    """Review finding: a Move (``keep_source=False``, as ``swap_in`` resumes) handed the full
    pages over without a writer, so the sole owner (one reference, nothing protected) was
    refused a truncate to a mid-page frontier that a never-moved sequence may do. A Fork,
    whose source survives, is still refused: its pages stay immutable (§9.4)."""
    s = KVStore.open(small_config(tmp_path, pages=60, backend=Backend.DFLASH))
    ck = s.finish(running(s, 150, 100), retain=True)
    step(s)
    fork = s.activate_from(ck, 150, 150, 100)  # the source survives
    step(s)
    for pool in s.pools:
        before = s.digest()
        with pytest.raises((FrontierError, WritePermissionError)):
            s.truncate(fork, pool, 100)
        assert s.digest() == before
    s.finish(fork)
    moved = s.activate_from(ck, 150, 150, 100, keep_source=False)
    assert any(type(e) is Move for e in s._pending)
    step(s)
    for pool in s.pools:
        s.truncate(moved, pool, 100)  # old code: WritePermissionError, writer=-1
        assert s.page(s.handles(moved, pool)[1]).writer == moved  # it rewrites from column 36
        s.ensure_mapped(moved, pool, 140)
    step(s)
    for pool in s.pools:
        write_tokens(s, moved, pool, 100, 140)
        s.commit(moved, pool, 140)
    step(s)
    assert replay(str(tmp_path / "journal"), verify_every=1).digest == s.digest()
    s.close()


def test_a_commit_never_passes_the_logical_ceiling_s() -> None:
    """Review finding: commit checked only [committed, membership], and membership is whole
    pages, so a sequence committed past S (§3.2: page rounding does not raise the logical
    ceiling) and its checkpoint could not be continued at its own frontier."""
    s = KVStore.open(small_config(None, pages=60, context=1000, journal=False))
    S = s.plan.S
    assert S == 1000 and s.plan.L * 64 > S
    a = s.activate(900, S - 900)
    for pool in s.pools:
        s.ensure_mapped(a, pool, s.plan.L * 64)
    step(s)
    for pool in s.pools:
        write_tokens(s, a, pool, 0, s.plan.L * 64)
        before = s.digest()
        with pytest.raises(FrontierError, match=r"S=1000 \(§3.2"):
            s.commit(a, pool, S + 1)  # old code: committed 1001, then 1024
        with pytest.raises(FrontierError, match="S=1000"):
            s.commit_many(pool, [a], [s.plan.L * 64])
        assert s.digest() == before
        s.commit(a, pool, S)
    ck = s.finish(a, retain=True)
    step(s)
    s.activate_from(ck, S, S, 0)  # its own frontier continues
    step(s)


def test_a_pinned_tail_page_is_never_truncated_into(tmp_path: Path) -> None:
    """The one rule truncate checks on the page it rewrites (§9.4): no pin. A sequence
    resumed from host-only pages (a Move plus restores) holds them pinned until the boundary
    has run the restore copies; a truncate into one before then is refused, unchanged."""
    from ninfer_kv.cache.preemption import swap_in, swap_out

    s = KVStore.open(small_config(tmp_path, pages=40, host_bytes=8 << 20))
    sw = swap_out(s, running(s, 150, 100), 250)
    step(s)
    seq = swap_in(s, sw)  # restores every page: pinned until the boundary ran the copies
    before = s.digest()
    with pytest.raises(WritePermissionError, match="pins=1"):
        s.truncate(seq, "main", 140)  # inside the last page: nothing trimmed, one rewritten
    assert s.digest() == before
    step(s)
    s.truncate(seq, "main", 140)  # the copies ran: the moved page is its own to rewrite
    s.truncate(seq, "main", 100)
    assert s.page(s.handles(seq, "main")[1]).writer == seq
    s.close()
