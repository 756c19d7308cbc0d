"""``apply`` refuses a damaged event whole: review findings on the compiled apply path. A
damaged journal (replay, recovery, a TP follower) must get a typed refusal — never a crash
(numba indexes without bounds checks: a negative Trim.keep ended in SIGSEGV), never an event
that silently breaks a rule the checkers do not see (a commit moving a frontier backwards),
and never a refusal after a partial change (the free lists, counters and arrays the digest
does not cover are compared too)."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.page_life import collect
from ninfer_kv.engine.state import MAX_BUNDLE, StoreState, digest
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import APPLY_ERRORS, JournalCorrupt, UnappliableRecord
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack, pack_i64
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, running, step


def fingerprint(st: StoreState) -> str:
    """The digest and what it does not cover: free lists, counters, the page/space arrays."""
    h = hashlib.blake2b(digest_size=16)
    h.update(digest(st).encode())
    for name in sorted(st.pools):
        p = st.pools[name]
        for f in (p.free_pages, p.free_slots, p.free_rows):
            h.update(repr((f.n, f.bits.tobytes())).encode())
        h.update(repr((p.n_slots, p.reserved, sorted(p.host_of.items()), p.row_owner)).encode())
        for a in ("pg_gen", "pg_epoch", "pg_committed", "pg_protected", "pg_refs", "pg_active",
                  "pg_writer", "pg_device", "pg_pins", "pg_live", "sp_members", "sp_nmem",
                  "sp_committed", "sp_protected", "sp_entitlement", "sp_active",
                  "sp_bundle", "sp_budget", "bundle_index"):
            h.update(getattr(p, a).tobytes())
    if st.host is not None:
        h.update(repr((st.host.live_total, dict(st.host.live), dict(st.host.by_off),
                       st.host_pending, st.copy_pins)).encode())
    return h.hexdigest()


@pytest.fixture
def world(tmp_path: Path) -> Any:
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    ck = checkpoint_at(s, 150)                 # inactive, 3 pages
    gone = checkpoint_at(s, 64)
    a = running(s, 200)                        # active, 4 pages, committed 200
    running(s, 10)                             # a second active sequence
    s.release(gone)
    step(s)
    yield s, ck, a
    s.close()


def cases(s: KVStore, ck: int, a: int) -> dict[str, list[Any]]:
    st, p = s.state, s.state.pools["main"]
    nxt = st.next_bundle
    free_slot = next(iter(p.free_slots))
    free_page = next(iter(p.free_pages))
    free_pages = list(p.free_pages)
    used_page = int(p.pg_device[p.spaces[a].members[0]])
    a_slots, ck_slots = list(p.spaces[a].members), list(p.spaces[ck].members)
    host_off = next(iter(st.host.by_off))     # the arena's free extent
    row_a = p.spaces[a].row
    row = p.free_rows.first()
    s0, s1 = ck_slots[0], ck_slots[1]
    off2 = host_off + (1 << 16)
    on_host = [ev.HostReserve("main", pack([s0, s1]), pack_i64([host_off, off2])),
               ev.HostPublish("main", host_off, pack([s0, s1]), pack([0, 0]), pack([P, P]),
                              ev.pack_u32([1, 2]))]          # s0, s1 get host replicas
    host_only = [*on_host, ev.DeviceDrop("main", pack([s0, s1]))]
    pin_a0 = ev.Pin("main", pack([a_slots[0]]))  # what a COW copy's record pins first
    return {
        "Configure twice": [ev.Configure(list(st.pool_specs), dict(st.plan))],
        "HostReserve with fewer offsets than slots": [
            ev.HostReserve("main", pack([s0, s1]), pack_i64([host_off]))],
        "HostDrop of a slot listed twice": [*on_host, ev.HostDrop("main", pack([s0, s0]))],
        "HostDrop of a Host-only page": [*host_only, ev.HostDrop("main", pack([s0]))],
        "HostPublish naming other slots than its HostReserve": [
            on_host[0], ev.HostPublish("main", host_off, pack([s1, s0]), pack([0, 0]),
                                       pack([P, P]), ev.pack_u32([1, 2]))],
        "HostPublish naming another pool": [
            on_host[0], ev.HostPublish("x", host_off, pack([s0, s1]), pack([0, 0]),
                                       pack([P, P]), ev.pack_u32([1, 2]))],
        "HostPublish where nothing is pending": [
            on_host[0], ev.HostPublish("main", off2, pack([s0, s1]), pack([0, 0]),
                                       pack([P, P]), ev.pack_u32([1, 2]))],
        "HostAbort naming another pool": [on_host[0], ev.HostAbort("x", host_off)],
        "DeviceDrop of a slot listed twice": [*on_host, ev.DeviceDrop("main", pack([s0, s0]))],
        "DeviceRestore with fewer page groups than slots": [
            *host_only, ev.DeviceRestore("main", pack([s0, s1]), pack([free_page]))],
        "DeviceRestore of a slot listed twice": [
            *host_only, ev.DeviceRestore("main", pack([s0, s0]), pack(free_pages[:2]))],
        "DeviceRestore onto one page group twice": [
            *host_only, ev.DeviceRestore("main", pack([s0, s1]), pack([free_page] * 2))],
        "Trim below zero pages": [ev.Trim(a, "main", -1)],
        "Trim to the most negative int32": [ev.Trim(a, "main", -(1 << 31))],
        "Trim below the committed frontier": [ev.Trim(a, "main", 3)],
        "commit backwards": [ev.CommitFrontiers("main", pack([a]), pack([130]))],
        "commit backwards, second element": [
            ev.CommitFrontiers("main", pack([a, a]), pack([210, 205]))],
        "commit into an inactive checkpoint": [
            ev.CommitFrontiers("main", pack([a, ck]), pack([201, 192]))],
        "Activate on a leased row": [ev.Activate(nxt, "main", 2, row_a)],
        "Activate with a huge id": [ev.Activate((1 << 31) - 1, "main", 2, row)],
        "Activate with a negative id": [ev.Activate(-3, "main", 2, row)],
        "Activate of a seq that has a space": [ev.Activate(a, "main", 2, row)],
        "Activate holding more than its entitlement": [ev.Activate(nxt, "main", 2, row, 0, 0, 3)],
        "Activate with a budget past int64": [ev.Activate(nxt, "main", 2, row, 1 << 63)],
        "Share with a huge id": [ev.Share(a, 1 << 30, "main", 1)],
        "CopyTail onto a leased page group": [pin_a0, ev.CopyTail(a, "main", free_slot,
                                                                  used_page, a_slots[0],
                                                                  used_page, 10)],
        "CopyTail from an unpinned source": [ev.CopyTail(a, "main", free_slot, free_page,
                                                         a_slots[0], used_page, 10)],
        "CopyTail naming another source page group": [
            pin_a0, ev.CopyTail(a, "main", free_slot, free_page, a_slots[0], free_page, 10)],
        "Grow naming an unknown seq second": [ev.Grow("main", pack([a, 77]), pack([1, 1]))],
        "Grow by negative pages": [ev.Grow("main", pack([a]), pack([-2]))],
        "Grow naming a seq twice": [ev.Grow("main", pack([a, a]), pack([1, 1]))],
        "Grow with fewer page counts than seqs": [
            ev.Grow("main", pack(sorted(s.active())), pack([1]))],
        "Provisional of an unknown seq second": [
            ev.ProvisionalFrontiers("main", pack([a, 77]), pack([210, 1]))],
        "Provisional with fewer frontiers than seqs": [
            ev.ProvisionalFrontiers("main", pack(sorted(s.active())), pack([1]))],
        "Provisional below zero second": [
            ev.ProvisionalFrontiers("main", pack([a, a]), pack([1, -1]))],
        "Truncate above the committed frontier": [ev.Truncate(a, "main", 230)],
        "Release of an active seq": [ev.Release(a, "main")],
        "Move with a negative frontier": [ev.Move(ck, a, "main", -P)],
        "Pin of a live slot, then a dead one": [ev.Pin("main", pack([a_slots[0], 99]))],
        "Unpin of a slot pinned once, listed twice": [
            ev.Pin("main", pack([a_slots[0]])),
            ev.Unpin("main", pack([a_slots[0], a_slots[0]]))],
        "HostReserve: a live slot, then a free one": [ev.HostReserve(
            "main", pack([a_slots[0], free_slot]), pack_i64([host_off, host_off + (1 << 16)]))],
        "HostReserve: a second offset not free": [ev.HostReserve(
            "main", pack([ck_slots[0], ck_slots[1]]), pack_i64([host_off, 1 << 40]))],
        "DeviceRestore of a page on the device": [
            ev.DeviceRestore("main", pack([ck_slots[0]]), pack([free_page]))],
        "DeviceDrop without a host replica": [ev.DeviceDrop("main", pack([ck_slots[0]]))],
        "HostDrop without a host replica": [ev.HostDrop("main", pack([ck_slots[0]]))],
        "HostPublish with a field too short": [
            ev.HostReserve("main", pack([ck_slots[0], ck_slots[1]]),
                           pack_i64([host_off, host_off + (1 << 16)])),
            ev.HostPublish("main", host_off, pack([ck_slots[0], ck_slots[1]]), pack([0, 0]),
                           pack([P]), ev.pack_u32([1, 2]))],
        "CopyTail with a page group past int64": [
            pin_a0, ev.CopyTail(a, "main", free_slot, 1 << 63, a_slots[0], used_page, 10)],
        "Fork into a destination with pages": [ev.Fork(ck, a, "main", 1, P)],
        "Materialize with arrays of different lengths": [
            ev.Materialize("main", pack([a, a]), pack([free_slot]), pack([free_page]))],
        "Materialize for an unknown seq": [
            ev.Materialize("main", pack([77]), pack([free_slot]), pack([free_page]))],
        "CommitFrontiers with arrays of different lengths": [
            ev.CommitFrontiers("main", pack([a, a]), pack([201]))],
        "Materialize into a checkpoint": [
            ev.Materialize("main", pack([ck]), pack([free_slot]), pack([free_page]))],
        "PublishActive of a checkpoint": [ev.PublishActive(ck)],
        "Grow past L": [ev.Grow("main", pack([a]), pack([10_000]))],
        "CopyTail into a checkpoint": [
            ev.CopyTail(ck, "main", free_slot, free_page, a_slots[0], used_page, 10)],
        "Provisional past the membership": [
            ev.ProvisionalFrontiers("main", pack([a]), pack([4 * P + 1]))],
        "Materialize without a page group": [
            ev.Materialize("main", pack([a]), pack([free_slot]), pack([-1]))],
        "Fork from an active sequence": [
            ev.Activate(nxt, "main", 2, row, 0, 0, 1), ev.Fork(a, nxt, "main", 1, P)],
        "Move of an empty checkpoint onto itself": [
            ev.Activate(nxt, "main", 0, row, 10, 0, 0), ev.PublishActive(nxt),
            ev.Finish(nxt, "main", True, "done"), ev.Move(nxt, nxt, "main", 0)],
        # review repro: stored as is, then checkpoint_info raised msgspec.DecodeError
        "SetMetadata that is not msgpack": [ev.SetMetadata(ck, b"\xc1")],
        "SetMetadata with bytes after the value": [ev.SetMetadata(ck, b"\x01\x02")],
        "SetMetadata over the limit": [ev.SetMetadata(ck, b"\xc0" * (ev.METADATA_MAX + 1))],
        "Recovered with torn fields": [ev.Recovered(1, b"\x01", b"\x01\x02")],
        "Recovered moving the next id back": [ev.Recovered(1, b"", b"", nxt - 1)],
        "Recovered past the last id": [ev.Recovered(1, b"", b"", MAX_BUNDLE + 2)],
    }

# each case's refusal, worded: a refusal that falls through to another rule's message (its
# own check deleted, a later one catching the event) fails here, not only the type
WORDING = {
    'Configure twice': 'configured twice',
    'HostReserve with fewer offsets than slots': '2 slots, 1 offsets',
    'HostDrop of a slot listed twice': 'repeat or hold no host replica',
    'HostDrop of a Host-only page': 'include a Host-only page, which would be lost',
    'HostPublish naming other slots than its HostReserve': 'its HostReserve',
    'HostPublish naming another pool': "names pool 'x', its HostReserve 'main'",
    'HostPublish where nothing is pending': 'no transfer is pending there',
    'HostAbort naming another pool': "names pool 'x', its HostReserve 'main'",
    'DeviceDrop of a slot listed twice': 'repeat, or one is not on both tiers',
    'DeviceRestore with fewer page groups than slots': '2 slots, 1 pages',
    'DeviceRestore of a slot listed twice': 'repeat, or one is on the device',
    'DeviceRestore onto one page group twice': 'page groups [3, 3] repeat or are not free',
    'Trim below zero pages': 'to -1 pages: below its committed frontier',
    'Trim to the most negative int32': 'to -2147483648 pages',
    'Trim below the committed frontier': 'to 3 pages: below its committed frontier',
    'commit backwards': 'commit of seq {a} to 130',
    'commit backwards, second element': 'commit of seq {a} to 205',
    'commit into an inactive checkpoint': 'commit of seq {ck} to 192',
    'Activate on a leased row': 'row {row_a} not free',
    'Activate with a huge id': 'ids are handed out in order',
    'Activate with a negative id': 'seq -3: ids are handed out in order',
    'Activate of a seq that has a space': 'it has a space in main',
    'Activate holding more than its entitlement': 'held 3 / entitlement 2',
    'Activate with a budget past int64': 'budget 9223372036854775808',
    'Share with a huge id': 'into 1073741824: ids are handed out in order',
    'CopyTail onto a leased page group': 'the slot is neither free',
    'CopyTail from an unpinned source': 'is not a live, pinned page',
    'CopyTail naming another source page group': 'is not a live, pinned page',
    'Grow naming an unknown seq second': 'seq 77 (element 1)',
    'Grow by negative pages': 'grows by negative pages',
    'Grow naming a seq twice': '(element 1) has no active space, is listed twice',
    'Grow with fewer page counts than seqs': '8 bytes of seqs, 4 of page counts',
    'Provisional of an unknown seq second': 'seq 77 to 1',
    'Provisional with fewer frontiers than seqs': '8 bytes of seqs, 4 of frontiers',
    'Provisional below zero second': 'seq {a} to -1',
    'Truncate above the committed frontier': 'to 230: outside [protected 0, committed 200]',
    'Release of an active seq': 'it is active',
    'Move with a negative frontier': 'at -64: not an inactive source',
    'Pin of a live slot, then a dead one': 'slots [99] are not live pages',
    'Unpin of a slot pinned once, listed twice': 'unpinned more often than pinned',
    'HostReserve: a live slot, then a free one': 'are not live pages',
    'HostReserve: a second offset not free': 'offset 1099511627776 does not start a free host',
    'DeviceRestore of a page on the device': 'repeat, or one is on the device',
    'DeviceDrop without a host replica': 'not on both tiers',
    'HostDrop without a host replica': 'hold no host replica',
    'HostPublish with a field too short': '2 slots, fields of {{1, 2}}',
    'CopyTail with a page group past int64': "does not fit the journal's int32",
    'Fork into a destination with pages': 'a destination with pages',
    'Materialize with arrays of different lengths': 'bytes of seqs, slots and page groups',
    'Materialize for an unknown seq': 'seq 77, which has no space in main',
    'CommitFrontiers with arrays of different lengths': '8 bytes of seqs, 4 of frontiers',
    'Materialize into a checkpoint': 'into an inactive checkpoint',
    'PublishActive of a checkpoint': 'not a sequence being activated',
    'Grow past L': 'or past L',
    'CopyTail into a checkpoint': 'not an active space',
    'Provisional past the membership': 'to 257: no active space, or a frontier outside',
    'Materialize without a page group': 'a new page without a page group',
    'Fork from an active sequence': 'not an inactive checkpoint',
    'Move of an empty checkpoint onto itself': 'into another, empty destination',
    'SetMetadata that is not msgpack': 'not one msgpack value',
    'SetMetadata with bytes after the value': 'not one msgpack value',
    'SetMetadata over the limit': f'over {ev.METADATA_MAX}',
    'Recovered with torn fields': '1 and 2 bytes of kept and dropped seqs',
    'Recovered moving the next id back': 'before the next one',
    'Recovered past the last id': 'before the next one',
}


def test_every_damaged_event_is_refused_unchanged(world: Any) -> None:
    s, ck, a = world
    all_cases = cases(s, ck, a)
    assert sorted(all_cases) == sorted(WORDING)
    row_a = s.state.pools["main"].spaces[a].row
    for name, events in all_cases.items():
        st = copy.deepcopy(s.state)
        for e in events[:-1]:
            apply(st, e)
        before = fingerprint(st)
        with pytest.raises(APPLY_ERRORS) as got:
            apply(st, events[-1])
        want = WORDING[name].format(a=a, ck=ck, row_a=row_a)
        assert want in str(got.value), (name, str(got.value))
        assert fingerprint(st) == before, f"{name}: refused after a change"


@pytest.mark.parametrize("opener", ["replay", "open"])
def test_a_journal_with_a_negative_trim_is_refused_not_a_crash(
        tmp_path: Path, opener: str) -> None:
    """Review repro: numba wrote out of bounds (SIGSEGV in replay --verify and in open)."""
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(10, 10)
    step(s)
    assert s.journal is not None
    s.journal.append([ev.Trim(a, "main", -(1 << 31))], durable=True)
    s.close()
    call: Callable[[], object] = (
        (lambda: replay(str(tmp_path / "journal"), verify_every=1)) if opener == "replay"
        else (lambda: KVStore.open(s.config)))
    with pytest.raises(UnappliableRecord if opener == "replay" else JournalCorrupt,
                       match="Trim of seq"):
        call()


@pytest.mark.parametrize("opener", ["replay", "open"])
def test_a_journal_with_metadata_that_does_not_decode_is_refused(
        tmp_path: Path, opener: str) -> None:
    """Review repro: accepted by replay and open, then ``checkpoint_info`` and
    ``PrefixIndex.from_store`` raised a raw ``msgspec.DecodeError``."""
    s = KVStore.open(small_config(tmp_path))
    ck = s.finish(s.activate(10, 10), retain=True)
    step(s)
    assert s.journal is not None and ck is not None
    s.journal.append([ev.SetMetadata(ck, b"\xc1")], durable=True)  # 0xc1: never msgpack
    s.close()
    call: Callable[[], object] = (
        (lambda: replay(str(tmp_path / "journal"))) if opener == "replay"
        else (lambda: KVStore.open(s.config)))
    with pytest.raises(UnappliableRecord if opener == "replay" else JournalCorrupt,
                       match="not one msgpack value"):
        call()


def test_open_refuses_a_record_that_raises_attribute_error(tmp_path: Path) -> None:
    """Review repro: recovery caught five of apply's six refusal types; a HostReserve of a
    dead slot reached the caller of open() as a raw AttributeError."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    s.release(checkpoint_at(s, 64))            # slot 0 was a page: dead now
    step(s)
    assert s.journal is not None and s.state.host is not None
    off = next(iter(s.state.host.by_off))
    s.journal.append([ev.HostReserve("main", pack([0]), pack_i64([off]))], durable=True)
    s.close()
    with pytest.raises(JournalCorrupt, match="cannot be applied"):
        KVStore.open(s.config)


