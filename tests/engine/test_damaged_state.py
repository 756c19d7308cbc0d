"""``apply`` on a damaged state refuses whole: an exhaustive test over every kind of event.

A state damaged in one field — a page marked dead, a reference or pin count lost or gained, a
free-list bit flipped, a space's flag or frontier changed, a host replica forgotten: what a
foreign snapshot or a bug could leave — and an event that applies cleanly to the undamaged
state. ``apply`` either applies it or refuses it with an ``APPLY_ERRORS`` exception and the
state unchanged (``fingerprint``: the digest, the free lists, the counters, every array).
Never a partial change; never another exception. (Noticing the damage is the checkers' job,
``test_invariants``; this test asks only that a refusal leaves nothing half done.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.state import StoreState
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import APPLY_ERRORS
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack, pack_i64
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, running, step
from tests.engine.test_damaged_events import fingerprint


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A store with an inactive checkpoint ``ck`` (3 pages, 150 tokens), a running sequence
    ``a`` (4 pages, committed 200, room for 7) and a second one; a host arena."""
    d: Path = tmp_path_factory.mktemp("damaged")
    s = KVStore.open(small_config(d, host_bytes=8 << 20))
    ck = checkpoint_at(s, 150)
    gone = checkpoint_at(s, 64)
    a = running(s, 200)
    running(s, 10)
    s.release(gone)
    step(s)
    yield s, ck, a
    s.close()


def valid_cases(st: StoreState, ck: int, a: int) -> dict[str, list[Any]]:
    """name -> events that apply cleanly to the undamaged state; the damage lands before the
    last one."""
    p = st.pools["main"]
    nxt, row = st.next_bundle, p.free_rows.first()
    free_slot, free_page = next(iter(p.free_slots)), next(iter(p.free_pages))
    ck_slots, a_slots = list(p.spaces[ck].members), list(p.spaces[a].members)
    s0, s1, s2 = ck_slots
    off = next(iter(st.host.by_off))  # type: ignore[union-attr]
    off2 = off + 2 * (1 << 16)  # free still after the first transfer's two pages
    act = ev.Activate(nxt, "main", 3, row, 300, 150, 2)
    reserve = ev.HostReserve("main", pack([s0, s1]), pack_i64([off, off + (1 << 16)]))
    publish = ev.HostPublish("main", off, pack([s0, s1]), pack([0, 0]), pack([P, P]),
                             ev.pack_u32([1, 2]))
    drop = ev.DeviceDrop("main", pack([s0, s1]))
    return {
        "Finish": [ev.Finish(a, "main", False, "done")],
        "Finish, retained": [ev.Finish(a, "main", True, "done")],
        "Release": [ev.Release(ck, "main")],
        "Activate": [act],
        "PublishActive": [act, ev.PublishActive(nxt)],
        "Move": [act, ev.Move(ck, nxt, "main", 100)],
        "Fork": [act, ev.Fork(ck, nxt, "main", 2, 2 * P)],
        "CopyTail": [act, ev.Pin("main", pack([s2])), ev.Fork(ck, nxt, "main", 2, 150),
                     ev.CopyTail(nxt, "main", free_slot, free_page, s2, int(p.pg_device[s2]),
                                 150 - 2 * P)],
        "Prefix": [ev.Prefix(ck, nxt, "main", 2)],
        "Share": [ev.Share(a, nxt, "main", 2)],
        "Truncate": [ev.Truncate(a, "main", 100)],
        "Trim": [ev.Truncate(a, "main", 100), ev.Trim(a, "main", 2)],
        "Materialize": [ev.Materialize("main", pack([a]), pack([free_slot]), pack([free_page]))],
        "CommitFrontiers": [ev.CommitFrontiers("main", pack([a]), pack([210]))],
        "ProvisionalFrontiers": [ev.ProvisionalFrontiers("main", pack([a]), pack([220]))],
        "Grow": [ev.Grow("main", pack([a]), pack([1]))],
        "HostReserve": [reserve],
        "HostPublish": [reserve, publish],
        "HostAbort": [reserve, ev.HostAbort("main", off)],
        "HostDrop": [reserve, publish, ev.HostDrop("main", pack([s0, s1]))],
        "DeviceDrop": [reserve, publish, drop],
        "DeviceRestore": [reserve, publish, drop, ev.DeviceRestore(
            "main", pack([s0, s1]), pack(list(p.free_pages)[:2]))],
        "Release, with host replicas": [reserve, publish, ev.Release(ck, "main")],
        "Unpin of a released page": [reserve, publish, ev.Pin("main", pack([s0])),
                                     ev.Release(ck, "main"), ev.Unpin("main", pack([s0]))],
        "HostAbort of a released page": [
            reserve, publish, ev.HostReserve("main", pack([s0]), pack_i64([off2])),
            ev.Release(ck, "main"), ev.HostAbort("main", off2)],
        "Pin": [ev.Pin("main", pack([a_slots[0], s0]))],
        "Unpin": [ev.Pin("main", pack([a_slots[0], s0])),
                  ev.Unpin("main", pack([a_slots[0], s0]))],
    }


