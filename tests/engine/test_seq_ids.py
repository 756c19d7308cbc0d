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
    s.state.next_bundle = MAX_BUNDLE + 1 - left
    return s


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
    a = s.activate(100, 80)
    s.ensure_mapped_many("main", [a], [100])
    with s.boundary():
        pass
    s.commit_many("main", [a], [100])
    before = s.digest()
    with pytest.raises(IdsExhausted):
        s.fork_live(a, 8)
    assert s.digest() == before
    assert s.activate(40, 8) == MAX_BUNDLE  # the one id left is still handed out
    s.check_invariants()
    s.close()
