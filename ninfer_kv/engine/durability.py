"""Which records change what a reopen keeps (README, "Durability contract"): under
``sync="commit"`` those are fsynced before the boundary returns, and a standby acknowledges
them; a decode round's records are not (active sequences are aborted by a reopen)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_kv.engine import state
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.log import SyncPolicy

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn

SURVIVAL_EVENTS = (ev.Configure, ev.HostConfigure, ev.Recovered, ev.Finish, ev.Release,
                   ev.Move, ev.Share, ev.Prefix, ev.HostPublish, ev.HostAbort, ev.HostDrop,
                   ev.SetMetadata)
"""Events that change what a reopen keeps: the configuration, which checkpoints exist, their
metadata and which host replicas they have. Every other event touches only active sequences, which a
reopen aborts, or device state, which never survives (README, "Durability contract")."""


_SURVIVAL_TYPES = frozenset(SURVIVAL_EVENTS)  # event structs are final: no subclasses


def changes_what_survives(events: list[Any], st: StoreState) -> bool:
    """Whether a record must be fsynced under ``sync="commit"`` (and a standby must
    acknowledge it), given ``st``, the state after the record: it holds a ``SURVIVAL_EVENTS``
    event that changes what a reopen keeps. Not one: a ``Finish`` that retains nothing; a
    ``SetMetadata`` of a sequence still active after the record (a reopen aborts it; the
    record that retains it is durable and covers this one, the log being sequential); the
    ``Share`` and ``Release`` of a checkpoint this same record made and released (``fork_live``'s
    transient checkpoint)."""
    made: set[int] | None = None
    for e in events:
        t = type(e)
        if t not in _SURVIVAL_TYPES:
            continue
        if t is ev.Finish:
            if e.retain:
                return True
        elif t is ev.SetMetadata:
            b = st.bundles.get(e.bundle)
            if b is None or not b.active:
                return True
        elif t is ev.Share or t is ev.Release:
            if made is None:  # checkpoints this record made
                made = {x.dst for x in events if type(x) is ev.Share}
            ck = e.dst if t is ev.Share else e.bundle
            if ck not in made or ck in st.bundles:  # an older one, or one that outlives it
                return True
        else:
            return True
    return False


def settle_ids(store: Txn, seq: int) -> None:
    """After record ``seq`` was written: ``store._ids_durable`` becomes the next id once a
    durable record holds every id handed out — this one, or it after an fsync made because
    the ids since the last such record passed ``ID_GAP // 2`` (at most one fsync per 32k
    ids); without a journal, or with ``sync="off"`` (which promises nothing across a power
    loss), every written record counts. Then ``ids_window``."""
    journal, st = store.journal, store.state
    if journal is None or journal.options.sync is SyncPolicy.OFF:
        store._ids_durable = st.next_bundle
    else:
        if st.next_bundle - store._ids_durable > state.ID_GAP // 2 and journal.durable_seq < seq:
            journal.sync()
        if journal.durable_seq >= seq:
            store._ids_durable = st.next_bundle
    ids_window(store)


def ids_window(store: Txn, acked: int | None = None) -> None:
    """``store._ids_base``, where ``state.new_ids`` counts the window from: the next id as of
    the last durable record, or — once a ``Leader`` has standbys (``acked``: the next id they
    last acknowledged; kept after the stream stops, since one may be promoted) — the lower of
    that and the next id they hold."""
    if acked is not None:
        store._ids_acked = acked
    a = store._ids_acked
    store._ids_base = store._ids_durable if a is None else min(store._ids_durable, a)
