"""Snapshot pruning keeps what recovery needs. Review finding (medium): ``write_snapshot``
kept the newest ``keep_snapshots`` by age alone, so after a compaction two snapshots recovery
would skip (an engine bug encoding a state that does not load — the case open, compaction
and ``load_snapshot`` defend against) pruned the only one covering the compacted log: the
store never opened again, not even after salvage. A new snapshot now licenses pruning only
if it loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import ninfer_kv.engine.core as core
from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.log import Journal
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


def test_unusable_snapshots_never_prune_the_one_recovery_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config(tmp_path, pages=80, sync="commit", host_bytes=8 << 20,
                       persist_dir=str(tmp_path / "p"))
    s = KVStore.open(cfg)
    first = checkpoint_at(s, 100)
    s.offload(first)
    step(s)
    s.snapshot()
    assert s.compact() >= 1                 # the log now needs that snapshot
    with monkeypatch.context() as m:
        m.setattr(core, "encode_state", lambda st: b"\xc1 an engine bug")
        for _ in range(2):
            checkpoint_at(s, 64)
            s.snapshot()                    # unusable: recovery would skip it
    second = checkpoint_at(s, 200)
    s.offload(second)
    step(s)
    s.close()
    r = KVStore.open(cfg)
    assert {first, second} <= set(r.recovery.kept)
    assert len(r.recovery.snapshots_skipped) == 2
    r.close()
    s = KVStore.open(cfg)                   # and a good snapshot prunes as before
    s.snapshot()
    s.snapshot()
    s.close()
    assert len(list((tmp_path / "journal").glob("snap-*.snap"))) == 2
    r2 = KVStore.open(cfg)
    assert r2.recovery.kept == r.recovery.kept and r2.recovery.snapshots_skipped == []
    r2.close()


def test_write_snapshot_prunes_only_what_an_accepted_snapshot_replaces(tmp_path: Path) -> None:
    j = Journal.open(str(tmp_path), CODEC)
    for _ in range(3):
        j.append([])
        j.write_snapshot(b"good", accept=lambda p: p == b"good")
    assert len(list(tmp_path.glob("snap-*.snap"))) == 2
    for _ in range(2):
        j.append([])
        j.write_snapshot(b"bad", accept=lambda p: p == b"good")
    assert len(list(tmp_path.glob("snap-*.snap"))) == 4  # nothing pruned
    j.append([])
    j.write_snapshot(b"good", accept=lambda p: p == b"good")
    assert len(list(tmp_path.glob("snap-*.snap"))) == 2
    j.close()
