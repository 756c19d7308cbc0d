"""Host tier: offload (D2H) with verified publish, device drop, restore (H2D) on activation,
persistence across a reopen, corruption detection (spec §5.3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.host import page_checksum
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import HostArenaError
from ninfer_kv.journal.events import DeviceDrop, HostPublish, HostReserve, unpack
from ninfer_kv.journal.reader import JournalReader
from tests.engine.conftest import crash, small_config
from tests.engine.test_continuation import checkpoint_at, page_bytes, step


def host_store(tmp: Path, **kw) -> KVStore:
    return KVStore.open(small_config(None, pages=kw.pop("pages", 80),
                                     host_bytes=kw.pop("host_bytes", 8 << 20),
                                     persist_dir=str(tmp / "persist"), **kw))


def test_offload_publish_drop_restore_roundtrip(tmp_path: Path) -> None:
    s = host_store(tmp_path, backend=Backend.MTP)
    ck = checkpoint_at(s, 1000)
    main = s.state.pools["main"]
    before = [page_bytes(s, "main", main.pages[x].device) for x in s.space(ck).members]
    n = s.offload(ck)
    assert n == 16 + 16  # every page of both pools
    kinds = [type(e) for e in s._pending]
    assert kinds.count(HostReserve) == 2
    assert all(main.pages[x].pins == 1 for x in s.space(ck).members)  # pinned during copy
    step(s)
    assert s.stats["published"] == 2 and s.stats["d2h_runs"] >= 2
    assert all(main.pages[x].pins == 0 and main.pages[x].host is not None
               for x in s.space(ck).members)
    free_before = s.occupancy()["main"]["available"]
    assert s.drop_device(ck) == 32
    step(s)
    assert s.occupancy()["main"]["available"] == free_before + 16
    assert all(main.pages[x].device == -1 for x in s.space(ck).members)
    dst = s.activate_from(ck, 1000, 1000, 100)  # restores host-only pages, then COW
    step(s)
    restored = [page_bytes(s, "main", main.pages[x].device) for x in s.space(ck).members]
    for i, (a, b) in enumerate(zip(before, restored, strict=True)):
        cols = 64 if i < 15 else 40  # the committed columns of each page
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x[:, :cols], y[:, :cols])
    tail = page_bytes(s, "main", main.pages[s.space(dst).members[15]].device)
    for x, y in zip(tail, before[15], strict=True):
        assert torch.equal(x[:, :40], y[:, :40])
    s.close()


def test_persisted_checkpoint_survives_reopen(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 700)
    main = s.state.pools["main"]
    want = [page_bytes(s, "main", main.pages[x].device) for x in s.space(ck).members]
    lost = checkpoint_at(s, 200)  # never offloaded: device-only
    s.offload(ck)
    step(s)
    crash(s)  # what a crash leaves: no close()
    s2 = KVStore.open(s.config)
    assert s2.recovery.kept == [ck]
    assert "device-only" in s2.recovery.dropped[lost]
    s2.check_invariants()
    dst = s2.activate_from(ck, 700, 700, 50)
    step(s2)
    got = [page_bytes(s2, "main", s2.state.pools["main"].pages[x].device)
           for x in s2.space(dst).members]
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        cols = 64 if i < 10 else 700 - 640
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x[:, :cols], y[:, :cols])
    s2.close()
    events = [type(e) for _, _, e in JournalReader(str(tmp_path / "persist" / "journal")).events()]
    assert HostPublish in events and DeviceDrop in events


def test_corrupt_host_page_drops_checkpoint(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    good = checkpoint_at(s, 100)
    s.offload(ck)
    s.offload(good)
    step(s)
    off = s.state.pools["main"].pages[s.space(ck).members[2]].host[0]
    crash(s)
    with open(tmp_path / "persist" / "host_arena.bin", "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    s2 = KVStore.open(s.config)
    assert good in s2.recovery.kept and ck not in s2.recovery.kept
    assert "checksum" in s2.recovery.dropped[ck]
    assert ck not in s2.state.bundles  # never served
    s2.check_invariants()
    s2.close()


def test_unpublished_destination_is_aborted(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    s.offload(ck)
    s._append_pending()  # crash before the copy/publish: the reserve is journaled only
    crash(s)
    s2 = KVStore.open(s.config)
    assert not s2.state.host_pending and ck in s2.recovery.dropped
    assert s2.state.host.live_bytes == 0  # no extent leaked
    s2.check_invariants()
    s2.close()


def test_arena_too_small_is_refused_without_change(tmp_path: Path) -> None:
    s = host_store(tmp_path, host_bytes=64 * 1024)
    ck = checkpoint_at(s, 1000)
    d = s.digest()
    with pytest.raises(HostArenaError, match="cannot place"):
        s.offload(ck)
    assert s.digest() == d
    s.close()


def test_drop_host_frees_extents_and_reoffload(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    s.offload(ck)
    step(s)
    live = s.state.host.live_bytes
    assert live > 0 and s.drop_host(ck) == 5
    step(s)
    assert s.state.host.live_bytes == 0
    assert all(s.state.pools["main"].pages[x].device >= 0 for x in s.space(ck).members)
    assert s.offload(ck) == 5  # device replicas are still there: offload again
    step(s)
    assert s.state.host.live_bytes == live
    s.close()


def test_drop_host_keeps_the_replicas_another_checkpoint_survives_on(tmp_path: Path) -> None:
    """Regression (review): K, a shared prefix offloaded and reported durable, and V, the
    owner's retained checkpoint holding the same pages plus a tail. ``drop_host(V)`` dropped
    the shared pages' replicas too, so K no longer survived a reopen though nothing named
    it. Now only V's own pages lose their replica, and a reopen keeps K."""
    s = host_store(tmp_path)
    owner = s.activate(700, 10)
    s.ensure_mapped(owner, "main", 700)
    step(s)
    s.commit(owner, "main", 700)
    k = s.share_prefix(owner, 640)
    v = s.finish(owner, retain=True)
    assert v is not None
    s.offload(k)
    s.offload(v)
    step(s)
    assert s.checkpoint_info(k).survives_restart and s.checkpoint_info(v).survives_restart
    assert s.drop_host(v) == 1              # the tail page, V's alone
    step(s)
    assert s.checkpoint_info(k).survives_restart
    assert not s.checkpoint_info(v).survives_restart
    crash(s)
    again = host_store(tmp_path)
    assert again.checkpoints() == [k] and again.violations() == []
    again.close()


