"""An import that fails with receives still posted frees its pages only once none of them can
write (review finding): it used to free them at once, so a byte arriving late — a sender that
was slow, not dead — landed in pages another request had got by then. In process: the wire is
faked, and so is the clock its waits time out on."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.dist import TransferAborted, receive
from ninfer_kv.dist.transfer import MAGIC, VERSION, layout_of
from ninfer_kv.errors import StoreFailed

PAGES = 3


class FakeWork:
    """A posted receive. ``how``: "ended" (done already); "fails" (its wait raises like a
    broken wire, and it has ended then: gloo's, measured); "arrives" (its wait returns: the
    sender is still sending); "pending" (a wait with a timeout sleeps it out on the fake
    clock and raises, the receive still pending — in flight; one without would block)."""

    def __init__(self, how: str, clock: list[float]) -> None:
        self.how, self.clock, self.done = how, clock, how == "ended"
        self.waits: list[float | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        self.waits.append(None if timeout is None else timeout.total_seconds())
        if self.how == "pending":
            assert timeout is not None and timeout.total_seconds() > 0, "would block forever"
            self.clock[0] += timeout.total_seconds()
            raise RuntimeError("Timed out waiting for recv operation to complete")
        if self.how == "interrupted":
            raise KeyboardInterrupt
        self.done = True
        if self.how == "fails":
            raise RuntimeError("Connection closed by peer")

    def is_completed(self) -> bool:
        return self.done


def open_store(journal: Path | None = None) -> KVStore:
    return KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                                    serving=ServingConfig(max_context=512, max_concurrency=3),
                                    kv_tokens=16 * 64,
                                    journal_dir=None if journal is None else str(journal)))


def fake_wire(monkeypatch: pytest.MonkeyPatch, store: KVStore, hows: Any, per: int = 1,
              pages: int = PAGES) -> list[FakeWork]:
    """A header for a checkpoint of ``pages`` pages in chunks of ``per`` (one: every chunk's
    receives are posted up front, into the pages); receive ``k`` behaves as ``hows(k)``."""
    pb = layout_of(store)["pools"]["main"]["page_bytes"]
    header = {"magic": MAGIC, "version": VERSION, "checkpoint": 7, "layout": layout_of(store),
              "reason": "stop", "meta": b"", "pools": [["main", pages * 64, pages, pb, per]]}
    works: list[FakeWork] = []
    clock = [0.0]

    def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> FakeWork:
        works.append(FakeWork(hows(len(works)), clock))
        return works[-1]

    monkeypatch.setattr(receive, "recv_control", lambda peer, group, what: header)
    monkeypatch.setattr(receive, "_status", lambda peer, group, **fields: None)
    monkeypatch.setattr(receive, "wire_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(receive.dist, "irecv", irecv)
    monkeypatch.setattr(receive.time, "monotonic", lambda: clock[0])
    return works


def first_fails(rest: str) -> Any:
    return lambda k: "fails" if k == 0 else rest


def state(store: KVStore) -> tuple[Any, ...]:
    return store.occupancy(), store.active(), store.checkpoints(), store.violations()


def test_receives_still_pending_into_pages_stop_the_store(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """In flight after the wire failed: freeing would hand the page groups on while a late
    byte may land in them, so the store stops instead; a reopen recovers it as it was."""
    store = open_store(tmp_path)
    before = state(store)
    works = fake_wire(monkeypatch, store, first_fails("pending"))
    with pytest.raises(TransferAborted, match="store stopped .*receives posted into seq"):
        receive.import_(store, 0)
    planes = len(store.device.planes("main"))  # K and V: a receive each, and one of CRCs
    assert len(works) == PAGES * (planes + 1)  # every chunk posted up front; one failed
    assert store.failed is not None
    with pytest.raises(StoreFailed):
        store.activate(64, 1)  # no page group of it goes to another request
    store.close()
    again = open_store(tmp_path)
    assert state(again) == before
    again.close()


def test_the_wait_is_bounded_in_all(monkeypatch) -> None:  # noqa: ANN001
    """Review finding: each pending receive got at least 10 ms past the deadline, so
    thousands of them stalled the abort for minutes; ``SETTLE_S`` bounds it in all."""
    store = open_store()
    works = fake_wire(monkeypatch, store, first_fails("pending"), pages=8)
    monkeypatch.setattr(receive, "SETTLE_S", 0.2)
    with pytest.raises(TransferAborted, match="store stopped"):
        receive.import_(store, 0)
    assert works[0].clock[0] <= 0.2 + 0.01  # the fake clock: what the waits slept
    assert sum(len(w.waits) for w in works) < len(works)  # past the deadline, none waited


def test_a_dead_peer_frees_the_pages_at_once(monkeypatch) -> None:  # noqa: ANN001
    store = open_store()
    before = state(store)
    fake_wire(monkeypatch, store, first_fails("ended"))
    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0)
    assert state(store) == before and store.failed is None
    store.close()


def test_receives_a_dead_gloo_peer_left_end_once_waited_on(monkeypatch) -> None:  # noqa: ANN001
    """gloo reports a receive on a connection that failed as ended only once waited on (its
    wait raises at once; measured): the abort waits on each, and frees the pages at once —
    polling alone would have found them all pending."""
    store = open_store()
    before = state(store)
    works = fake_wire(monkeypatch, store, lambda k: "fails")
    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0)
    assert all(w.done and w.waits for w in works) and len(works) > 1
    assert state(store) == before and store.failed is None
    store.close()


def test_a_receive_posted_before_a_failing_post_is_waited_for(monkeypatch) -> None:  # noqa: ANN001
    """The wire fails while posting chunk 1: its first receive, posted already, still counts
    (chunk 0's have ended, so only that one is pending)."""
    store = open_store()
    planes = len(store.device.planes("main"))
    works = fake_wire(monkeypatch, store, lambda k: "ended" if k <= planes else "pending")
    fake = receive.dist.irecv

    def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> FakeWork:
        if len(works) == planes + 2:  # chunk 1's second receive
            raise RuntimeError("Connection reset by peer")
        return fake(tensor, src, group)

    monkeypatch.setattr(receive.dist, "irecv", irecv)
    with pytest.raises(TransferAborted, match="1 receives posted into seq"):
        receive.import_(store, 0)
    assert store.failed is not None


def test_staged_receives_retire_the_staging_and_free_the_pages(monkeypatch) -> None:  # noqa: ANN001
    """Scattered page groups are received through staging, two chunks at a time: a receive
    still pending there writes no page (scatter runs after the CRC check), so the pages are
    freed, and the staging buffers are not handed to the next chunk."""
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
    before = state(store)
    packing.staging(torch.device("cpu"), 0, 0, 8)
    works = fake_wire(monkeypatch, store, first_fails("pending"), per=2, pages=6)
    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0)
    planes = len(store.device.planes("main"))
    assert len(works) == 2 * (planes + 1)  # two of three chunks posted: staging, two slots
    assert packing._STAGING == {}
    assert state(store) == before and store.failed is None
    store.close()


