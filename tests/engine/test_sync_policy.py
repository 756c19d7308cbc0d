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


def running(s: KVStore, tokens: int = 130) -> int:
    """A running sequence with ``tokens`` committed (two whole pages and a partial one)."""
    a = s.activate(10, 300)
    s.ensure_mapped(a, "main", tokens)
    step(s)
    s.commit(a, "main", tokens)
    step(s)
    return a


def test_share_prefix_is_fsynced(tmp_path: Path) -> None:
    """A Share whose checkpoint outlives its record is durable (fork_live's, released in the
    same record, is not: below)."""
    s = store(tmp_path)
    a = running(s)
    assert not synced(s)
    s.share_prefix(a)
    step(s)
    assert synced(s)
    s.close()


def test_fork_live_and_metadata_of_a_running_sequence_are_not_fsynced(tmp_path: Path) -> None:
    """Review note: fork_live journals Share + Fork + Release of a transient checkpoint, and
    set_metadata of a running sequence changes nothing a reopen keeps (it aborts running
    sequences); both were fsynced (and, with standbys, waited for their acks). The record
    that retains the sequence is durable, covers the metadata record before it, and the
    metadata survives a reopen."""
    s = store(tmp_path)
    child = s.fork_live(running(s), 50)             # whole pages shared + a COW tail
    step(s)
    assert not synced(s)
    s.set_metadata(child, {"tokens": [7, 8]})
    step(s)
    assert not synced(s)
    ck = s.finish(child, retain=True)
    step(s)
    assert synced(s) and ck is not None
    s.offload(ck)  # a checkpoint survives a reopen with host replicas (§5.1)
    step(s)
    s.close()
    again = KVStore.open(s.config)
    assert again.checkpoint_info(ck).metadata == {"tokens": [7, 8]}
    again.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_the_interval_is_configured_on_the_store_and_checked(tmp_path: Path, bad: object) -> None:
    """README: ``"interval"`` fsyncs once ``StoreConfig.sync_interval_ms`` passed (a later
    audit found the README naming a field the store did not have: the journal's 10 ms held)."""
    from ninfer_kv.errors import ConfigError

    s = host_store(tmp_path, sync=SyncPolicy.INTERVAL, sync_interval_ms=2.5)
    assert s.journal is not None and s.journal.options.interval_ms == 2.5
    s.close()
    with pytest.raises(ConfigError, match="sync_interval_ms=.* positive, finite"):
        host_store(tmp_path / "x", sync=SyncPolicy.INTERVAL, sync_interval_ms=bad)
