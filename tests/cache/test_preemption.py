"""Preemption (ninfer_kv/cache/preemption.py): a sequence swapped out to the host tier frees its
device pages and, resumed after other requests reused them, reads the same KV bytes and keeps
decoding; without a host tier it resumes by Move (no copy); every refusal changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_kv.cache.preemption import Swapped, swap_in, swap_out
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import CapacityExhausted, InactiveSpace, InvalidArgument, UnknownHandle
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import page_bytes, running, step, write_tokens


def committed_bytes(s: KVStore, seq: int) -> dict[str, list[torch.Tensor]]:
    """Every pool's committed columns of ``seq``, page by page, plane by plane."""
    out: dict[str, list[torch.Tensor]] = {}
    for pool in s.pools:
        sp, p = s.space(seq, pool), s.state.pools[pool]
        for i, slot in enumerate(sp.members):
            cols = min(P, sp.committed - i * P)
            dev = p.pages[slot].device
            assert dev >= 0, f"{pool} block {i} is not on the device"
            # page_bytes gives [H, P, X] in either plane order: columns are axis 1 (the
            # page-major case sliced head_dim here, which P = head_dim = 64 hid)
            out.setdefault(pool, []).extend(t[:, :cols] for t in page_bytes(s, pool, dev))
    return out


def test_swapped_out_sequence_resumes_with_the_same_bytes(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=40, backend=Backend.MTP, host_bytes=8 << 20))
    a = running(s, 1000, 200)
    before = committed_bytes(s, a)
    free0 = s.occupancy()["main"]["available"]
    sw = swap_out(s, a, 1200)
    assert sw.offloaded and sw.frontier == {p: 1000 for p in s.pools}
    step(s)   # D2H copies publish, then the device page groups go
    info = s.checkpoint_info(sw.checkpoint)
    assert info.finish_reason == "preempted"
    assert all(r.device_pages == 0 and r.host_pages == r.pages for r in info.pools.values())
    assert s.occupancy()["main"]["available"] >= free0 + 16
    b = running(s, 1800, 10)  # another request takes (and overwrites) the freed page groups
    s.finish(b)
    step(s)
    seq = swap_in(s, sw)
    step(s)   # host pages restored
    assert sw.checkpoint not in s.checkpoints()
    after = committed_bytes(s, seq)
    assert {p: len(v) for p, v in after.items()} == {p: len(v) for p, v in before.items()}
    for pool in before:
        for x, y in zip(before[pool], after[pool], strict=True):
            assert torch.equal(x, y), pool
    for pool in s.pools:  # and it keeps decoding above its old frontier
        s.ensure_mapped(seq, pool, 1001)
    step(s)
    for pool in s.pools:
        write_tokens(s, seq, pool, 1000, 1001)
        s.commit(seq, pool, 1001)
    step(s)
    digest = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal")).digest == digest


def test_without_a_host_tier_swap_in_is_a_move(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=40))
    a = running(s, 700, 100)
    members = s.space(a).members
    sw = swap_out(s, a, 800)
    assert not sw.offloaded
    # the checkpoint keeps the sequence's id (swap_out's docstring: an engine interrupted
    # before swap_out returns still knows it)
    assert sw.checkpoint == a and sw.frontier == {"main": s.space(a).committed}
    step(s)
    copies = s.stats["cow_copies"]
    seq = swap_in(s, sw)
    step(s)
    assert s.space(seq).members == members and s.stats["cow_copies"] == copies
    assert s.space(seq).committed == 700 and s.checkpoints() == []


def test_a_full_host_arena_leaves_the_checkpoint_on_the_device(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=40, host_bytes=64 << 10))  # < one page group
    a = running(s, 300, 10)
    sw = swap_out(s, a, 310)
    step(s)
    assert not sw.offloaded
    assert s.checkpoint_info(sw.checkpoint).pools["main"].device_pages == 5


def test_refusals_change_nothing(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=32, host_bytes=8 << 20))
    a = running(s, 600, 100)
    digest = s.digest()
    for bad, err in (((a, 600), InvalidArgument), ((a, 10), InvalidArgument),
                     ((999, 700), UnknownHandle), ((a, "700"), InvalidArgument),
                     ((True, 700), InvalidArgument), ((a, s.plan.S + 1), InvalidArgument)):
        with pytest.raises(err):
            swap_out(s, *bad)
        assert s.digest() == digest
    sw = swap_out(s, a, 700)
    step(s)
    digest = s.digest()
    for bad in ("x", sw.checkpoint, None):  # review finding: AttributeError escaped
        with pytest.raises(InvalidArgument, match="not the Swapped"):
            swap_in(s, bad)  # type: ignore[arg-type]
    # review finding: TypeError / ValueError escaped a Swapped with the wrong fields
    for bad_sw in (Swapped(sw.checkpoint, {"main": "600"}, 700, True),
                   Swapped(sw.checkpoint, {"main": 600}, None, True),  # type: ignore[arg-type]
                   Swapped(sw.checkpoint, {"main": 600}, 599, True),
                   Swapped(sw.checkpoint, {}, 700, True),
                   Swapped(str(sw.checkpoint), {"main": 600}, 700, True)):  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            swap_in(s, bad_sw)
    assert s.digest() == digest
    with pytest.raises((InactiveSpace, UnknownHandle)):
        swap_out(s, a, 700)                      # no longer active
    hog = s.activate(22 * P, 1)                  # the device cannot hold it back now
    step(s)
    digest = s.digest()
    with pytest.raises(CapacityExhausted):
        swap_in(s, sw)
    assert s.digest() == digest
    s.finish(hog)
    step(s)
    seq = swap_in(s, sw)
    with pytest.raises(UnknownHandle):           # resumed once: the checkpoint is gone
        swap_in(s, sw)
    assert s.space(seq).committed == 600
    s.check_invariants()


