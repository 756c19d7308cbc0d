"""What a reopened store keeps (spec §5.3, DESIGN "Device, host, persistence").

Device contents never survive a restart. Pins of device copies that never ran are released;
unpublished host destinations and active sequences are aborted; an inactive checkpoint is
kept only when every page has a published, epoch-matching host replica whose bytes still
match their CRC; the device replicas of what is kept are dropped. The report (structlog and
``store.recovery``) says what was kept, what was dropped and why. All of it is ordinary
events, journaled as one record that starts with a ``Recovered`` marker.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import structlog

from ninfer_kv.engine import continuation, host, state
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.state import MAX_BUNDLE
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn

log = structlog.get_logger(__name__)


def recover_cleanup(store: Txn) -> None:
    """Device contents do not survive a restart. Abort unpublished host destinations and
    active sequences; keep an inactive checkpoint only when every page has a published,
    epoch-matching host replica whose bytes still match their checksum; drop the device
    replicas of what is kept. Report what was kept and dropped, and why."""
    rep = store.recovery
    st = store.state
    pinned: dict[str, list[int]] = {}  # copies queued before the crash never ran: unpin
    for (pool, slot), n in sorted(st.copy_pins.items()):
        pinned.setdefault(pool, []).extend([slot] * n)
    store._emit(*(ev.Unpin(pool, pack(slots)) for pool, slots in pinned.items()))
    for off, (pool, _, _) in sorted(st.host_pending.items()):
        store._emit(ev.HostAbort(pool, off))
    for bid, b in sorted(st.bundles.items()):
        if b.active:
            for pool in b.pools:
                row = st.pools[pool].spaces[bid].row
                store._emit(ev.Finish(bid, pool, False, "abort:restart"))
                store._free_row(pool, row)
            rep.dropped[bid] = "active at crash"
    for bid in sorted(b for b, x in st.bundles.items() if not x.active):
        reason = continuation.unrecoverable_reason(st, bid)
        if reason is None:
            reason = host.verify_checkpoint(store, bid)
        if reason is None:
            rep.kept.append(bid)
        else:
            store._emit(*(ev.Release(bid, pool) for pool in st.bundles[bid].pools))
            rep.dropped[bid] = reason
    for name, pool in st.pools.items():
        stale = [pg.slot for pg in pool.pages if pg is not None and pg.device != NO_PAGE]
        if stale:
            store._emit(ev.DeviceDrop(name, pack(stale)))
    # the marker goes first in the record: applied last, moved first, which is exact as its
    # one change is to a field no event of the record reads: the next id, past every id
    # handed out before — those in the log, those below the last reopen's first (NEXT_ID:
    # a cut may have taken its record), those of records lost since the last durable one
    # (ID_GAP: the store keeps them within it) and those of records cut (one byte each)
    store._emit(ev.Recovered(rep.records, pack(rep.kept), pack(sorted(rep.dropped)),
                             min(max(st.next_bundle, rep.id_floor) + state.ID_GAP
                                 + rep.cut_bytes, MAX_BUNDLE + 1)))
    store._pending.insert(0, store._pending.pop())
    log_dropped(rep.dropped)
    log.info("store.recovered", records=rep.records, kept=rep.kept,
             dropped=len(rep.dropped), cuts=rep.cuts)


def log_dropped(dropped: dict[int, str], shown: int = 8) -> None:
    """One warning for the checkpoints a recovery dropped: how many, the first ``shown`` ids
    and the commonest reasons with their counts (a store without a host tier drops every
    retained checkpoint, thousands of lines otherwise); each one at debug level. The full
    list is ``store.recovery.dropped``."""
    if not dropped:
        return
    for bid, why in dropped.items():
        log.debug("store.recovery_dropped_checkpoint", checkpoint=bid, reason=why)
    reasons = Counter(dropped.values()).most_common(3)
    log.warning("store.recovery_dropped", count=len(dropped), checkpoints=list(dropped)[:shown],
                reasons={why: n for why, n in reasons},
                more_reasons=len(set(dropped.values())) - len(reasons))