def test_copy_source_is_pinned_until_the_boundary_ran_the_copy(tmp_path: Path) -> None:
    """Fork+release drops the source tail's last reference before the boundary; the queued
    COW copy pins it, so a later restore in the same record cannot reuse its page group, and
    the Unpin after the copy frees it (§5.3: the only valid source is not released)."""
    s = host_store(tmp_path)
    a = checkpoint_at(s, 100)   # 2 pages: tail has 36 committed columns
    c = s.activate_from(a, 64, 64, 10)  # shares a's first page, so a is not private
    s.finish(c, retain=True)
    b = checkpoint_at(s, 130)
    main = s.state.pools["main"]
    tail_slot = s.space(a).members[1]
    tail_dev = main.pages[tail_slot].device
    tail_before = page_bytes(s, "main", tail_dev)
    s.offload(b)
    step(s)
    s.drop_device(b)
    step(s)
    x = s.activate_from(a, 100, 100, 10, keep_source=False)  # Fork (COW tail) + Release(a)
    assert main.pages[tail_slot].refs == 0 and main.pages[tail_slot].pins == 1
    y = s.activate_from(b, 128, 128, 10)
    restored = [e for e in s._effects if type(e).__name__ == "DeviceRestore"]
    assert tail_dev not in unpack(restored[0].pages).tolist()  # the pinned group is not reused
    step(s)
    assert main.pages[tail_slot] is None  # unpinned after the copy: freed
    got = page_bytes(s, "main", main.pages[s.space(x).members[1]].device)
    for g, w in zip(got, tail_before, strict=True):
        assert torch.equal(g[:, :36], w[:, :36])
    del y
    s.close()


def test_offload_with_drop_after_a_plain_offload_drops_when_the_copy_publishes(
        tmp_path: Path) -> None:
    """Review repro: ``offload(ck)`` then ``offload(ck, drop_device=True)`` before the
    boundary queued nothing new, and so scheduled no drop: the device pages stayed (as
    ``drop_device(ck)`` would have scheduled them)."""
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 150)
    main = s.state.pools["main"]
    assert s.offload(ck) == 3
    assert s.offload(ck, drop_device=True) == 0      # already queued: not copied twice
    step(s)
    assert all(main.pages[x].device == -1 and main.pages[x].host is not None
               for x in s.space(ck).members)
    s.check_invariants()
    s.close()


@pytest.mark.parametrize("fill", [0x00, 0xAB])
def test_a_store_without_planes_offloads_zeros_not_what_the_arena_held(fill: int) -> None:
    """A control-plane-only store (``allocate_planes=False``) has no KV bytes: its host
    replicas are zeros. The copy used to leave the arena's bytes as they were and checksum
    them, so the same commands journaled different CRCs (and reached different digests)
    depending on what memory the arena got (found by the pinned-digest test)."""
    s = KVStore.open(small_config(None, pages=80, host_bytes=8 << 20, allocate_planes=False))
    s.arena.data.fill_(fill)  # type: ignore[union-attr]  # stale bytes from an earlier life
    ck = checkpoint_at(s, 1000)
    s.offload(ck)
    step(s)
    main = s.state.pools["main"]
    pb = next(spec.page_bytes for spec in s.state.pool_specs if spec.name == "main")
    zeros = page_checksum(np.zeros(pb, np.uint8))
    for slot in s.space(ck).members:
        off, _, _, crc = main.host_of[slot]
        assert crc == zeros
        assert s.arena.data[off:off + pb].count_nonzero() == 0  # type: ignore[union-attr]
    s.close()


@pytest.mark.parametrize("tier", ["none", "memory", "file"])
def test_checkpoint_info_predicts_what_a_reopen_keeps(tmp_path: Path, tier: str) -> None:
    """Review finding: a checkpoint without pages, in a store without a host tier, was
    reported as surviving a restart (``checkpoint_info``) and then dropped by the reopen ("no
    host arena"); with an in-memory arena it survived. The prediction and the reopen follow
    one rule for every kind of checkpoint and every host tier."""
    kw: dict = {"none": {}, "memory": {"host_bytes": 8 << 20},
                "file": {"host_bytes": 8 << 20, "persist_dir": str(tmp_path / "persist")}}[tier]
    cfg = small_config(None if tier == "file" else tmp_path, pages=80, **kw)
    s = KVStore.open(cfg)
    empty = s.finish(s.activate(10, 10), retain=True)  # nothing committed: no pages
    device = checkpoint_at(s, 100)
    cks = [empty, device]
    if tier != "none":
        cks.append(checkpoint_at(s, 200))
        s.offload(cks[-1])
    step(s)
    said = {ck: s.checkpoint_info(ck).survives_restart for ck in cks}
    s.close()
    s2 = KVStore.open(cfg)
    kept = set(s2.checkpoints())
    s2.close()
    assert said == {ck: ck in kept for ck in cks}, (said, kept)
    assert said[empty] and not said[device]  # metadata-only survives; device-only does not
    assert tier != "file" or said[cks[-1]]