@pytest.mark.parametrize("verify", [0, 1])
def test_replay_names_the_failing_event_of_a_record(tmp_path: Path, verify: int) -> None:
    """Plain replay applies a record's events in one tight loop (``apply_record``); a refusal
    must still name the record and the event in it, as the verified loop does."""
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(10, 10)
    step(s)
    assert s.journal is not None
    seq = s.journal.append([ev.Trim(a, "main", 0), ev.Trim(a, "main", -(1 << 31))],
                           durable=True)
    s.close()
    with pytest.raises(UnappliableRecord, match=f"record {seq} event 1 \\(Trim\\)") as got:
        replay(str(tmp_path / "journal"), verify_every=verify)
    assert (got.value.seq, got.value.index) == (seq, 1)


def test_an_unpin_of_a_dead_page_is_refused_unchanged(world: Any) -> None:
    """A copy pin recorded on a slot whose page is gone (a damaged state: a pinned page is
    never freed) is not unpinned into a negative count on a dead slot."""
    s, _, _ = world
    st = copy.deepcopy(s.state)
    p = st.pools["main"]
    dead = next(i for i in range(p.n_slots) if not p.pg_live[i])
    st.copy_pins[("main", dead)] = 1
    before = fingerprint(st)
    with pytest.raises(AssertionError, match=rf"Unpin of main: slots \[{dead}\] hold no page"):
        apply(st, ev.Unpin("main", pack([dead])))
    assert fingerprint(st) == before


