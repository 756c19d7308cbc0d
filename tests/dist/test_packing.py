"""The transfer's per-plane chunks are the host tier's packed pages (§5.3) cut by plane, for
every profile and both plane orders: concatenated they equal ``pack_pages``, their chained
CRC equals the packed page's, and receiving them (in place or through staging) restores the
page groups byte for byte."""

from __future__ import annotations

import pytest
import torch
from crc32c import crc32c

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.dist.packing import crcs, gather, scatter, targets
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import Profile
from ninfer_kv.engine.pages import LogicalKVPage
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.kernels.copy import pack_pages

CPU = torch.device("cpu")


def fake_pages(ids: list[int]) -> list[LogicalKVPage]:
    pool = PoolState("fake", max(ids) + 1, 1, 1)
    pool.init_pages(list(range(len(ids))), ids, -1, False)
    return [LogicalKVPage(pool, i) for i in range(len(ids))]


@pytest.mark.parametrize("profile", list(Profile))
def test_chunks_are_the_host_layout_cut_by_plane(profile: Profile) -> None:
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=2, kv_heads=2, head_dim=64, profile=profile,
                            draft_layers=1, draft_kv_heads=2, draft_head_dim=64),
        serving=ServingConfig(max_context=256, max_concurrency=2, backend=Backend.DFLASH),
        kv_tokens=8 * 64))
    assert "draft_full" in store.pools  # head-major planes are covered too
    for pool in store.pools:
        planes = store.device.planes(pool)
        order = store.device.pools[pool].geometry.order
        for t in planes:
            t.view(torch.uint8).random_(0, 256)
        pb = next(s.page_bytes for s in store.state.pool_specs if s.name == pool)
        for ids in ([1, 2, 3], [5, 0, 3, 7, 2, 6]):  # a run (zero copy when page-major); scattered
            want = torch.empty(len(ids), pb, dtype=torch.uint8)
            pack_pages(planes, order, ids, want)
            chunk = gather(store, pool, fake_pages(ids), 0, CPU)
            got = torch.cat([c.reshape(len(ids), -1) for c in chunk], 1)
            assert torch.equal(got, want), (profile, pool, ids)
            assert crcs(chunk) == [crc32c(want[i].numpy()) for i in range(len(ids))]
            sent = [c.clone() for c in chunk]
            before = [t.clone() for t in planes]
            for t in planes:
                t.zero_()
            dest, in_place = targets(store, pool, ids, 1, CPU)
            assert in_place == (ids == [1, 2, 3] and pool == "main")
            for d, c in zip(dest, sent, strict=True):
                d.copy_(c)                     # what irecv does
            if not in_place:
                scatter(store, pool, ids, dest)
            again = torch.empty_like(want)
            pack_pages(planes, order, ids, again)
            assert torch.equal(again, want)
            for t, b in zip(planes, before, strict=True):
                t.copy_(b)
    store.close()


def test_a_receiver_without_planes_refuses_the_header() -> None:
    """Review repro: a receiver opened with allocate_planes=False passed the header check,
    posted no receive for the planes ("in place", with no planes), and gloo killed its
    process when the first plane's bytes arrived. It now refuses before "ready"."""
    from ninfer_kv.dist.errors import TransferRefused
    from ninfer_kv.dist.packing import in_place_views
    from ninfer_kv.dist.receive import _check_header
    from ninfer_kv.dist.transfer import MAGIC, VERSION, layout_of

    def open_(planes: bool) -> KVStore:
        return KVStore.open(StoreConfig(
            model=ModelGeometry(layers=2, kv_heads=2, head_dim=64),
            serving=ServingConfig(max_context=256, max_concurrency=2), kv_tokens=8 * 64,
            allocate_planes=planes))

    sender, receiver = open_(True), open_(False)
    pb = sender.plan.layout.pools[next(iter(sender.plan.layout.pools))].page_bytes
    header = {"magic": MAGIC, "version": VERSION, "checkpoint": 1, "layout": layout_of(sender),
              "reason": None, "meta": b"", "pools": [["main", 128, 2, pb, 1]]}
    assert _check_header(sender, header)              # the same header passes with planes
    with pytest.raises(TransferRefused, match="pool main has no planes"):
        _check_header(receiver, header)
    assert in_place_views(receiver, "main", [0, 1], torch.device("cpu")) is None
    sender.close()
    receiver.close()


