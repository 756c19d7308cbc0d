"""Journal tools: ``replay``, ``inspect``, ``dump``, ``events`` — what an engine developer
reaches for when a prefix cache misses, a page leaks or a run crashed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.host import replica_valid
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.state import StoreState, digest
from ninfer_kv.errors import InvalidArgument, UnknownHandle
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.export import to_jsonable
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay, replay_start
from ninfer_kv.replay.core import applying
from ninfer_kv.tools.argtypes import FROM_SNAPSHOT_HELP, non_negative, positive
from ninfer_kv.tools.output import emit_json

Command = Callable[[argparse.Namespace, Console], int]


def register(sub: argparse._SubParsersAction) -> dict[str, Command]:
    p = sub.add_parser("replay", help="rebuild state from a journal; verify invariants")
    p.add_argument("dir", help="journal directory")
    p.add_argument("--verify", action="store_true", help="check invariants after every event")
    p.add_argument("--every", type=positive, default=1, help="with --verify: every N events")
    p.add_argument("--until", type=non_negative, default=None, help="stop after this record")
    p.add_argument("--from-snapshot", action="store_true", help=FROM_SNAPSHOT_HELP)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("inspect", help="occupancy, address spaces, one page and its history")
    p.add_argument("dir")
    p.add_argument("--at", type=non_negative, default=None, help="state after this record")
    p.add_argument("--seq", type=non_negative, default=None,
                   help="only this sequence/checkpoint")
    p.add_argument("--page", default=None, help="POOL:SLOT, e.g. main:12")
    p.add_argument("--from-snapshot", action="store_true", help=FROM_SNAPSHOT_HELP)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("dump", help="the journal as NDJSON, one event per line (for jq)")
    p.add_argument("dir")
    p.add_argument("--from", dest="from_seq", type=non_negative, default=0)
    p.add_argument("--from-snapshot", action="store_true", help=FROM_SNAPSHOT_HELP)
    p.add_argument("--json", action="store_true", help="(NDJSON is already JSON)")
    p = sub.add_parser("events", help="KV-event stream: BlockStored / BlockRemoved / "
                                      "AllBlocksCleared (vLLM's shape) + removal reason")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="NDJSON (default: a table)")
    p.add_argument("--from-snapshot", action="store_true", help=FROM_SNAPSHOT_HELP)
    return {"replay": run_replay, "inspect": run_inspect, "dump": run_dump,
            "events": run_events}


# --- replay -------------------------------------------------------------------------------------
def run_replay(a: argparse.Namespace, console: Console) -> int:
    # one scan: its length for the bar, its records to replay
    reader = JournalReader(a.dir, from_snapshot=a.from_snapshot)
    last = reader.last_seq
    if a.until is not None and a.until > last:  # the digest printed would be another record's
        raise InvalidArgument(f"--until {a.until}: the journal ends at record {last}")
    with Progress(TextColumn("replay"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=Console(stderr=True),
                  disable=a.json or last < 2000, transient=True) as bar:
        task = bar.add_task("replay", total=min(last, a.until or last))
        res = replay(reader, verify_every=a.every if a.verify else 0, until_record=a.until,
                     progress=lambda seq, _: bar.update(task, completed=seq))
    out = {"records": res.records, "events": res.events, "digest": res.digest,
           "events_per_s": round(res.events_per_s), "seconds": round(res.seconds, 4),
           "violations": [{"record": v.seq, "event_index": v.index, "event": v.event,
                           "problems": v.problems} for v in res.violations],
           "cuts": res.cuts}
    if a.json:
        emit_json(out)
    else:
        console.print(f"replayed {res.records} records, {res.events} events in "
                      f"{res.seconds * 1e3:.1f} ms ({res.events_per_s:,.0f} events/s)")
        for c in res.cuts:
            console.print(f"[yellow]the journal ends early[/yellow]: {c}")
        console.print(f"digest [bold]{res.digest}[/bold]")
        for v in res.violations:
            console.print(f"[red]violation[/red] after record {v.seq} event {v.index} "
                          f"({v.event}): " + "; ".join(v.problems[:3]))
        if not res.violations:
            how = (f" (checked every {a.every} events)" if a.every > 1 else
                   " (checked after every event)") if a.verify else " (checked at the end)"
            console.print("invariants: [green]clean[/green]" + how)
    return 1 if res.violations else 0


# --- inspect ------------------------------------------------------------------------------------
def _touches(st: StoreState, e: Any, pool: str, slot: int) -> bool:
    """Does event ``e`` (about to be applied to ``st``) touch page ``pool:slot``?"""
    if getattr(e, "pool", None) != pool:
        return False
    for field in ("slots", "src_slot", "slot"):
        v = getattr(e, field, None)
        if isinstance(v, bytes) and slot in ev.unpack(v).tolist():
            return True
        if isinstance(v, int) and v == slot:
            return True
    if isinstance(e, ev.HostPublish | ev.HostAbort):
        return slot in st.host_pending.get(e.offset, ("", (), ()))[1]
    p = st.pools.get(pool)
    if p is None:
        return False
    bundles = []
    for field in ("bundle", "src", "dst"):
        if isinstance(getattr(e, field, None), int):
            bundles.append(getattr(e, field))
    if isinstance(getattr(e, "bundles", None), bytes):
        bundles.extend(ev.unpack(e.bundles).tolist())
    return any(b in p.spaces and slot in p.spaces[b].members for b in bundles)


def state_at(directory: str, at: int | None, page: tuple[str, int] | None = None,
             from_snapshot: bool = False) -> tuple[StoreState, list[dict[str, Any]], list[str]]:
    """The state after record ``at`` (the last), the history of ``page`` up to there, and
    what the read cut from the journal's end (a torn tail, or an append in progress)."""
    reader = JournalReader(directory, from_snapshot=from_snapshot)
    if at is not None and at > reader.last_seq:
        raise InvalidArgument(f"--at {at}: the journal ends at record {reader.last_seq}")
    st, start = replay_start(reader, at)
    history: list[dict[str, Any]] = []
    for seq, events in reader.records(start):
        if at is not None and seq > at:
            break
        for i, e in enumerate(events):
            with applying(seq, i, e):
                if page is not None and _touches(st, e, *page):
                    history.append({"record": seq, "event_index": i, **to_jsonable(e)})
                apply(st, e)
        st.seq = seq
    return st, history, [str(c) for c in reader.scan.cuts]


