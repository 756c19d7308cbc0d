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

import numpy as np

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import P, PoolKind
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
    """One call per decode round; array operations over the active sequences of each pool
    (bundle order, so the pool's availability is granted first come, first served)."""
    step_tokens = as_int("step_tokens", step_tokens, lo=1)
    cfg = store.config
    st = store.state
    res = GrowResult()
    lead_mtp = cfg.serving.draft_window - 1
    events = []
    covers: dict[int, int] = {}
    ids = budget = None
    for name in store.pools:
        pool = st.pools[name]
        if ids is None:  # the active bundles, ascending (every pool holds a space of each)
            bi = pool.bundle_index
            ids = np.flatnonzero(bi >= 0)
            ids = ids[pool.sp_active[bi[ids]]]
            budget = np.fromiter((st.bundles[b].budget or store.plan.S for b in ids.tolist()),
                                 np.int64, len(ids))
        idx = pool.bundle_index[ids]
        lead = lead_mtp if name == PoolKind.MTP.value else 0
        committed, ent = pool.sp_committed[idx], pool.sp_entitlement[idx]
        # the window tops up at least the step about to launch (a window shorter than a
        # speculative step would otherwise never cover it, however free the pool)
        window = max(cfg.lease_window, step_tokens)
        target = np.minimum(budget, committed + window + cfg.lease_cushion) + lead
        want = np.maximum(np.minimum(pool.logical_pages, -(-target // P)) - ent, 0)
        before = np.cumsum(want) - want          # granted to earlier sequences, if all fit
        got = np.clip(pool.available - before, 0, want)
        ent = ent + got
        # §6.2: the cushion is held back — the step about to launch plus one forced control
        # span must already be covered, not merely the step
        need = np.minimum(np.minimum(budget, committed + step_tokens + cfg.lease_cushion) + lead,
                          pool.logical_pages * P)  # nothing is entitled past L pages
        short = -(-need // P) > ent               # the step and its cushion would not fit
        if short.any():  # what a retry needs: earlier sequences take their whole window first
            left = want - got
            ahead = np.cumsum(left) - left
            deficit = -(-need // P) - ent
            res.short[name] = int((ahead + deficit)[short].max() - (pool.available - got.sum()))
        for b, c in zip(ids[short].tolist(), np.maximum(committed, ent * P - lead)[short].tolist(),
                        strict=True):
            covers[b] = min(covers.get(b, 1 << 62), c)
        if got.any():
            events.append(ev.Grow(name, pack(ids[got > 0]), pack(got[got > 0])))
            res.granted[name] = int(got.sum())
    if events:
        store._emit(*events)
    res.exhausted = covers
    return res