def test_every_header_field_is_checked_before_anything_is_reserved() -> None:
    """Review finding: checkpoint, meta and reason were read only at publication: a header
    without ``checkpoint`` raised KeyError after the checkpoint was published, bad metadata
    a DecodeError after every byte moved."""
    import msgspec

    from ninfer_kv.dist.errors import TransferRefused
    from ninfer_kv.dist.receive import _check_header
    from ninfer_kv.dist.transfer import MAGIC, VERSION, layout_of
    from ninfer_kv.journal.events import METADATA_MAX, REASON_MAX

    store = KVStore.open(StoreConfig(model=ModelGeometry(layers=2, kv_heads=2, head_dim=64),
                                     serving=ServingConfig(max_context=256, max_concurrency=2),
                                     kv_tokens=8 * 64))
    pb = store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    good = {"magic": MAGIC, "version": VERSION, "checkpoint": 3, "layout": layout_of(store),
            "reason": "stop", "meta": msgspec.msgpack.encode({"seed": 7}),
            "pools": [["main", 128, 2, pb, 1]]}
    assert _check_header(store, good)
    for bad in ({"checkpoint": None}, {"checkpoint": "3"}, {"meta": "text"},
                {"meta": b"\xc1"}, {"reason": 7}):
        with pytest.raises(TransferRefused, match="header"):
            _check_header(store, {**good, **bad})
    # what publication's finish and set_metadata would refuse (review finding: they failed
    # after every byte had moved; tests/dist/test_transfer_refusals.py runs it on two ranks)
    big = msgspec.msgpack.encode(b"m" * (METADATA_MAX + 1))
    for bad, why in (({"reason": "x" * (REASON_MAX + 1)}, "reason refused.*REASON_MAX"),
                     ({"reason": "\ud800"}, "reason refused.*UTF-8"),
                     ({"meta": big}, "METADATA_MAX"),
                     # nested past msgspec's depth: RecursionError, which left the wire out
                     # of step (review of the fix)
                     ({"meta": b"\x91" * 1000 + b"\xc0"}, "RecursionError")):
        with pytest.raises(TransferRefused, match=why):
            _check_header(store, {**good, **bad})
    assert _check_header(store, {**good, "reason": "é" * (REASON_MAX // 2), "meta": b""})
    no_id = dict(good)
    del no_id["checkpoint"]
    with pytest.raises(TransferRefused, match="checkpoint=None"):
        _check_header(store, no_id)
    # the geometry rules (two-rank tests reach them too; these run in one process)
    other = {**good["layout"], "profile": "k8v4"}
    for bad, why in (({"magic": "XXXX"}, "magic/version"), ({"version": VERSION + 1}, "magic"),
                     ({"layout": other}, "page layout differs"),
                     ({"pools": [["mtp", 128, 2, pb, 1]]}, "receiver pools"),
                     ({"pools": [["main", 128, 2, pb, 0]]}, "chunks of 0 pages"),
                     ({"pools": [["main", 128, 2, pb + 1, 1]]}, "page bytes not"),
                     ({"pools": [["main", 128, 3, pb, 1]]}, "3 pages for frontier 128")):
        with pytest.raises(TransferRefused, match=why):
            _check_header(store, {**good, **bad})
    store.close()


def test_header_and_status_messages_are_sealed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: only the page bytes had a CRC; a flipped bit in the header's frontier
    or metadata was published as the checkpoint's. Control messages are sealed now."""
    import msgspec

    from ninfer_kv.dist import transfer
    from ninfer_kv.dist.errors import TransferCorrupt, TransferRefused
    from ninfer_kv.dist.stream import seal

    header = {"magic": transfer.MAGIC, "pools": [["main", 150, 3, 4096, 1]]}
    sealed = seal(msgspec.msgpack.encode(header))
    inbox: list[bytes] = []
    monkeypatch.setattr(transfer, "recv_bytes", lambda peer, group: inbox.pop(0))
    monkeypatch.setattr(transfer, "send_bytes", lambda data, peer, group: inbox.append(data))
    transfer.send_control(header, 1, None)
    assert inbox == [sealed] and transfer.recv_control(0, None, "header") == header
    at = sealed.index(msgspec.msgpack.encode(150))  # the frontier's byte
    for damaged in (sealed[:at] + bytes([sealed[at] ^ 0x10]) + sealed[at + 1:],
                    msgspec.msgpack.encode(header), b"\x01"):
        inbox.append(damaged)
        with pytest.raises(TransferCorrupt, match="fails its CRC-32C"):
            transfer.recv_control(0, None, "header")
    inbox.append(seal(msgspec.msgpack.encode([1, 2])))
    with pytest.raises(TransferRefused, match="not a map"):
        transfer.recv_control(0, None, "header")
    inbox.append(seal(b"\xc1"))  # sealed, yet not msgpack
    with pytest.raises(TransferRefused, match="does not decode"):
        transfer.recv_control(0, None, "header")
    # nested past msgspec's depth: a RecursionError, which import_ took for the wire's
    # RuntimeError and left unanswered (review of the header fixes)
    inbox.append(seal(b"\x81\xa1k" + b"\x91" * 1000 + b"\xc0"))
    with pytest.raises(TransferRefused, match="does not decode"):
        transfer.recv_control(0, None, "header")


def test_a_damaged_header_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that fails its CRC or does not decode was refused without an answer, so the
    sender (waiting in ``_recv_status`` for one) hung until the group's timeout. The receiver
    answers now, and the sender raises the same kind of error."""
    import msgspec

    from ninfer_kv.dist import receive, transfer
    from ninfer_kv.dist.errors import TransferCorrupt, TransferRefused
    from ninfer_kv.dist.stream import seal

    store = KVStore.open(StoreConfig(model=ModelGeometry(layers=2, kv_heads=2, head_dim=64),
                                     serving=ServingConfig(max_context=256, max_concurrency=2),
                                     kv_tokens=8 * 64))
    inbox: list[bytes] = []
    outbox: list[bytes] = []
    monkeypatch.setattr(transfer, "recv_bytes", lambda peer, group: inbox.pop(0))
    monkeypatch.setattr(transfer, "send_bytes", lambda data, peer, group: outbox.append(data))
    digest = store.digest()
    for damaged, kind in ((b"\x01", TransferCorrupt), (seal(msgspec.msgpack.encode([1])),
                                                        TransferRefused)):
        inbox.append(damaged)
        with pytest.raises(kind):
            receive.import_(store, 0)
        answer = outbox.pop()
        inbox.append(answer)  # what the sender reads next
        with pytest.raises(kind, match="refused the header"):
            transfer._recv_status(1, None, "header")
    assert store.digest() == digest and not outbox
    store.close()


def test_every_header_gets_one_answer_a_refusal_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding on the fix above: a sender that refused (an unknown checkpoint) sent its
    refusal and returned, so a damaged refusal — which the receiver cannot tell from a damaged
    header — was answered into the void: on gloo that send blocked until the group's timeout
    and broke the next transfer. Now a refusal is answered too, and the refusing sender reads
    the answer: every header gets exactly one, on both paths."""
    import msgspec

    from ninfer_kv.dist import receive, transfer
    from ninfer_kv.dist.errors import TransferRefused
    from ninfer_kv.dist.stream import seal

    store = KVStore.open(StoreConfig(model=ModelGeometry(layers=2, kv_heads=2, head_dim=64),
                                     serving=ServingConfig(max_context=256, max_concurrency=2),
                                     kv_tokens=8 * 64))
    wire: list[bytes] = []
    monkeypatch.setattr(transfer, "recv_bytes", lambda peer, group: wire.pop(0))
    monkeypatch.setattr(transfer, "send_bytes", lambda data, peer, group: wire.append(data))
    # the receiver answers a readable refusal
    wire.append(seal(msgspec.msgpack.encode({"magic": transfer.MAGIC,
                                             "version": transfer.VERSION, "refused": "no"})))
    with pytest.raises(TransferRefused, match="refused the export"):
        receive.import_(store, 0)
    assert len(wire) == 1  # its answer
    # the refusing sender reads the answer (here the one just sent) and raises its refusal
    with pytest.raises(TransferRefused, match="999"):
        transfer.export(store, 999, 1)
    assert len(wire) == 1 and msgspec.msgpack.decode(transfer.unseal(wire[0]))["refused"]
    store.close()


def test_a_host_replica_is_checked_against_its_crc_before_it_is_sent(tmp_path) -> None:  # noqa: ANN001
    """Review finding: a host-only page was sent with a CRC of whatever the arena held, so a
    rotted replica reached the receiver as valid under a fresh CRC."""
    from ninfer_kv.dist.errors import TransferCorrupt
    from tests.engine.conftest import small_config
    from tests.engine.test_continuation import checkpoint_at, step

    s = KVStore.open(small_config(tmp_path, pages=40, host_bytes=8 << 20))
    ck = checkpoint_at(s, 100)
    s.offload(ck, drop_device=True)
    step(s)
    pages = [s.state.pools["main"].pages[x] for x in s.space(ck, "main").members]
    assert all(pg.device < 0 and pg.host is not None for pg in pages)
    assert len(gather(s, "main", pages, 0, CPU)) > 0  # intact: packed and sent
    pb = next(sp.page_bytes for sp in s.state.pool_specs if sp.name == "main")
    s.arena.pages(pages[1].host[0], 1, pb)[0][5] ^= 0xFF  # one byte rots in the arena
    with pytest.raises(TransferCorrupt, match="published"):
        gather(s, "main", pages, 0, CPU)
    s.close()