def _dead(block: int) -> Callable[[StoreState, int], None]:
    """The page at ``block`` of the seq's membership is dead (it stays listed)."""
    def damage(st: StoreState, seq: int) -> None:
        p = st.pools["main"]
        p.pg_live[p.spaces[seq].member(block)] = False
    return damage


def _repeat_first(st: StoreState, seq: int) -> None:
    """``seq``'s last block names its first block's page again."""
    p = st.pools["main"]
    i = p.spaces[seq].i
    p.sp_members[i, p.sp_nmem[i] - 1] = p.sp_members[i, 0]


def _lose_bundle(st: StoreState, seq: int) -> None:
    del st.bundles[seq]


def _short_membership(st: StoreState, seq: int) -> None:
    st.pools["main"].sp_nmem[st.pools["main"].spaces[seq].i] -= 1


def _share_extent(st: StoreState, seq: int) -> None:
    """``seq``'s second page's host replica names its first page's extent (its own freed)."""
    p = st.pools["main"]
    s0, s1 = p.spaces[seq].members[:2]
    st.host.free(int(p.pg_host_off[s1]))  # type: ignore[union-attr]
    p.pg_host_off[s1] = p.pg_host_off[s0]


def _replica_on_pending(st: StoreState, seq: int) -> None:
    """``seq``'s first page's host replica names the extent its pending transfer writes."""
    p = st.pools["main"]
    s0 = p.spaces[seq].members[0]
    pending = next(o for _, ss, oo in st.host_pending.values()
                   for x, o in zip(ss, oo, strict=True) if x == s0)
    st.host.free(int(p.pg_host_off[s0]))  # type: ignore[union-attr]
    p.pg_host_off[s0] = pending


