"""kv_lease_growth (spec §6.2, §14): the entitlement is a bounded window that grows only at
decode-round boundaries, and bounded completion when the pool cannot extend it.

``grow`` extends each active space toward ``committed + window + cushion`` (never past the
sequence's prompt+output budget, plus MTP's lead), granting what the pool has available in
sequence order. A sequence whose entitlement cannot cover its next step *and* the cushion in
some pool is reported as *exhausted*: the caller ends it with finish reason ``length`` at the
frontier its window covers (ordinary decode never eats into the cushion). The step about to
launch is therefore always covered — a shortfall never surfaces as an exception mid-launch —
and nothing is ever materialized past an entitlement.
The store never picks victims; it only says who cannot continue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import P, PoolKind, ceil_div
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


@dataclass(slots=True)
class GrowResult:
    granted: dict[str, int] = field(default_factory=dict)
    """Pages added to entitlements, per pool."""
    exhausted: dict[int, int] = field(default_factory=dict)
    """seq -> token frontier its entitlement covers; end these with reason ``length``."""


def grow(store: Txn, step_tokens: int = 1) -> GrowResult:
    step_tokens = as_int("step_tokens", step_tokens, lo=1)
    cfg = store.config
    st = store.state
    res = GrowResult()
    lead_mtp = cfg.serving.draft_window - 1
    active = sorted(b for b, x in st.bundles.items() if x.active)
    events = []
    covers: dict[int, int] = {}
    for name in store.pools:
        pool = st.pools[name]
        lead = lead_mtp if name == PoolKind.MTP.value else 0
        available = pool.available
        ids: list[int] = []
        adds: list[int] = []
        for b in active:
            sp = pool.spaces[b]
            budget = st.bundles[b].budget or store.plan.S
            target = min(budget, sp.committed + cfg.lease_window + cfg.lease_cushion) + lead
            want = min(pool.logical_pages, ceil_div(target, P)) - sp.entitlement
            got = max(0, min(want, available))
            if got:
                ids.append(b)
                adds.append(got)
                available -= got
            ent = sp.entitlement + got
            # §6.2: the cushion is held back — the step about to launch plus one forced
            # control span must already be covered, not merely the step
            need = min(min(budget, sp.committed + step_tokens + cfg.lease_cushion) + lead,
                       pool.logical_pages * P)  # nothing is entitled past L pages
            if ceil_div(need, P) > ent:  # the step and its cushion would not be covered
                covers[b] = min(covers.get(b, 1 << 62), max(sp.committed, ent * P - lead))
        if ids:
            events.append(ev.Grow(name, pack(ids), pack(adds)))
            res.granted[name] = sum(adds)
    if events:
        store._emit(*events)
    res.exhausted = covers
    return res
