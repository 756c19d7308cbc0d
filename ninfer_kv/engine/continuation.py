"""Activation from a retained checkpoint: Move, Fork and the partial-tail COW (spec §7.3, §9).

The caller names the checkpoint and the token frontier to continue from; the store decides Move
or Fork from the real references (§7.3 last paragraph):

* **Move** (§9.1) when the source is private — every page it would hand over has exactly one
  reference, the checkpoint's own — and the caller does not keep the source. No copy; page
  identity kept; the single writer appends in the unprotected suffix.
* **Fork** (§9.2) otherwise: the full pages before the frontier gain an immutable reference; a
  partial tail's committed columns are copied into a private page (COW, §9.3) whose device copy
  runs at the boundary before the table publication.

``share_prefix`` goes the other way: a *running* sequence's whole committed pages become a new
inactive checkpoint (``Share``), which others Fork from while the owner keeps decoding above
them (live prefix sharing). ``release_tail`` replaces an inactive checkpoint by its first whole
pages (``Prefix`` + ``Release``): a cache gives up a request's tail before its prompt.

Planning walks the eight steps of §7.3 for every enabled pool before any event is emitted, so
a failure at any step (including one injected through ``store.fault_hook``) leaves the prior
state — digest, reservations, rows, pins — exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ninfer_kv.engine import host
from ninfer_kv.engine import round_kernels as rk
from ninfer_kv.engine.args import as_bool, as_int, metadata_room, one_of, token_budget
from ninfer_kv.engine.layout import P, ceil_div
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState, new_ids
from ninfer_kv.errors import (
    CapacityExhausted,
    FrontierError,
    InactiveSpace,
    InvalidArgument,
    UnknownHandle,
    WritePermissionError,
)
from ninfer_kv.journal import events as ev

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


STEPS = ("create", "reserve", "restore", "move_fork", "cow", "rows", "tables", "publish")
"""The eight activation steps of spec §7.3, in order (fault-injection labels)."""

MODES = ("auto", "move", "fork")


def per_pool(what: str, frontier: Mapping[Any, Any], pools: Sequence[str]) -> dict[str, int]:
    """A frontier per pool, one for each of ``pools`` and no other (``as_int``, >= 0)."""
    unknown = sorted(set(frontier) - set(pools), key=repr)
    missing = [p for p in pools if p not in frontier]
    if unknown or missing:
        raise InvalidArgument(f"{what}frontier per pool: pools {list(pools)} need one each; "
                              f"missing {missing}, unknown {unknown}")
    return {p: as_int(f"frontier[{p!r}]", frontier[p], lo=0) for p in pools}


def activate_from(store: Txn, checkpoint: int, frontier: int | Mapping[str, int],
                  prompt_tokens: int, max_output_tokens: int, mode: str = "auto",
                  keep_source: bool = True, carry_metadata: bool = False) -> int:
    """``KVStore.activate_from``; with ``carry_metadata`` the new sequence gets the
    checkpoint's metadata in the same record (a preempted request resumed, §10)."""
    st = store.state
    checkpoint = as_int("checkpoint", checkpoint)
    prompt_tokens, max_output_tokens, total = token_budget(prompt_tokens, max_output_tokens,
                                                           store.plan.S)
    one_of("mode", mode, MODES)
    as_bool("keep_source", keep_source)
    as_bool("carry_metadata", carry_metadata)
    src_bundle = st.bundles.get(checkpoint)
    if src_bundle is None or src_bundle.active:
        raise UnknownHandle(f"{checkpoint} is not an inactive checkpoint")
    meta = src_bundle.meta if carry_metadata else b""
    if meta:
        metadata_room(f"activate_from({checkpoint}) carrying its metadata", store._pending,
                      len(meta))
    names = store.pools
    if type(frontier) is not int and isinstance(frontier, Mapping):
        frontiers = per_pool("", frontier, names)
    else:
        f0 = as_int("frontier", frontier, lo=0)
        frontiers = dict.fromkeys(names, f0)
    hook = store.fault_hook  # fault injection (tests): called before each step, per pool
    dst = new_ids(st, 1, store._ids_base)
    want_move = mode == "move" or (mode == "auto" and not keep_source)
    plans: list[_Plan] = []
    for pool in names:  # the eight steps, pool by pool; nothing is emitted before all are done
        if hook:                                                # 1. create / claim
            hook("create", pool)
        if pool not in src_bundle.pools:
            raise UnknownHandle(f"checkpoint {checkpoint} has no address space in pool {pool}")
        f = frontiers[pool]
        p = st.pools[pool]
        sp = p.spaces[checkpoint]
        i = sp.i
        if not 0 <= f <= sp.committed:
            raise FrontierError(f"checkpoint {checkpoint} pool {pool}: frontier {f} beyond its "
                                f"committed frontier {sp.committed} (§9.2)")
        if f > prompt_tokens:
            raise FrontierError(f"frontier {f} > prompt_tokens {prompt_tokens}")
        if meta and f != sp.committed:  # the metadata describes all of it (its
            raise InvalidArgument(  # token ids): a prefix of it would get another's tokens
                f"activate_from({checkpoint}, carry_metadata=True): frontier {f} in pool "
                f"{pool} is below the checkpoint's committed {sp.committed}; its metadata "
                "describes the whole checkpoint, so only a continuation of all of it carries "
                "it (set the new sequence's own metadata instead)")
        pl = _Plan(pool, p, i, f, store.entitlement_pages(pool, prompt_tokens, total))
        if hook:                                                # 2. reserve
            hook("reserve", pool)
        move = want_move
        if move:  # a Move takes the pages over: none may have another reference (§9.1)
            mem = p.sp_members[i, :p.sp_nmem[i]]  # read only
            shared = mem[p.pg_refs[mem] > 1].tolist()
            if shared and mode == "auto":
                move = False        # auto: Fork instead
            elif shared:
                raise WritePermissionError(f"Move of checkpoint {checkpoint} pool {pool} "
                                           f"refused: pages {shared[:8]} still have surviving "
                                           "references (§9.1)")
        if move and keep_source:
            raise WritePermissionError(f"Move of checkpoint {checkpoint} refused: the caller keeps "
                                       "the source, so it would survive (§9.1); use fork")
        held = ceil_div(f, P) if move else f // P
        tail = not move and f % P != 0
        # pages this activation needs on the device: the held prefix and, for a Fork at a
        # mid-page frontier, the COW source tail — block f // P, right after the prefix. A
        # live page without a device replica has a host one (§5.1, checked by §14), so a pool
        # holding no host replica has none to restore
        missing = (rk.without_device(p.sp_members[i, :min(held + tail, p.sp_nmem[i])],
                                     p.pg_device).tolist() if p.host_of else [])
        need = pl.entitlement - held + len(missing)
        if need > p.available:
            raise CapacityExhausted(f"pool {pool}: continuation needs {need} pages "
                                    f"({len(missing)} to restore from host), {p.available} "
                                    "available", pool=pool, short=need - p.available)
        pl.move, pl.held, pl.tail, pl.missing = move, held, tail, missing
        if hook:                                                # 3. restore Host-only pages
            hook("restore", pool)
        if missing:
            block = {s: k for k, s in enumerate(sp.members)}
            for s in missing:
                cols = min(P, f - block[s] * P)  # the columns this continuation reads
                if not host.replica_valid(p.pages[s], cols):  # type: ignore[arg-type]
                    raise UnknownHandle(f"checkpoint {checkpoint} pool {pool}: page "
                                        f"{pool}:{s} has neither a device replica nor a "
                                        f"valid host replica for {cols} columns (§5.1)")
        n = len(missing) + tail
        picks = p.pick_pages(n) if n else []
        if missing:
            pl.restored = dict(zip(missing, picks, strict=False))
        if hook:                                                # 4/5. Move or Fork, COW tail
            hook("move_fork", pool)
            hook("cow", pool)
        if tail:
            src_slot = int(p.sp_members[i, f // P])
            src_page = pl.restored.get(src_slot, int(p.pg_device[src_slot]))
            pl.cow = (p.pick_slots(1)[0], picks[-1], src_slot, src_page)
        if hook:                                                # 6. lease rows
            hook("rows", pool)
        if not p.free_rows:
            raise CapacityExhausted(f"pool {pool}: all {p.rows} execution rows are leased",
                                    pool=pool)
        pl.row = p.free_rows.first()
        if hook:                                                # 7/8. tables, publish
            hook("tables", pool)
            hook("publish", pool)
        plans.append(pl)
    # --- everything is planned: emit -------------------------------------------------------------
    events: list[Any] = []
    effects: list[Any] = []  # device copies the boundary runs, in emission order
    for pl in plans:
        pool, f = pl.pool, pl.frontier
        events.append(ev.Activate(dst, pool, pl.entitlement, pl.row, total, prompt_tokens,
                                  pl.held))
        # pin what the boundary's copies read: restored pages (their host replica) and the
        # COW source tail, so no command before the boundary can free or replace them (§5.3)
        read = [*pl.restored, pl.cow[2]] if pl.tail else list(pl.restored)
        if read:  # released by the Unpin the boundary journals after the copies ran
            events.append(ev.Pin(pool, ev.pack(read)))
        if pl.restored:
            slots = list(pl.restored)
            effects.append(ev.DeviceRestore(pool, ev.pack(slots),
                                            ev.pack([pl.restored[x] for x in slots])))
            events.append(effects[-1])
        if pl.move:
            events.append(ev.Move(checkpoint, dst, pool, f))
        else:
            events.append(ev.Fork(checkpoint, dst, pool, f // P, f))
            if pl.tail:
                slot, page, src_slot, src_page = pl.cow
                effects.append(ev.CopyTail(dst, pool, slot, page, src_slot, src_page, f % P))
                events.append(effects[-1])
    events.append(ev.PublishActive(dst))
    if meta:
        events.append(ev.SetMetadata(dst, meta))
    if not keep_source and any(not pl.move for pl in plans):
        events.extend(ev.Release(checkpoint, pl.pool) for pl in plans if not pl.move)
    store._emit(*events)
    if effects:
        store._effects.extend(effects)
        store.stats["cow_copies"] += sum(type(e) is ev.CopyTail for e in effects)
    for pl in plans:
        store._touch(pl.pool, dst, 0)
    return dst


class _Plan:
    """One pool's activation plan (§7.3), filled in step by step before anything is emitted."""

    __slots__ = ("pool", "p", "i", "frontier", "entitlement", "move", "held", "tail", "missing",
                 "restored", "cow", "row")

    def __init__(self, pool: str, p: PoolState, i: int, frontier: int, entitlement: int
                 ) -> None:
        self.pool, self.p, self.i = pool, p, i  # the checkpoint's space index in ``p``
        self.frontier, self.entitlement = frontier, entitlement
        self.move = self.tail = False
        self.held = self.row = -1
        self.missing: list[int] = []
        self.restored: dict[int, int] = {}    # Host-only slot -> the device page it gets
        self.cow: tuple[int, int, int, int] = (-1, -1, -1, -1)  # slot, page, src slot, src page



def _live_frontier(st: StoreState, bundle: int, frontier: int | None, what: str,
                   hint: str) -> tuple[Any, dict[str, Any], int]:
    """(bundle, its spaces per pool, frontier) of running sequence ``bundle`` for ``what``:
    ``frontier`` defaults to, and may not exceed, its committed frontier in every pool."""
    b = st.bundles.get(bundle)
    if b is None or not b.active:
        raise InactiveSpace(f"seq {bundle} is not an active sequence; {hint}")
    spaces = {pool: st.pools[pool].spaces[bundle] for pool in b.pools}
    committed = min(sp.committed for sp in spaces.values())
    f = committed if frontier is None else as_int("frontier", frontier, lo=0)
    if f > committed:
        per_pool = {pool: sp.committed for pool, sp in spaces.items()}
        raise FrontierError(f"seq {bundle}: {what} frontier {f} beyond its committed "
                            f"frontier {committed} (per pool: {per_pool})")
    return b, spaces, f


def share_prefix(store: Txn, bundle: int, frontier: int | None) -> int:
    """``KVStore.share_prefix``: validate, then one ``Share`` event per pool of the bundle."""
    st = store.state
    bundle = as_int("seq", bundle)
    b, _, f = _live_frontier(st, bundle, frontier, "share_prefix",
                             "share_prefix shares a running one (a finished one is a "
                             "checkpoint already)")
    if f < P:
        raise FrontierError(f"seq {bundle}: share_prefix frontier {f} holds no whole page "
                            f"(P={P}); only full, committed pages are shared")
    dst = new_ids(st, 1, store._ids_base)
    store._emit(*(ev.Share(bundle, dst, pool, f // P) for pool in b.pools))
    return dst


def release_tail(store: Txn, checkpoint: int, frontier: int | Mapping[str, int]) -> int | None:
    """``KVStore.release_tail``: validate, then a ``Prefix`` per pool (when some pool keeps a
    whole page) and a ``Release`` per pool, in one record. ``frontier`` is one int for every
    pool, or one per pool (the pools of a DFlash checkpoint hold different frontiers); a pool
    whose frontier holds no whole page keeps an empty space in the new checkpoint."""
    st = store.state
    checkpoint = as_int("checkpoint", checkpoint)
    mapping = type(frontier) is not int and isinstance(frontier, Mapping)
    f0 = 0 if mapping else as_int("frontier", frontier, lo=0)  # integers before any rule
    b = st.bundles.get(checkpoint)
    if b is None or b.active:
        raise UnknownHandle(f"release_tail: {checkpoint} is not an inactive checkpoint")
    committed = {pool: st.pools[pool].spaces[checkpoint].committed for pool in b.pools}
    if mapping:
        fs = per_pool("release_tail ", frontier, b.pools)
        for pool, f in fs.items():
            if f > committed[pool]:
                raise FrontierError(f"release_tail: checkpoint {checkpoint} pool {pool} keeps "
                                    f"at most its frontier {committed[pool]}, not {f}")
    else:
        low = min(committed.values())
        if f0 > low:
            raise FrontierError(f"release_tail: checkpoint {checkpoint} keeps at most its "
                                f"frontier {low} (lowest over pools {list(b.pools)}: "
                                f"{committed}), not {f0}")
        fs = dict.fromkeys(b.pools, f0)
    keep = {pool: f // P for pool, f in fs.items()}
    dst = new_ids(st, 1, store._ids_base) if any(keep.values()) else None
    events: list[Any] = [ev.Prefix(checkpoint, dst, pool, keep[pool]) for pool in b.pools] \
        if dst is not None else []
    events.extend(ev.Release(checkpoint, pool) for pool in b.pools)
    store._emit(*events)
    return dst


def fork_live(store: Txn, bundle: int, frontier: int | Mapping[str, int] | None,
              max_output_tokens: int) -> int:
    """``KVStore.fork_live``: a new active sequence holding running sequence ``bundle``'s
    first ``frontier`` tokens (default: its committed frontier in every pool; a mapping gives
    each pool its own, as the pools of a DFlash sequence commit different frontiers), for n>1
    sampling or beam search. The whole pages below the frontier are shared (``Share`` into a
    transient checkpoint, ``Fork`` from it, ``Release`` of it: both sequences keep them,
    immutable, §9.2); the partial tail's columns are copied from the owner's live tail page into
    a private page (COW, §9.3) at the next boundary, pinned until then — the owner keeps
    appending above its committed frontier meanwhile. Planned whole before anything is emitted.
    The child's ``parent`` is the transient checkpoint when whole pages were shared (it is in
    the journal, released by the same record), none when every frontier is below one page."""
    st = store.state
    bundle = as_int("seq", bundle)
    max_output_tokens = as_int("max_output_tokens", max_output_tokens, lo=0)
    hint = "fork_live forks a running one (continue a checkpoint with activate_from)"
    if isinstance(frontier, Mapping):
        b = st.bundles.get(bundle)
        if b is None or not b.active:
            raise InactiveSpace(f"seq {bundle} is not an active sequence; {hint}")
        fs = per_pool("fork_live ", frontier, b.pools)
        spaces = {pool: st.pools[pool].spaces[bundle] for pool in b.pools}
        for pool, f in fs.items():
            if f > spaces[pool].committed:
                raise FrontierError(f"seq {bundle} pool {pool}: fork_live frontier {f} beyond "
                                    f"its committed frontier {spaces[pool].committed}")
    else:
        _, spaces, f0 = _live_frontier(st, bundle, frontier, "fork_live", hint)
        fs = dict.fromkeys(spaces, f0)
    top = max(fs.values())
    total = top + max_output_tokens
    if total <= 0 or total > store.plan.S:
        raise FrontierError(f"fork_live: frontier {top} + max_output_tokens {max_output_tokens} "
                            f"= {total} must be in [1, S={store.plan.S}] (§3.2)")
    shares = any(f >= P for f in fs.values())
    first = new_ids(st, 2 if shares else 1, store._ids_base)
    ck = first if shares else -1
    dst = first + (1 if shares else 0)
    plans: dict[str, tuple[int, int, tuple[int, int, int, int] | None]] = {}
    for pool, sp in spaces.items():
        p = st.pools[pool]
        full, tail = divmod(fs[pool], P)
        ent = store.entitlement_pages(pool, fs[pool], total)
        if ent - full > p.available:
            raise CapacityExhausted(f"pool {pool}: fork_live needs {ent - full} pages, "
                                    f"{p.available} available", pool=pool,
                                    short=ent - full - p.available)
        if not p.free_rows:
            raise CapacityExhausted(f"pool {pool}: all {p.rows} execution rows are leased",
                                    pool=pool)
        cow = None
        if tail:
            src_slot = sp.member(full)
            cow = (p.pick_slots(1)[0], p.pick_pages(1)[0], src_slot, int(p.pg_device[src_slot]))
        plans[pool] = (ent, p.free_rows.first(), cow)
    events: list[Any] = []
    if shares:
        events.extend(ev.Share(bundle, ck, pool, fs[pool] // P) for pool in plans)
    for pool, (ent, row, cow) in plans.items():
        full, tail = divmod(fs[pool], P)
        events.append(ev.Activate(dst, pool, ent, row, total, top, full))
        if cow is not None:
            events.append(ev.Pin(pool, ev.pack([cow[2]])))
        if shares:
            events.append(ev.Fork(ck, dst, pool, full, fs[pool]))
        if cow is not None:
            events.append(ev.CopyTail(dst, pool, *cow, tail))
    events.append(ev.PublishActive(dst))
    if shares:
        events.extend(ev.Release(ck, pool) for pool in plans)
    store._emit(*events)
    for e in events:
        if isinstance(e, ev.CopyTail):
            store._effects.append(e)
            store.stats["cow_copies"] += 1
    for pool in plans:
        store._touch(pool, dst, 0)
    return dst


def unrecoverable_reason(st: StoreState, bundle: int) -> str | None:
    """Why an inactive checkpoint cannot survive a restart (None = every page has a published,
    epoch-matching host replica covering its committed columns, spec §5.1)."""
    for pool in st.bundles[bundle].pools:
        p = st.pools[pool]
        for i, slot in enumerate(p.spaces[bundle].members):
            pg = p.pages[slot]
            assert pg is not None
            if pg.host is None:
                return f"pool {pool} block {i}: device-only page (no host replica)"
            _, epoch, coverage, _ = pg.host
            if epoch != pg.epoch or coverage < pg.committed:
                return (f"pool {pool} block {i}: host replica epoch {epoch}/coverage {coverage} "
                        f"does not match page epoch {pg.epoch}/committed {pg.committed}")
    return None