def _reference_lost(block: int) -> Callable[[StoreState, int], None]:
    """The page at ``block`` of the seq's membership counts one reference fewer."""
    def damage(st: StoreState, seq: int) -> None:
        p = st.pools["main"]
        p.pg_refs[p.spaces[seq].member(block)] -= 1
    return damage


def _length(n: int | None) -> Callable[[StoreState, int], None]:
    """The seq's membership length becomes ``n`` (None: one past its row's width)."""
    def damage(st: StoreState, seq: int) -> None:
        p = st.pools["main"]
        p.sp_nmem[p.spaces[seq].i] = p.sp_members.shape[1] + 1 if n is None else n
    return damage


def _slot_past_the_arrays(st: StoreState, seq: int) -> None:
    p = st.pools["main"]
    p.sp_members[p.spaces[seq].i, 0] = len(p.pg_live) + 5


def _alias(block: int) -> Callable[[StoreState, int], None]:
    """Block ``block`` of the seq's membership names a negative slot: numpy and numba wrap
    it onto another seq's first page (another sequence's KV)."""
    def damage(st: StoreState, seq: int) -> None:
        p = st.pools["main"]
        other = next(b for b, sp in p.spaces.items() if b != seq and sp.nmem)
        p.sp_members[p.spaces[seq].i, block] = p.spaces[other].member(0) - len(p.pg_live)
    return damage


