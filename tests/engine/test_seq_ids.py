"""Seq ids end where the journal's int32 fields do, with a typed refusal.

Batched events (Materialize, CommitFrontiers, CopyTail, ...) pack seq ids as int32. Before
the refusal, id 2**31 was handed out and the first event naming it could not be packed or
applied (CopyTail's int32 assert; the commit kernel wraps it to a negative int32): the store
failed, and again after every reopen. A server admitting a few thousand sequences a second
reaches the limit in about a week.

``next_bundle`` is set directly (as after 2**31 - 2 admissions): only id allocation reads it,
and the store runs without a journal (a replay would refuse ids that skipped ahead)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_kv.engine.state import MAX_BUNDLE
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import IdsExhausted
from tests.engine.conftest import small_config


def near_the_end(tmp_path: Path, left: int) -> KVStore:
    s = KVStore.open(small_config(tmp_path, pages=64, concurrency=4, journal=False,
                                  allocate_planes=False))
    s.state.next_bundle = s._ids_base = MAX_BUNDLE + 1 - left  # as after its last record
    return s


def committed(s: KVStore, tokens: int, out: int) -> int:
    """A new sequence with ``tokens`` mapped and committed (one boundary between)."""
    a = s.activate(tokens, out)
    s.ensure_mapped_many("main", [a], [tokens])
    with s.boundary():
        pass
    s.commit_many("main", [a], [tokens])
    return a


def test_the_last_id_runs_and_the_next_is_refused_unchanged(tmp_path: Path) -> None:
    s = near_the_end(tmp_path, 2)
    a, b = s.activate(100, 80), s.activate(100, 80)
    assert b == MAX_BUNDLE
    ids = np.array([a, b])
    s.ensure_mapped_many("main", ids, [101, 101])
    with s.boundary():
        pass
    s.commit_many("main", ids, [101, 101])  # the int32 fields hold the last id exactly
    assert s.space(b, "main").committed == 101
    before = s.digest()
    for refused in (lambda: s.activate(40, 80), lambda: s.share_prefix(b, 64),
                    lambda: s.fork_live(b, 8)):
        with pytest.raises(IdsExhausted, match=str(MAX_BUNDLE)):
            refused()
        assert s.digest() == before
    assert s.finish(b, retain=True) == b  # what exists is still served: no new id needed
    with s.boundary():
        pass
    s.check_invariants()
    s.close()


def test_a_command_needing_two_ids_is_refused_whole_at_the_last_one(tmp_path: Path) -> None:
    """``fork_live`` past a whole page hands out a checkpoint id and a sequence id."""
    s = near_the_end(tmp_path, 2)
    a = committed(s, 100, 80)
    before = s.digest()
    with pytest.raises(IdsExhausted):
        s.fork_live(a, 8)
    assert s.digest() == before
    assert s.activate(40, 8) == MAX_BUNDLE  # the one id left is still handed out
    s.check_invariants()
    s.close()


def test_eviction_releases_whole_when_no_id_is_left_for_a_trimmed_prefix(
        tmp_path: Path) -> None:
    """Review finding: at the last id, ``LruRetention.make_room`` picked a tail trim, whose
    ``release_tail`` needs an id for the prefix it keeps: ``IdsExhausted`` on every call, no
    page freed, and the victim stayed first in line. It releases the checkpoint whole now."""
    from ninfer_kv.cache.retention import LruRetention

    s = near_the_end(tmp_path, 2)
    ck = s.finish(committed(s, 640, 100), retain=True)
    with s.boundary():
        pass
    cache = LruRetention(block_tokens=64)
    cache.retain(ck, list(range(10)))
    s.activate(64, 1000)  # the last id: still handed out
    assert s.sole_device_pages(ck) == 10
    assert cache.make_room(s, 2) == "release"
    assert ck not in s.checkpoints() and ck not in cache.entries
    s.check_invariants()
    s.close()


def test_no_id_past_the_last_is_admitted_from_a_journal_or_snapshot(tmp_path: Path) -> None:
    """Review finding: only commands refused; ``apply`` took an Activate or a new checkpoint
    past 2**31 - 1 (a damaged or foreign journal), and a snapshot could carry any
    ``next_bundle``. Refused before any change now."""
    from ninfer_kv.engine.apply import apply
    from ninfer_kv.engine.state import decode_state, encode_state
    from ninfer_kv.journal import events as ev

    s = near_the_end(tmp_path, 1)
    a = committed(s, 100, 80)  # the last id, with a whole page committed: a source to share
    st, before = s.state, s.digest()
    row = st.pools["main"].free_rows.first()
    for e in (ev.Activate(MAX_BUNDLE + 1, "main", 1, row, 64, 10),
              ev.Share(a, MAX_BUNDLE + 1, "main", 1)):
        with pytest.raises(AssertionError, match="int32"):
            apply(st, e)
        assert s.digest() == before
    blob = encode_state(st)  # next_bundle = MAX_BUNDLE + 1: the most a journal reaches
    assert decode_state(blob).next_bundle == MAX_BUNDLE + 1
    st.next_bundle = MAX_BUNDLE + 2
    with pytest.raises(ValueError, match="next seq id"):
        decode_state(encode_state(st))
    st.next_bundle = MAX_BUNDLE + 1
    s.close()


def test_activate_says_ids_before_capacity(tmp_path: Path) -> None:
    """Review finding: ``activate`` checked capacity first, so an engine that evicts on
    ``CapacityExhausted`` and retries released a cached checkpoint before learning that no
    id was left. Ids are checked first now, as ``activate_from`` and ``fork_live`` do."""
    s = near_the_end(tmp_path, 2)
    s.activate(1990, 40)
    s.activate(1990, 40)  # the last id; the two reserve the whole 64-page pool
    with pytest.raises(IdsExhausted):
        s.activate(1990, 40)  # no id, and no room either
    s.close()
