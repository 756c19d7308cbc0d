"""A promoted standby hands out no id its leader handed out (review finding, 2026-12-04):
the leader acknowledged only messages that change what a reopen keeps, so a standby's
journal could lag the leader's ids without limit (admissions are never durable on their
own); when the leader died, the promoted standby handed out ids the leader had returned.
The leader now asks for an ack once the ids since the last acknowledged message pass half
of ``state.ID_GAP`` — what a promotion's reopen skips — and a standby that cannot make them
durable stops the stream within that window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ninfer_kv import KVStore
from ninfer_kv.dist import Follower, Leader
from ninfer_kv.dist.errors import StreamBroken
from ninfer_kv.dist.stream import FAILED
from ninfer_kv.engine import state as state_mod
from ninfer_kv.journal.log import SyncPolicy
from tests.dist.test_standby import Link, cfg


class FullDisk:
    """The standby's segment file once its disk is full: writes fail, the rest works."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def write(self, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def leader_and_standby(tmp_path: Path) -> tuple[KVStore, Leader, Link]:
    """A leader (sync=commit) streaming to one standby over an in-process link."""
    link = Link()
    store = KVStore.open(cfg(tmp_path, "leader", sync=SyncPolicy.COMMIT))  # type: ignore[arg-type]
    leader = Leader(store, link.send, send_digest=False, acks=[link.ack])
    link.follower = Follower.from_hello(cfg(tmp_path, "standby", sync=SyncPolicy.COMMIT),  # type: ignore[arg-type]
                                        link.hello, ack=link.acks.append)
    return store, leader, link


def test_a_promoted_standby_hands_out_no_id_its_leader_did(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(state_mod, "ID_GAP", 8)
    store, leader, link = leader_and_standby(tmp_path)
    standby = link.follower
    handed: list[int] = []
    with pytest.raises(StreamBroken):
        for i in range(40):  # admissions only: no record changes what a reopen keeps
            if i == 3:
                j = standby.store.journal
                assert j is not None
                j._file = FullDisk(j._file)  # type: ignore[assignment]
            batch = [store.activate(10, 10), store.activate(10, 10)]
            for b in batch:
                store.finish(b)
            handed += batch
            with leader.boundary():
                pass
    assert leader.failed is not None  # the leader learned within the window
    promoted = standby.promote()      # the leader's process is gone
    new = [promoted.activate(10, 10) for _ in range(3)]
    assert not set(new) & set(handed), (new, handed)
    promoted.close()
    store.close()


def test_after_an_ack_a_step_gets_the_whole_window(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: the leader lowered the store's window to the acknowledged ids before
    the message went and never raised it after the ack, so each step after an ack got less
    than half the window a plain store gets."""
    monkeypatch.setattr(state_mod, "ID_GAP", 8)
    store, leader, link = leader_and_standby(tmp_path)
    for _ in range(4):  # 6 ids a step: over half the window, so every message is acked
        for _ in range(6):
            store.finish(store.activate(10, 10))
        with leader.boundary():
            pass
    assert leader.failed is None and leader.stats["acked"] >= 3 and not link.errors
    store.close()


@pytest.mark.parametrize("how", ["broken", "ended"])
def test_a_stream_that_stopped_keeps_the_window_on_the_standby(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Review finding: when the stream broke or ended, the leader's store stopped counting
    its id window from what the standby held, kept serving, and a standby promoted later
    handed its new ids out again. The window stays on the acknowledged ids: the store hands
    out at most one more window (then IdsExhausted), all above what a promotion skips."""
    from ninfer_kv.errors import IdsExhausted
    monkeypatch.setattr(state_mod, "ID_GAP", 8)
    store, leader, link = leader_and_standby(tmp_path)
    standby = link.follower
    assert standby is not None
    handed: list[int] = []

    def admit(boundary: Any) -> None:
        b = store.activate(10, 10)
        store.finish(b)
        handed.append(b)
        with boundary():
            pass
    for _ in range(2):
        admit(leader.boundary)
    if how == "broken":
        leader._stop(FAILED)  # as after a StreamBroken
    else:
        leader.close()
    with pytest.raises(IdsExhausted):
        for _ in range(20):
            admit(store.boundary)
    promoted = standby.promote()
    new = [promoted.activate(10, 10) for _ in range(3)]
    assert not set(new) & set(handed), (new, handed)
    promoted.close()
    store.close()