CASES = sorted(["Finish", "Finish, retained", "Release", "Activate", "PublishActive", "Move",
                "Fork", "CopyTail", "Prefix", "Share", "Truncate", "Trim", "Materialize",
                "CommitFrontiers", "ProvisionalFrontiers", "Grow", "HostReserve", "HostPublish",
                "HostAbort", "HostDrop", "DeviceDrop", "DeviceRestore", "Pin", "Unpin",
                "Release, with host replicas", "Unpin of a released page",
                "HostAbort of a released page"])


def _add(name: str, d: int) -> Callable[[StoreState, int, int], None]:
    def damage(st: StoreState, slot: int, i: int) -> None:
        arr = getattr(st.pools["main"], name)
        arr[i if name.startswith("sp_") else slot] += d
    return damage


def _set(name: str, v: Any) -> Callable[[StoreState, int, int], None]:
    def damage(st: StoreState, slot: int, i: int) -> None:
        arr = getattr(st.pools["main"], name)
        arr[i if name.startswith("sp_") else slot] = v
    return damage


def _bit(which: str, v: bool, of_device: bool) -> Callable[[StoreState, int, int], None]:
    def damage(st: StoreState, slot: int, i: int) -> None:
        p = st.pools["main"]
        ids = p.free_pages if which == "pages" else p.free_slots
        k = int(p.pg_device[slot]) if of_device else slot
        if 0 <= k < len(ids.bits):
            ids.bits[k] = v
    return damage


def _forget_host(st: StoreState, slot: int, i: int) -> None:
    p = st.pools["main"]
    if slot in p.host_of:
        del p.host_of[slot]


def _free_extent(pending: bool) -> Callable[[StoreState, int, int], None]:
    """The arena forgets the extent of ``slot``'s host replica, or of its pending transfer."""
    def damage(st: StoreState, slot: int, i: int) -> None:
        off = int(st.pools["main"].pg_host_off[slot])
        if pending:
            off = next((o for _, ss, oo in st.host_pending.values() for x, o in zip(ss, oo, strict=True)
                        if x == slot), -1)
        if off >= 0 and off in st.host.live:  # type: ignore[union-attr]
            st.host.free(off)  # type: ignore[union-attr]
    return damage


def _row_free(st: StoreState, slot: int, i: int) -> None:
    p = st.pools["main"]
    row = int(p.sp_row[i])
    if row >= 0 and not p.free_rows.bits[row]:
        p.free_rows.add(row)


def _row_owner_lost(st: StoreState, slot: int, i: int) -> None:
    p = st.pools["main"]
    p.row_owner.pop(int(p.sp_row[i]), None)


def _member_swapped(st: StoreState, slot: int, i: int) -> None:
    """The space's first block points at ``slot`` (another space's page, or a repeat)."""
    p = st.pools["main"]
    if p.sp_nmem[i]:
        p.sp_members[i, 0] = slot


def _index_lost(st: StoreState, slot: int, i: int) -> None:
    p = st.pools["main"]
    b = int(p.sp_bundle[i])
    if b >= 0 and b in p.bundle_table.items():  # the compiled loops' map loses its entry
        p.bundle_table.remove(b)


def _bundle_lost(st: StoreState, slot: int, i: int) -> None:
    st.bundles.pop(int(st.pools["main"].sp_bundle[i]), None)


def _member_repeated(st: StoreState, slot: int, i: int) -> None:
    """The space's last block names its first block's page again."""
    p = st.pools["main"]
    if p.sp_nmem[i] > 1:
        p.sp_members[i, p.sp_nmem[i] - 1] = p.sp_members[i, 0]


def _member_negative(st: StoreState, slot: int, i: int) -> None:
    """The space's first block names ``slot`` as a negative index (wrapped, it is ``slot``)."""
    p = st.pools["main"]
    if p.sp_nmem[i]:
        p.sp_members[i, 0] = slot - len(p.pg_live)


def _member_too_long(st: StoreState, slot: int, i: int) -> None:
    """The space's membership length runs past its row of ``sp_members``."""
    p = st.pools["main"]
    p.sp_nmem[i] = p.sp_members.shape[1] + 1


def _extent_shared(st: StoreState, slot: int, i: int) -> None:
    """``slot``'s host replica names another replica's extent (its own freed)."""
    p = st.pools["main"]
    others = [int(o) for s, o in enumerate(p.pg_host_off) if o >= 0 and s != slot]
    if p.pg_host_off[slot] >= 0 and others:
        st.host.free(int(p.pg_host_off[slot]))  # type: ignore[union-attr]
        p.pg_host_off[slot] = others[0]