def test_this_side_failing_drains_the_receives_then_frees(monkeypatch) -> None:  # noqa: ANN001
    """Not the wire's failure (here an interrupt in the chunk hook): the sender is still
    sending, so each receive is waited on until it ends — a wait that timed out would close
    a healthy gloo connection for good — and then the pages are freed."""
    store = open_store()
    before = state(store)
    works = fake_wire(monkeypatch, store, lambda k: "arrives")

    def hook(pool: str, idx: int, data: list[torch.Tensor]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(TransferAborted, match="every reserved page freed"):
        receive.import_(store, 0, on_chunk=hook)
    assert all(w.done for w in works) and all(t is None for w in works for t in w.waits)
    assert state(store) == before and store.failed is None
    store.close()


def test_an_interrupt_while_waiting_stops_the_store(monkeypatch) -> None:  # noqa: ANN001
    """Review finding: an interrupt during the wait left the sequence neither freed nor
    kept from another request; whether its receives end is unknown, so the store stops."""
    store = open_store()
    fake_wire(monkeypatch, store, lambda k: {0: "fails", 1: "interrupted"}.get(k, "pending"))
    with pytest.raises(KeyboardInterrupt):
        receive.import_(store, 0)
    assert store.failed is not None
    with pytest.raises(StoreFailed):
        store.activate(64, 1)