def damaged_cases(st: StoreState, ck: int, a: int
                  ) -> dict[str, tuple[Callable[[StoreState, int], None], int, list[Any], str]]:
    """name -> (damage, the seq it lands on, events, the refusal's words); the damage lands
    after all events but the last."""
    p = st.pools["main"]
    nxt, row = st.next_bundle, p.free_rows.first()
    act = ev.Activate(nxt, "main", 3, row, 300, 150, 2)
    free_slot, free_page = next(iter(p.free_slots)), next(iter(p.free_pages))
    s0, s1 = p.spaces[ck].members[:2]
    off = next(iter(st.host.by_off))  # type: ignore[union-attr]
    offs = [off, off + (1 << 16)]
    reserve = ev.HostReserve("main", pack([s0, s1]), pack_i64(offs))
    publish = ev.HostPublish("main", off, pack([s0, s1]), pack([0, 0]), pack([P, P]),
                             ev.pack_u32([1, 2]))
    again = ev.HostReserve("main", pack([s0, s1]), pack_i64([o + (2 << 16) for o in offs]))
    dead_page = "a dead page in its membership"
    unsound = "no live page or one an earlier block names"
    return {
        "Move keeping the dead page, releasing the one past it": (
            _dead(1), ck, [act, ev.Move(ck, nxt, "main", 100)], unsound),
        "Move releasing the dead page past its frontier": (
            _dead(2), ck, [act, ev.Move(ck, nxt, "main", 100)], unsound),
        "Fork of the dead page": (_dead(1), ck, [act, ev.Fork(ck, nxt, "main", 2, 2 * P)],
                                  dead_page),
        "Prefix of the dead page": (_dead(0), ck, [ev.Prefix(ck, nxt, "main", 2)], unsound),
        "Share of the dead page": (_dead(1), a, [ev.Share(a, nxt, "main", 2)], unsound),
        "Truncate across the dead page, after a live one": (
            _dead(3), a, [ev.Truncate(a, "main", 100)], "block 3 names slot"),
        "Release of a checkpoint, the dead page after live ones": (
            _dead(2), ck, [ev.Release(ck, "main")], unsound),
        "Finish of a sequence, the dead page last": (
            _dead(3), a, [ev.Finish(a, "main", False, "done")], unsound),
        "Finish retaining the dead page": (
            _dead(1), a, [ev.Finish(a, "main", True, "done")], unsound),
        "Trim dropping the dead page": (
            _dead(3), a, [ev.Truncate(a, "main", 100), ev.Trim(a, "main", 2)], unsound),
        "HostAbort of a transfer whose page died": (
            _dead(1), ck, [reserve, ev.HostAbort("main", off)],
            r"HostAbort of main: slots \[\d+\] are not live"),
        "HostPublish of a transfer whose page died": (
            _dead(1), ck, [reserve, publish], r"HostPublish of main: slots \[\d+\] are not live"),
        "Move of a membership repeating a page": (
            _repeat_first, ck, [act, ev.Move(ck, nxt, "main", 100)], unsound),
        "Trim of a membership repeating a page": (
            _repeat_first, a, [ev.Truncate(a, "main", 100), ev.Trim(a, "main", 2)],
            unsound),
        "Finish of a space without its bundle": (
            _lose_bundle, a, [ev.Finish(a, "main", False, "done")], "has a space but no bundle"),
        "Release of a space without its bundle": (
            _lose_bundle, ck, [ev.Release(ck, "main")], "has a space but no bundle"),
        "Move from a space without its bundle": (
            _lose_bundle, ck, [act, ev.Move(ck, nxt, "main", 100)], "has a space but no bundle"),
        "Move into a space without its bundle": (
            _lose_bundle, nxt, [act, ev.Move(ck, nxt, "main", 100)],
            "has a space but no bundle"),
        "Fork into a space without its bundle": (
            _lose_bundle, nxt, [act, ev.Fork(ck, nxt, "main", 2, 2 * P)],
            "has a space but no bundle"),
        "Truncate of a membership short of its frontier": (
            _short_membership, a, [ev.Truncate(a, "main", 100)], "short of its committed"),
        "Release of two pages sharing a host extent": (
            _share_extent, ck, [reserve, publish, ev.Release(ck, "main")], "or another's"),
        "HostDrop of two pages sharing a host extent": (
            _share_extent, ck, [reserve, publish, ev.HostDrop("main", pack([s0, s1]))],
            "or another's"),
        "HostAbort of a transfer onto a replica's own extent": (
            _replica_on_pending, ck, [reserve, publish, again, ev.HostAbort(
                "main", offs[0] + (2 << 16))], "named twice"),
        "Fork of a membership naming a slot past the arrays": (
            _slot_past_the_arrays, ck, [act, ev.Fork(ck, nxt, "main", 2, 2 * P)],
            "a dead page in its membership"),
        "Finish retaining a membership repeating a page": (
            _repeat_first, a, [ev.Finish(a, "main", True, "done")], "block 3 names slot"),
        "Fork of a prefix, a dead page past it": (
            _dead(2), ck, [act, ev.Fork(ck, nxt, "main", 2, 2 * P)], dead_page),
        "Move keeping a negative slot": (
            _alias(0), ck, [act, ev.Move(ck, nxt, "main", 100)], "block 0 names slot -"),
        "Share of a negative slot": (
            _alias(1), a, [ev.Share(a, nxt, "main", 2)], "block 1 names slot -"),
        "Prefix of a negative slot": (
            _alias(0), ck, [ev.Prefix(ck, nxt, "main", 2)], "block 0 names slot -"),
        "Truncate across a negative slot": (
            _alias(2), a, [ev.Truncate(a, "main", 100)], "block 2 names slot -"),
        "Release of a negative slot": (
            _alias(1), ck, [ev.Release(ck, "main")], "block 1 names slot -"),
        "Release of a page whose reference was lost": (
            _reference_lost(1), ck, [ev.Release(ck, "main")], "which is no live page it refer"),
        "commit through a negative slot onto another's page": (
            _alias(3), a, [ev.CommitFrontiers("main", pack([a]), pack([210]))],
            "a block to write that is no live page it writes"),
        "commit through a slot past the arrays": (
            _slot_past_the_arrays, nxt, [act, ev.Materialize(
                "main", pack([nxt]), pack([free_slot]), pack([free_page])),
                ev.CommitFrontiers("main", pack([nxt]), pack([10]))],
            "a block to write that is no live page it writes"),
        "Materialize onto a membership of negative length": (
            _length(-1), a, [ev.Materialize("main", pack([a]), pack([free_slot]),
                                            pack([free_page]))],
            "a membership of negative length"),
        "Finish of a membership of negative length": (
            _length(-12), a, [ev.Finish(a, "main", False, "done")], "a membership of -12 pages"),
        "Fork of a membership longer than its row": (
            _length(None), ck, [act, ev.Fork(ck, nxt, "main", 2, 2 * P)], "a length past its row"),
        "HostPublish replacing two replicas sharing an extent": (
            _share_extent, ck, [reserve, publish, again, ev.HostPublish(
                "main", offs[0] + (2 << 16), pack([s0, s1]), pack([0, 0]), pack([P, P]),
                ev.pack_u32([3, 4]))], "named twice"),
    }