def test_a_resumed_sequence_can_free_its_host_extents(tmp_path: Path) -> None:
    """Review repro: after swap_in (a Move) the resumed *active* sequence kept its pages'
    host extents and no call could free them (drop_host took checkpoints only), so with an
    arena sized for one preempted request the next swap_out could not offload. Now
    ``drop_host(seq)`` frees them after the restoring boundary; pages a checkpoint also holds
    keep theirs."""
    probe = KVStore.open(small_config(tmp_path / "p", pages=40, host_bytes=1))
    pb = probe.state.pool_specs[0].page_bytes
    probe.close()
    s = KVStore.open(small_config(tmp_path, pages=40, host_bytes=10 * pb))  # 10 pages
    a, b = running(s, 640, 100), running(s, 640, 100)
    sw = swap_out(s, a, 740)
    step(s)
    assert sw.offloaded and s.metrics().host_used == 10 * pb
    a2 = swap_in(s, sw)
    assert s.drop_host(a2) == 0                  # pinned until the restore has run
    step(s)
    assert s.drop_host(a2) == 10
    step(s)
    assert s.metrics().host_used == 0
    swb = swap_out(s, b, 740)
    step(s)
    assert swb.offloaded
    b2 = swap_in(s, swb)
    step(s)
    assert s.drop_host(b2) == 10
    ck = s.share_prefix(a2, 320)                 # a checkpoint co-holds a2's first 5 pages
    step(s)
    s.offload(ck)
    step(s)
    assert s.checkpoint_info(ck).pools["main"].host_pages == 5
    assert s.drop_host(a2) == 0                  # the checkpoint's replicas stay
    step(s)
    assert s.checkpoint_info(ck).pools["main"].host_pages == 5
    s.check_invariants()


def test_a_sequence_swapped_out_again_before_the_boundary_frees_its_device_pages(
        tmp_path: Path) -> None:
    """Review finding: swap_in restores host-only pages and pins them until the boundary; a
    swap_out in the same interval found the replicas valid (nothing to copy) and the pages
    pinned (nothing to drop), so the device pages stayed for good while Swapped.offloaded
    said True. They now drop when the boundary unpins them, by the same rule."""
    s = KVStore.open(small_config(tmp_path, pages=8, context=512, host_bytes=8 << 20,
                                  persist_dir=str(tmp_path / "persist")))
    sw = swap_out(s, running(s, 300, 100), 400)
    step(s)
    again = swap_out(s, swap_in(s, sw), 400)  # resumed and preempted in one step
    assert again.offloaded
    step(s)
    info = s.checkpoint_info(again.checkpoint).pools["main"]
    assert (info.device_pages, info.host_pages) == (0, 5)  # old code: 5 device pages kept
    assert s.occupancy()["main"]["available"] == 8
    s.activate(400, 64)  # the room swap_out promised
    step(s)
    s.close()
    assert replay(str(tmp_path / "journal"), verify_every=1).digest == s.digest()


def test_make_host_room_frees_extents_that_stale_replicas_hold(tmp_path: Path) -> None:
    """Review finding: make_host_room skipped a checkpoint with no *valid* host replica, yet
    a stale one (its tail rewritten after swap_in) still holds its arena extent, so with the
    arena full of them it answered "nothing to free" and the offload kept failing."""
    from ninfer_kv.cache.retention import LruRetention
    from ninfer_kv.errors import HostArenaError

    s = KVStore.open(small_config(tmp_path, pages=40, host_bytes=1 << 16))  # one page
    pol = LruRetention()
    sw = swap_out(s, running(s, 40, 60), 100)
    step(s)
    c = swap_in(s, sw)
    step(s)
    s.truncate(c, "main", 20)  # the tail's epoch moves on: its host replica is stale
    write_tokens(s, c, "main", 20, 40)
    s.commit(c, "main", 40)
    stale = s.finish(c, retain=True)
    step(s)
    pol.retain(stale, (1,))
    assert s.checkpoint_info(stale).pools["main"].host_pages == 0
    assert s.state.host.live_bytes == 1 << 16  # the stale replica's extent
    fresh = s.finish(running(s, 40, 60), retain=True)
    pol.retain(fresh, (2,))
    with pytest.raises(HostArenaError):
        s.offload(fresh)
    assert pol.make_host_room(s, keep=fresh) == "drop_host"  # old code: None
    step(s)
    assert s.offload(fresh) == 1
    step(s)
    assert s.checkpoint_info(fresh).pools["main"].host_pages == 1
    s.check_invariants()
    s.close()
