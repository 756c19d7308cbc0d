"""An import that fails on the wire with receives still posted into its pages keeps those
pages until the receives end (review finding): it used to free them at once, so a byte
arriving late — a sender that was slow, not dead — landed in pages another request had got
by then. In process: the wire is faked, its receives end when the test says so."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.dist import TransferAborted, free_aborted, receive
from ninfer_kv.dist.transfer import MAGIC, VERSION, layout_of

PAGES = 3


class FakeWork:
    """A posted receive: ``wait`` raises like a broken wire when ``fails``; it has ended
    once ``done`` (a wait on one not done times out, and it stays pending: an NCCL receive
    in flight)."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.done = fails, fails
        self.waits: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        self.waits.append(timeout)
        if self.fails:
            self.done = True
            raise RuntimeError("Connection closed by peer")
        if not self.done:
            assert timeout is not None and timeout.total_seconds() > 0, "would block forever"
            raise RuntimeError("timed out")

    def is_completed(self) -> bool:
        return self.done


def open_store() -> KVStore:
    return KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                                    serving=ServingConfig(max_context=512, max_concurrency=3),
                                    kv_tokens=16 * 64))


def fake_wire(monkeypatch: pytest.MonkeyPatch, store: KVStore, rest_ended: bool | None,
              per: int = 1, pages: int = PAGES) -> list[FakeWork]:
    """A header for a checkpoint of ``pages`` pages in chunks of ``per`` (one: every chunk's
    receives are posted up front, into the pages); the first receive fails, the others end
    only when ``rest_ended`` (a dead peer fails them all) or when the test marks them done;
    ``rest_ended=None``: each fails when waited on, and has ended only then (gloo's)."""
    pb = layout_of(store)["pools"]["main"]["page_bytes"]
    header = {"magic": MAGIC, "version": VERSION, "checkpoint": 7, "layout": layout_of(store),
              "reason": "stop", "meta": b"", "pools": [["main", pages * 64, pages, pb, per]]}
    works: list[FakeWork] = []

    def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> FakeWork:
        w = FakeWork(fails=not works or rest_ended is None)  # None: every one fails
        w.done = not works or bool(rest_ended)
        works.append(w)
        return w

    monkeypatch.setattr(receive, "recv_control", lambda peer, group, what: header)
    monkeypatch.setattr(receive, "_status", lambda peer, group, **fields: None)
    monkeypatch.setattr(receive, "wire_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(receive.dist, "irecv", irecv)
    monkeypatch.setattr(receive, "SETTLE_S", 0.05)
    return works


def test_pages_with_receives_still_posted_are_held_until_they_end(monkeypatch) -> None:  # noqa: ANN001
    store = open_store()
    before = (store.occupancy(), store.active())
    works = fake_wire(monkeypatch, store, rest_ended=False)
    with pytest.raises(TransferAborted, match="receives posted into them"):
        receive.import_(store, 0)
    planes = len(store.device.planes("main"))  # K and V: a receive each, and one of CRCs
    assert len(works) == PAGES * (planes + 1)  # every chunk posted up front; one failed
    held = store.active()
    assert len(held) == 1 and free_aborted(store) == held  # its pages are not free
    assert store.occupancy()["main"]["allocated"] == PAGES
    assert store.violations() == []
    for w in works:
        w.done = True               # the late bytes arrived, or the wire failed them
    assert free_aborted(store) == []
    assert (store.occupancy(), store.active()) == before and store.violations() == []
    store.close()


def test_a_dead_peer_frees_the_pages_at_once(monkeypatch) -> None:  # noqa: ANN001
    store = open_store()
    before = (store.occupancy(), store.active())
    fake_wire(monkeypatch, store, rest_ended=True)
    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0)
    assert (store.occupancy(), store.active()) == before and free_aborted(store) == []
    store.close()


def test_receives_a_dead_gloo_peer_left_end_once_waited_on(monkeypatch) -> None:  # noqa: ANN001
    """gloo reports a receive on a connection that failed as ended only once waited on (its
    wait raises at once; measured): the abort waits on each, and frees the pages at once —
    polling alone held them forever after every dead sender."""
    store = open_store()
    before = (store.occupancy(), store.active())
    works = fake_wire(monkeypatch, store, rest_ended=None)
    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0)
    assert all(w.done and w.waits for w in works) and len(works) > 1
    assert (store.occupancy(), store.active()) == before and free_aborted(store) == []
    store.close()


def test_the_next_import_frees_what_has_ended(monkeypatch) -> None:  # noqa: ANN001
    store = open_store()
    before = store.occupancy()
    works = fake_wire(monkeypatch, store, rest_ended=False)
    with pytest.raises(TransferAborted):
        receive.import_(store, 0)
    for w in works:
        w.done = True
    works.clear()
    with pytest.raises(TransferAborted):  # the next one fails too, after freeing the first
        receive.import_(store, 0)
    assert len(store.active()) == 1  # only the second import's sequence is held
    for w in works:
        w.done = True
    assert free_aborted(store) == [] and store.occupancy() == before
    store.close()


def test_a_receive_posted_before_a_failing_post_is_waited_for(monkeypatch) -> None:  # noqa: ANN001
    """The wire fails while posting chunk 1: its first receive, posted already, still counts
    (chunk 0's have ended, so only that one holds the pages)."""
    store = open_store()
    works = fake_wire(monkeypatch, store, rest_ended=False)
    planes = len(store.device.planes("main"))

    def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> FakeWork:
        if len(works) == planes + 2:  # chunk 1's second receive
            raise RuntimeError("Connection reset by peer")
        w = FakeWork(fails=False)
        w.done = len(works) <= planes  # chunk 0's: ended
        works.append(w)
        return w

    monkeypatch.setattr(receive.dist, "irecv", irecv)
    with pytest.raises(TransferAborted, match="1 receives posted into them"):
        receive.import_(store, 0)
    assert len(store.active()) == 1 and store.occupancy()["main"]["allocated"] == PAGES
    works[-1].done = True
    assert free_aborted(store) == [] and store.active() == []
    store.close()


def test_staged_receives_hold_the_pages_and_retire_the_staging(monkeypatch) -> None:  # noqa: ANN001
    """Scattered page groups are received through staging, two chunks at a time: a receive
    still posted into a staging buffer holds the sequence too (its bytes are scattered into
    the pages), and the buffer is not handed to the next chunk."""
    from ninfer_kv.dist import packing

    store = open_store()
    a, b = store.activate(256, 0), store.activate(256, 0)
    for t in range(1, 5):  # page groups alternate between a and b
        store.ensure_mapped(a, "main", 64 * t)
        store.ensure_mapped(b, "main", 64 * t)
    with store.boundary():
        pass
    store.finish(a)  # a's page groups are free now, none consecutive with the next
    with store.boundary():
        pass
    works = fake_wire(monkeypatch, store, rest_ended=False, per=2, pages=6)
    with pytest.raises(TransferAborted, match="receives posted into them"):
        receive.import_(store, 0)
    planes = len(store.device.planes("main"))
    assert len(works) == 2 * (planes + 1)  # two of three chunks posted: staging, two slots
    assert packing._STAGING == {}
    assert len(store.active()) == 2
    for w in works:
        w.done = True
    assert free_aborted(store) == [] and store.active() == [b]
    store.close()