def describe(st: StoreState, seq: int | None = None) -> dict[str, Any]:
    pools = {}
    for name, p in st.pools.items():
        pools[name] = {"capacity": p.capacity, "allocated": p.allocated, "reserved": p.reserved,
                       "available": p.available, "rows_leased": len(p.row_owner),
                       "live_pages": sum(pg is not None for pg in p.pages)}
    spaces = []
    for name, p in st.pools.items():
        for b in sorted(p.spaces):
            if seq is not None and b != seq:
                continue
            sp = p.spaces[b]
            spaces.append({"seq": b, "pool": name, "active": sp.active,
                           "committed": sp.committed, "provisional": sp.provisional,
                           "protected": sp.protected, "entitlement": sp.entitlement,
                           "reserved": sp.reserved, "pages": sp.nmem, "row": sp.row,
                           "members": list(sp.members)})
    host = None
    if st.host is not None:
        host = {"capacity": st.host.capacity, "live_bytes": st.host.live_bytes,
                "free_bytes": st.host.free_bytes, "extents": len(st.host.live),
                "pending_transfers": len(st.host_pending)}
    return {"record": st.seq, "digest": digest(st), "pools": pools, "host_arena": host,
            "address_spaces": spaces}


def page_descriptor(st: StoreState, pool: str, slot: int) -> dict[str, Any] | None:
    p = st.pools.get(pool)
    pg = p.pages[slot] if p is not None and 0 <= slot < len(p.pages) else None
    if pg is None:
        return None
    return {"pool": pool, "slot": pg.slot, "generation": pg.gen, "epoch": pg.epoch,
            "committed_columns": pg.committed, "protected_columns": pg.protected,
            "refs": pg.refs, "active_refs": pg.active_refs, "writer": pg.writer,
            "device_page": pg.device, "pins": pg.pins,
            "host": None if pg.host is None else dict(zip(
                ("offset", "epoch", "coverage", "crc32c"), pg.host, strict=True)),
            "members_of": [b for b, sp in p.spaces.items() if slot in sp.members]}


MAX_ROWS = 200    # address spaces ``inspect`` prints (``--json`` prints all)
MAX_FIELD = 100   # characters of one history row's fields


def clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters, marked with an ellipsis when cut: a table never
    shows part of a value as if it were all of it."""
    return text if len(text) <= n else text[:n - 1] + "…"


def run_inspect(a: argparse.Namespace, console: Console) -> int:
    page = None
    if a.page:
        pool, _, slot = a.page.partition(":")
        if not (slot.isascii() and slot.isdigit()):  # isdigit() alone takes "³", int() not
            raise InvalidArgument(f"--page wants POOL:SLOT (e.g. main:12), got {a.page!r}")
        page = (pool, int(slot))
    st, history, cuts = state_at(a.dir, a.at, page, a.from_snapshot)
    if page is not None and page[0] not in st.pools:
        raise UnknownHandle(f"--page {a.page}: pool {page[0]!r} is not in this journal "
                            f"(pools: {', '.join(st.pools)})")
    if a.seq is not None and not any(a.seq in p.spaces for p in st.pools.values()):
        raise UnknownHandle(f"--seq {a.seq}: no address space after record {st.seq} (never "
                            "made, or finished without retention, or released)")
    out = describe(st, a.seq)
    out["cuts"] = cuts
    if page is not None:
        out["page"] = page_descriptor(st, *page)
        out["page_history"] = history
        used = st.pools[page[0]].n_slots  # slots below it have held a page at some time
        if out["page"] is None and not history and page[1] >= used:
            raise UnknownHandle(f"--page {a.page}: no page ever used slot {page[1]} of pool "
                                f"{page[0]!r} up to record {st.seq} ({used} slots used)")
    if a.json:
        emit_json(out)
        return 0
    console.print(f"state after record {out['record']} — digest {out['digest']}")
    for c in cuts:
        console.print(f"[yellow]the journal ends early[/yellow]: {c}")
    t = Table(title="pools (page groups)")
    for col in ("pool", "capacity", "allocated", "reserved", "available", "rows_leased",
                "live_pages"):
        t.add_column(col, justify="left" if col == "pool" else "right")
    for name, d in out["pools"].items():
        t.add_row(name, *(str(d[k]) for k in ("capacity", "allocated", "reserved", "available",
                                               "rows_leased", "live_pages")))
    console.print(t)
    if out["host_arena"]:
        h = out["host_arena"]
        console.print(f"host arena: {h['live_bytes']:,} B live in {h['extents']} extents, "
                      f"{h['free_bytes']:,} B free of {h['capacity']:,} B, "
                      f"{h['pending_transfers']} transfers in flight")
    spaces = out["address_spaces"]
    t = Table(title="address spaces", caption=None if len(spaces) <= MAX_ROWS else
              f"the first {MAX_ROWS} of {len(spaces)} shown (--seq N picks one; --json: all)")
    for col in ("seq", "pool", "state", "committed", "provisional", "protected", "entitlement",
                "pages", "row"):
        t.add_column(col)
    for s in spaces[:MAX_ROWS]:
        t.add_row(str(s["seq"]), s["pool"], "active" if s["active"] else "checkpoint",
                  str(s["committed"]), str(s["provisional"]), str(s["protected"]),
                  str(s["entitlement"]), str(s["pages"]), str(s["row"]))
    console.print(t)
    if page is not None:
        console.print(f"page {a.page}: {out['page'] or 'not live at this record'}")
        t = Table(title=f"history of page {a.page}")
        t.add_column("record")
        t.add_column("event")
        t.add_column("fields")
        for h in history:
            fields = {k: v for k, v in h.items() if k not in ("record", "event_index", "type")}
            t.add_row(str(h["record"]), h["type"], clip(str(fields), MAX_FIELD))
        console.print(t)
    return 0


# --- dump ---------------------------------------------------------------------------------------
def run_dump(a: argparse.Namespace, console: Console) -> int:
    reader = JournalReader(a.dir, from_snapshot=a.from_snapshot)
    first, last = reader.scan.first_seq, reader.last_seq
    # as replay --until and inspect --at; last + 1 is the empty tail a poller asks for next
    if a.from_seq and not first <= a.from_seq <= last + 1:
        raise InvalidArgument(f"--from {a.from_seq}: the records read are {first}..{last}"
                              + (" (the ones before were compacted, or --from-snapshot skips "
                                 "them)" if a.from_seq < first else ""))
    reader.export_ndjson(sys.stdout.buffer, a.from_seq)
    sys.stdout.flush()
    return 0


# --- events (router KV-event stream) --------------------------------------------------------
def block_hash(pool: str, slot: int, gen: int) -> str:
    return f"{pool}:{slot}@{gen}"


def kv_events(directory: str, from_snapshot: bool = False) -> Iterator[dict[str, Any]]:
    """vLLM-shaped KV events derived from the journal. A block (a page, named by pool, slot and
    generation) is *stored* on a medium while an inactive checkpoint holds it there: on the GPU
    with a device replica, on the CPU with a valid host replica (§5.1). Each event's effect on
    the pages it names is diffed: BlockStored for what became stored, BlockRemoved (with the
    reason the journal knows) for what stopped being; AllBlocksCleared(GPU) on a restart. The
    stream is balanced: a block is removed from a medium only after it was stored there, and
    stored again only after it was removed (``told`` is what the router has been told)."""
    reader = JournalReader(directory, from_snapshot=from_snapshot)
    st, start = replay_start(reader)
    told: dict[str, set[str]] = {"GPU": set(), "CPU": set()}
    for seq, events in reader.records(start):
        for i, e in enumerate(events):
            with applying(seq, i, e):
                yield from _event_items(st, seq, e, told)


QUIET = (ev.Configure, ev.HostConfigure, ev.Activate, ev.PublishActive, ev.SetMetadata,
         ev.Materialize, ev.CommitFrontiers, ev.ProvisionalFrontiers, ev.Grow, ev.CopyTail,
         ev.HostReserve, ev.HostAbort)
"""Events that never change which pages an inactive checkpoint holds, nor their replicas."""


def _touched(st: StoreState, e: Any) -> dict[tuple[str, int], None]:
    """The pages an event can store or remove, in order: every page of every pool on a
    restart, else the members of the sequences or checkpoints it names and the slots it
    lists."""
    if isinstance(e, ev.Recovered):
        return {(n, pg.slot): None for n, p in st.pools.items() for pg in p.pages
                if pg is not None}
    pool = st.pools.get(getattr(e, "pool", ""))
    if pool is None:
        return {}
    out: dict[tuple[str, int], None] = {}
    for attr in ("src", "bundle", "dst"):
        sp = pool.spaces.get(getattr(e, attr, None))  # type: ignore[arg-type]
        if sp is not None:
            out.update(((pool.name, int(x)), None) for x in sp.members)
    slots = getattr(e, "slots", None)
    if isinstance(slots, bytes):
        out.update(((pool.name, int(x)), None) for x in ev.unpack(slots).tolist())
    return out


def _stored(st: StoreState, keys: dict[tuple[str, int], None]
            ) -> dict[tuple[str, str], int]:
    """(medium, block hash) -> committed tokens, of the pages among ``keys`` that an
    inactive checkpoint holds: on the GPU with a device replica, on the CPU with a valid
    host replica."""
    out: dict[tuple[str, str], int] = {}
    for name, slot in keys:
        pages = st.pools[name].pages
        pg = pages[slot] if slot < len(pages) else None
        if pg is None or pg.refs - pg.active_refs <= 0:
            continue
        h = block_hash(name, slot, pg.gen)
        if pg.device != NO_PAGE:
            out[("GPU", h)] = pg.committed
        if replica_valid(pg, pg.committed):
            out[("CPU", h)] = pg.committed
    return out


def _event_items(st: StoreState, seq: int, e: Any, told: dict[str, set[str]]
                 ) -> Iterator[dict[str, Any]]:
    """The KV events one journal event produces; applies it to ``st``."""
    if isinstance(e, QUIET):
        apply(st, e)
        return
    keys = _touched(st, e)
    before = _stored(st, keys)
    apply(st, e)
    keys.update(_touched(st, e))
    after = _stored(st, keys)
    if isinstance(e, ev.Recovered):  # device contents never survive a restart
        told["GPU"].clear()
        yield {"record": seq, "type": "AllBlocksCleared", "medium": "GPU", "reason": "restart"}
    reason = _removal_reason(e)
    for medium in ("GPU", "CPU"):
        gone = [h for m, h in before if m == medium and (m, h) not in after and h in told[m]]
        if gone:
            told[medium].difference_update(gone)
            yield {"record": seq, "type": "BlockRemoved", "medium": medium, "reason": reason,
                   "block_hashes": gone}
        new = [(h, n) for (m, h), n in after.items() if m == medium and h not in told[m]]
        if new:
            told[medium].update(h for h, _ in new)
            yield {"record": seq, "type": "BlockStored", "medium": medium,
                   "block_hashes": [h for h, _ in new], "parent_block_hash": None,
                   "block_size": P, "token_count": sum(n for _, n in new)}


def _removal_reason(e: Any) -> str:
    if isinstance(e, ev.Release):
        return "evicted"  # the caller's retention policy released the checkpoint
    if isinstance(e, ev.Finish):
        return "aborted-restart" if e.reason.startswith("abort") else "finished"
    if isinstance(e, ev.Move):
        return "moved-to-active"  # an exclusive continuation took the checkpoint's pages
    if isinstance(e, ev.DeviceDrop):
        return "demoted-to-host"
    if isinstance(e, ev.HostDrop):
        return "host-dropped"
    if isinstance(e, ev.Recovered):
        return "restart"
    return type(e).__name__.lower()


def run_events(a: argparse.Namespace, console: Console) -> int:
    stream = kv_events(a.dir, a.from_snapshot)
    if a.json:
        for item in stream:
            emit_json(item)
        return 0
    t = Table(title="KV events")
    for col in ("record", "type", "medium", "reason", "blocks"):
        t.add_column(col)
    for item in stream:
        t.add_row(str(item["record"]), item["type"], item.get("medium", ""),
                  item.get("reason", "") or "", str(len(item.get("block_hashes", []))))
    console.print(t)
    return 0
