"""``sync="commit"`` fsyncs the records that change what a reopen keeps, and no others: a
decode round touches only active sequences, which a reopen aborts (README, "Durability
contract"). A later durable record's fsync covers every record before it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal.log import SyncPolicy
from tests.engine.test_continuation import checkpoint_at, step
from tests.engine.test_host_tier import host_store


def store(tmp_path: Path) -> KVStore:
    return host_store(tmp_path, sync=SyncPolicy.COMMIT)


def synced(s: KVStore) -> bool:
    assert s.journal is not None
    return s.journal.durable_seq == s.journal.last_seq


def decode_round(s: KVStore, seq: int) -> None:
    sp = s.space(seq)
    s.ensure_mapped(seq, "main", sp.committed + 1)
    step(s)
    s.commit(seq, "main", sp.committed + 1)
    step(s)


def test_a_decode_round_is_not_fsynced(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert synced(s)  # open itself ends with a sync
    a = s.activate(10, 100)
    s.ensure_mapped(a, "main", 10)
    step(s)
    decode_round(s, a)
    assert not synced(s)
    s.finish(a)  # not retained: nothing a reopen keeps changes
    step(s)
    assert not synced(s)
    s.close()


CASES: dict[str, tuple[bool, Callable[[KVStore, int], object]]] = {
    # name: (offload the checkpoint first, the command whose record must be fsynced)
    "finish-retain": (False, lambda s, ck: checkpoint_at(s, 50)),
    "release": (False, lambda s, ck: s.release(ck)),
    "move": (False, lambda s, ck: s.activate_from(ck, 100, 100, 10, keep_source=False,
                                                  mode="move")),
    "host-publish": (False, lambda s, ck: s.offload(ck)),
    "drop-host": (True, lambda s, ck: s.drop_host(ck)),
    "release-tail": (False, lambda s, ck: s.release_tail(ck, 64)),
    "metadata": (False, lambda s, ck: s.set_metadata(ck, {"tokens": [1, 2]})),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_record_that_changes_what_survives_is_fsynced(tmp_path: Path, name: str) -> None:
    offload_first, command = CASES[name]
    s = store(tmp_path)
    ck = checkpoint_at(s, 100)
    if offload_first:
        s.offload(ck)
        step(s)
    decode_round(s, s.activate(10, 100))
    assert not synced(s)
    command(s, ck)
    step(s)
    assert synced(s)
    s.close()


def test_other_policies_are_unchanged(tmp_path: Path) -> None:
    s = host_store(tmp_path, sync=SyncPolicy.OFF)
    decode_round(s, s.activate(10, 100))
    checkpoint_at(s, 100)  # a retained finish: still no fsync under "off"
    assert not synced(s)
    s.close()
