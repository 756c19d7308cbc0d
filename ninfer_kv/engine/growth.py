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

from ninfer_kv.engine import round_kernels as rk
from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import PoolKind
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
    short: dict[str, int] = field(default_factory=dict)
    """Pages each pool lacks for its exhausted sequences' next step and cushion, counting the
    window pages a retry grants earlier sequences first: free that many there (evict a cached
    prefix) and a retry of ``grow`` with the same step exhausts none."""


def grow(store: Txn, step_tokens: int = 1) -> GrowResult:
    """One call per decode round; one compiled pass over the active sequences of each pool
    (``round_kernels.grow_pool``, in bundle order, so the pool's availability is granted first
    come, first served)."""
    step_tokens = as_int("step_tokens", step_tokens, lo=1, hi=store.plan.S)  # one step <= S
    cfg = store.config
    st = store.state
    res = GrowResult()
    lead_mtp = cfg.serving.draft_window - 1
    # the window tops up at least the step about to launch (a window shorter than a
    # speculative step would otherwise never cover it, however free the pool); §6.2: the
    # cushion is held back — the step plus one forced control span must already be covered
    window = max(cfg.lease_window, step_tokens)
    events = []
    covers: dict[int, int] = {}
    ids = None
    for name in store.pools:
        pool = st.pools[name]
        if ids is None:  # the active bundles, ascending (every pool holds a space of each)
            ids = rk.active_bundles(pool.sp_active, pool.sp_bundle)
        lead = lead_mtp if name == PoolKind.MTP.value else 0
        got, cover, granted, short, n_short = rk.grow_pool(
            ids, pool.bundle_index, pool.sp_committed, pool.sp_entitlement, pool.sp_budget,
            store.plan.S, pool.logical_pages, window, cfg.lease_cushion, step_tokens, lead,
            pool.available)
        if n_short:
            res.short[name] = short
            exhausted = cover >= 0
            for b, c in zip(ids[exhausted].tolist(), cover[exhausted].tolist(), strict=True):
                covers[b] = min(covers.get(b, 1 << 62), c)
        if granted:
            sel = got > 0
            events.append(ev.Grow(name, pack(ids[sel]), pack(got[sel])))
            res.granted[name] = granted
    if events:
        store._emit(*events)
    res.exhausted = covers
    return res