def _copy_pin_lost(st: StoreState, slot: int, i: int) -> None:
    st.copy_pins.pop(("main", slot), None)


DAMAGES: dict[str, Callable[[StoreState, int, int], None]] = {
    "page dead": _set("pg_live", False),
    "reference lost": _add("pg_refs", -1),
    "reference gained": _add("pg_refs", 1),
    "active reference lost": _add("pg_active", -1),
    "pin gained": _add("pg_pins", 1),
    "pin lost": _add("pg_pins", -1),
    "writer lost": _set("pg_writer", -1),
    "committed columns lost": _set("pg_committed", 0),
    "slot marked free": _bit("slots", True, False),
    "page group marked free": _bit("pages", True, True),
    "host replica forgotten": _forget_host,
    "host replica's extent freed": _free_extent(False),
    "pending transfer's extent freed": _free_extent(True),
    "row marked free": _row_free,
    "row owner lost": _row_owner_lost,
    "space inactive": _set("sp_active", False),
    "space active": _set("sp_active", True),
    "committed frontier lowered": _add("sp_committed", -1),
    "membership shortened": _add("sp_nmem", -1),
    "membership pointing elsewhere": _member_swapped,
    "bundle index lost": _index_lost,
    "copy pin forgotten": _copy_pin_lost,
    "bundle lost": _bundle_lost,
    "membership repeating a page": _member_repeated,
    "host extent shared": _extent_shared,
    "generation advanced": _add("pg_gen", 1),
    "entitlement lowered": _add("sp_entitlement", -3),
    "membership naming a negative slot": _member_negative,
    "membership longer than its row": _member_too_long,
}

# the case -> the space whose whole membership its last event reads ("ck" or "a")
READS = {"Finish": "a", "Finish, retained": "a", "Release": "ck", "Move": "ck", "Fork": "ck",
         "Prefix": "ck", "Share": "a", "Truncate": "a", "Trim": "a",
         "Release, with host replicas": "ck"}


def test_a_refusal_on_a_damaged_state_changes_nothing(world: Any) -> None:
    """Every case, every damage, every page of ``ck`` and ``a`` as its target (and their two
    spaces, alternately): exhaustive, cases x damages x 7 targets (5,292 today, ~2 s)."""
    s, ck, a = world
    failures = []
    for name in CASES:
        for damage in sorted(DAMAGES):
            for target in range(7):  # ck's 3 pages, then a's 4
                st = copy.deepcopy(s.state)
                events = valid_cases(st, ck, a)[name]
                p = st.pools["main"]
                slots = [*p.spaces[ck].members, *p.spaces[a].members]
                spaces = [p.spaces[b].i for b in (ck, a)]
                for e in events[:-1]:
                    apply(st, e)
                DAMAGES[damage](st, slots[target], spaces[target % 2])
                before = fingerprint(st)
                try:
                    apply(st, events[-1])
                except APPLY_ERRORS as exc:
                    if fingerprint(st) != before:
                        failures.append(f"{name} after '{damage}' of target {target}: refused "
                                        f"({exc!r}) after a change")
    assert not failures, "\n".join(failures)


def test_every_case_applies_to_the_undamaged_state(world: Any) -> None:
    """The property above is not vacuous: each last event applies cleanly, and changes the
    state, without the damage."""
    s, ck, a = world
    cases = valid_cases(s.state, ck, a)
    assert sorted(cases) == CASES
    for name, events in cases.items():
        st = copy.deepcopy(s.state)
        for e in events[:-1]:
            apply(st, e)
        before = fingerprint(st)
        apply(st, events[-1])
        assert fingerprint(st) != before, name


def test_an_event_reading_a_damaged_membership_refuses_it(world: Any) -> None:
    """The other half: an event that reads a membership refuses one that breaks §14 (a dead
    page, a repeat, a negative slot — which numpy and numba wrap onto a live page, so each was
    applied before: a Finish(retain) counted a repeat twice, a Share or a Move took another
    sequence's page). Exhaustive over ``READS`` x those damages x the pages of that space."""
    s, ck, a = world
    accepted = []
    for name, whose in sorted(READS.items()):
        for damage in ("page dead", "membership repeating a page",
                       "membership naming a negative slot", "membership longer than its row"):
            sp = s.state.pools["main"].spaces[ck if whose == "ck" else a]
            for slot in sp.members:
                st = copy.deepcopy(s.state)
                events = valid_cases(st, ck, a)[name]
                for e in events[:-1]:
                    apply(st, e)
                DAMAGES[damage](st, slot, st.pools["main"].spaces[sp.bundle].i)
                try:
                    apply(st, events[-1])
                except APPLY_ERRORS:
                    continue
                accepted.append(f"{name} after '{damage}' of slot {slot}: applied")
    assert not accepted, "\n".join(accepted)