DAMAGED = ["Move keeping the dead page, releasing the one past it",
           "Move releasing the dead page past its frontier", "Fork of the dead page",
           "Prefix of the dead page", "Share of the dead page",
           "Truncate across the dead page, after a live one",
           "Release of a checkpoint, the dead page after live ones",
           "Finish of a sequence, the dead page last", "Finish retaining the dead page",
           "Trim dropping the dead page", "HostAbort of a transfer whose page died",
           "HostPublish of a transfer whose page died",
           "Move of a membership repeating a page", "Trim of a membership repeating a page",
           "Finish of a space without its bundle", "Release of a space without its bundle",
           "Move from a space without its bundle", "Move into a space without its bundle",
           "Fork into a space without its bundle",
           "Truncate of a membership short of its frontier",
           "Release of two pages sharing a host extent",
           "HostDrop of two pages sharing a host extent",
           "HostPublish replacing two replicas sharing an extent",
           "HostAbort of a transfer onto a replica's own extent",
           "Fork of a membership naming a slot past the arrays",
           "Finish retaining a membership repeating a page", "Fork of a prefix, a dead page past it",
           "Move keeping a negative slot", "Share of a negative slot", "Prefix of a negative slot",
           "Truncate across a negative slot", "Release of a negative slot",
           "Release of a page whose reference was lost",
           "commit through a negative slot onto another's page",
           "commit through a slot past the arrays",
           "Materialize onto a membership of negative length",
           "Finish of a membership of negative length",
           "Fork of a membership longer than its row"]


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_state_is_refused_by_its_own_rule(world: Any, name: str) -> None:
    """A damaged state (a snapshot from elsewhere, a bug) — a dead page in a membership or a
    pending transfer, a repeat, a lost bundle, a short membership, a shared host extent: each
    refused whole by the rule that names it. Before: a Move released the pages past its
    frontier before checking the ones it keeps, a Truncate cut live pages before the dead one,
    an abort freed extents first, a Move of a membership repeating a page applied and left a
    dead page in the destination."""
    s, ck, a = world
    st = copy.deepcopy(s.state)
    all_cases = damaged_cases(st, ck, a)
    assert sorted(all_cases) == sorted(DAMAGED)
    damage, seq, events, words = all_cases[name]
    for e in events[:-1]:
        apply(st, e)
    damage(st, seq)
    before = fingerprint(st)
    with pytest.raises(APPLY_ERRORS, match=words):
        apply(st, events[-1])
    assert fingerprint(st) == before, f"{name}: refused after a change"


def test_collect_refuses_a_page_it_cannot_free(world: Any) -> None:
    """``collect``'s own check (a second line: ``unref`` and ``collectable`` refuse first on
    every path through ``apply``): garbage whose slot is free already is refused with
    nothing freed, not freed twice."""
    s, ck, _ = world
    st = copy.deepcopy(s.state)
    p = st.pools["main"]
    slot = p.spaces[ck].member(0)
    p.pg_refs[slot] = 0
    p.free_slots.bits[slot] = True
    before = fingerprint(st)
    with pytest.raises(ValueError, match=f"freeing slot {slot} .*free already"):
        collect(st, p, np.array([slot], np.int64))
    assert fingerprint(st) == before
