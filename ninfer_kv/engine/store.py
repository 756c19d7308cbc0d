"""KVStore: the commands an engine calls around every GPU unit (spec §6-§8, §12-§14).

Each command validates everything first and raises a typed ``KVStoreError`` before emitting
anything; then it emits events, which ``apply`` applies to the host state at once and which
queue for the next boundary. ``boundary()`` appends the queued events as ONE journal record,
runs the device effects (copies, then one table-slice write per touched row) and freezes
tables, memberships and frontiers until the unit is declared complete (spec §8.4).

Typical step::

    store.ensure_mapped_many("main", seqs, tokens)   # before launch (§8.1)
    with store.boundary():                            # journal + table publication
        launch(...)                                   # GPU unit reads frozen tables
    store.commit_many("main", seqs, frontiers)        # after the unit succeeded
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import structlog
import torch

from ninfer_kv.engine import checked, continuation, decode, growth, host, info, termination
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.args import as_bool, as_int, as_ints, metadata_room, one_pair, token_budget
from ninfer_kv.engine.command import command
from ninfer_kv.engine.config import InvariantViolation, RecoveryReport, StoreConfig
from ninfer_kv.engine.core import StoreCore
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.layout import P, PoolKind, Profile
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage, PageHandle
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import digest, new_ids
from ninfer_kv.engine.views import PagedKVBatchLayerView, PagedKVLayerView
from ninfer_kv.errors import (
    CapacityExhausted,
    InvalidArgument,
    StaleHandle,
    StoreClosed,
    UnknownHandle,
)
from ninfer_kv.journal import events as ev

log = structlog.get_logger(__name__)


_MTP = PoolKind.MTP.value


class KVStore(StoreCore):
    """The storage engine. Open with :meth:`open`; not thread-safe (one engine loop).

    Lifecycle: open -> (commands, boundaries)* -> close. After ``close()`` every command, the
    boundary and the views into device memory raise ``StoreClosed``; the queries still answer
    from the final in-memory state (no I/O: the journal and its lock are released, so another
    process may have changed the store since). After any failed write, fsync, msync, device
    effect or apply — or an exception escaping a command after it changed the state
    (``core.command``) — the store is *failed* (fail-stop, like PostgreSQL's fsync PANIC):
    every later mutating call raises ``StoreFailed`` until it is reopened from the journal."""

    # --- lookups ------------------------------------------------------------------------------
    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self.state.pools)

    def _pool(self, pool: str | PoolKind) -> PoolState:
        name = pool.value if isinstance(pool, PoolKind) else pool
        p = self.state.pools.get(name) if isinstance(name, str) else None
        if p is None:
            raise UnknownHandle(f"pool {pool!r} is not enabled; pools: {self.pools}")
        return p

    def _space(self, bundle: int, pool: str | PoolKind, *, active: bool = False
               ) -> KVAddressSpace:
        return decode.lookup(self._pool(pool), as_int("seq", bundle), active=active)

    def space(self, bundle: int, pool: str | PoolKind = PoolKind.MAIN) -> KVAddressSpace:
        """Read-only access for callers and tests (do not mutate)."""
        return self._space(bundle, pool)

    def page(self, handle: PageHandle) -> LogicalKVPage:
        if not isinstance(handle, PageHandle):
            raise InvalidArgument(f"{handle!r} is not a PageHandle")
        as_int("handle.slot", handle.slot)
        as_int("handle.gen", handle.gen)
        p = self._pool(handle.pool)
        pg = p.pages[handle.slot] if 0 <= handle.slot < len(p.pages) else None
        if pg is None or pg.gen != handle.gen:
            cur = p.gens[handle.slot] if 0 <= handle.slot < len(p.gens) else None
            raise StaleHandle(f"page handle {handle} is stale: slot generation is now {cur} "
                              "(the page was released and its slot recycled, §5.1)")
        return pg

    def handles(self, bundle: int, pool: str | PoolKind = PoolKind.MAIN) -> list[PageHandle]:
        p = self._pool(pool)
        return [PageHandle(p.name, s, p.gens[s]) for s in self._space(bundle, pool).members]

    # --- activation from root (§6.2, §7.3) -----------------------------------------------------
    def entitlement_pages(self, pool: str, frontier: int, budget: int) -> int:
        """Pages to entitle for a space at ``frontier`` with a prompt+output ``budget``: the whole
        budget by default; with kv_lease_growth only frontier + window + cushion (§6.2). The MTP
        pool adds its provisional lead of K-1 tokens (§3.3)."""
        if type(frontier) is not int or type(budget) is not int or frontier < 0 or budget < 0:
            frontier, budget = as_int("frontier", frontier, lo=0), as_int("budget", budget, lo=0)
        if type(pool) is not str or pool not in self.state.pools:  # PoolKind: its name; a
            pool = self._pool(pool).name                             # pool it lacks: refused
        cfg = self.config
        tokens = budget
        if cfg.lease_growth:
            tokens = min(budget, frontier + cfg.lease_window + cfg.lease_cushion)
        if pool == _MTP:
            tokens += cfg.serving.draft_window - 1
        return min(self.state.pools[pool].logical_pages, -(-tokens // P))  # L, ceil(tokens/P)

    @command
    def activate(self, prompt_tokens: int, max_output_tokens: int) -> int:
        """Activate a new sequence from root; returns its id (the bundle id)."""
        self._usable("activate")
        prompt_tokens, max_output_tokens, total = token_budget(prompt_tokens,
                                                               max_output_tokens, self.plan.S)
        # ids before capacity: an engine that evicts on CapacityExhausted and retries would
        # evict for nothing once the ids are gone
        bundle = new_ids(self.state, 1, self._ids_base)
        plan = {p: self.entitlement_pages(p, prompt_tokens, total) for p in self.pools}
        self._check_capacity(plan)
        events = [ev.Activate(bundle, p, n, self.state.pools[p].free_rows.first(), total,
                              prompt_tokens)
                  for p, n in plan.items()]
        self._emit(*events, ev.PublishActive(bundle))
        for p in plan:
            self._touch(p, bundle, 0)  # the leased row is published whole: no stale entries
        return bundle

    @command
    def grow(self, step_tokens: int = 1) -> growth.GrowResult:
        """kv_lease_growth at a decode-round boundary (engine/growth.py)."""
        self._usable("grow")
        return growth.grow(self, step_tokens)

    def _check_capacity(self, pages: dict[str, int]) -> None:
        for name, n in pages.items():
            if self.fault_hook:
                self.fault_hook("reserve", name)
            p = self.state.pools[name]
            if n > p.available:
                raise CapacityExhausted(f"pool {name}: need {n} pages, {p.available} available "
                                        f"(allocated {p.allocated}, reserved {p.reserved}, "
                                        f"capacity {p.capacity})", pool=name,
                                        short=n - p.available)
            if not p.free_rows:
                raise CapacityExhausted(f"pool {name}: all {p.rows} execution rows are leased "
                                        f"(max_concurrency C={p.rows})", pool=name)

    # --- mapping (§8.1) -------------------------------------------------------------------------
    @command
    def ensure_mapped(self, bundle: int, pool: str | PoolKind, tokens: int) -> int:
        """``ensure_mapped_to_tokens``: a lower bound. Returns the pages materialized."""
        b, t = one_pair("seq", bundle, "tokens", tokens)  # arguments first, as commit checks
        self._usable("ensure_mapped")
        return decode.ensure_mapped_many(self, self._pool(pool), b, t)

    @command
    def ensure_mapped_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                           tokens: Sequence[int] | np.ndarray) -> int:
        """Step 1 of a decode round (engine/decode.py). Returns the pages materialized."""
        self._usable("ensure_mapped")
        return decode.ensure_mapped_many(self, self._pool(pool), bundles, tokens)

    # --- frontiers (§8.1, §8.2) ------------------------------------------------------------------
    def commit(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        self.commit_many(pool, *one_pair("seq", bundle, "frontier", frontier))

    @command
    def commit_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                    frontiers: Sequence[int] | np.ndarray) -> None:
        """Step 3 of a decode round (engine/decode.py): advance committed frontiers after the
        unit succeeded; one event for the batch."""
        self._usable("commit")
        decode.commit_many(self, self._pool(pool), bundles, frontiers)

    def set_provisional(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        self.set_provisional_many(pool, [as_int("seq", bundle)], [as_int("frontier", frontier)])

    @command
    def set_provisional_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                             frontiers: Sequence[int] | np.ndarray) -> None:
        self._usable("set_provisional")
        decode.set_provisional_many(self, self._pool(pool), bundles, frontiers)

    @command
    def trim(self, bundle: int, pool: str | PoolKind) -> int:
        """Unmap trailing pages: NeededPages = ceil(max(committed, provisional) / P) (§8.2).
        Returns the pages unmapped; their leases go back to this space's reservation."""
        self._usable("trim")
        return termination.trim(self, self._pool(pool), self._space(bundle, pool, active=True))

    def truncate(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        """Move the committed frontier back (not below the protected frontier), then trim."""
        self._usable("truncate")  # first, as every command: a closed store says so
        self.truncate_many(pool, [as_int("seq", bundle)], [as_int("frontier", frontier)])

    @command
    def truncate_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                      frontiers: Sequence[int] | np.ndarray) -> None:
        """``truncate`` of each sequence, all or none (engine/termination.py)."""
        self._usable("truncate")
        termination.truncate_many(self, self._pool(pool), bundles, frontiers)

    # --- termination (§8.3) -----------------------------------------------------------------------
    @command
    def finish(self, bundle: int, retain: bool = False, reason: str = "stop") -> int | None:
        """Leave execution; retain an immutable checkpoint (returns its id) or release all."""
        self._usable("finish")
        return termination.finish(self, as_int("seq", bundle), retain, reason)

    @command
    def share_prefix(self, bundle: int, frontier: int | None = None) -> int:
        """Publish the first ``frontier`` tokens of running sequence ``bundle`` — whole pages
        only: ``frontier // P`` of them, default its committed frontier — as a new inactive
        checkpoint (returned), without finishing it. Other requests continue from it
        (``activate_from``, a Fork) while the owner keeps decoding above it; the shared pages
        are immutable from now on and the owner may not truncate below them (§9.2, §9.4)."""
        self._usable("share_prefix")
        return continuation.share_prefix(self, bundle, frontier)

    @command
    def fork_live(self, bundle: int, max_output_tokens: int,
                  frontier: int | dict[str, int] | None = None) -> int:
        """A new active sequence continuing running sequence ``bundle`` at token ``frontier``
        (default: its committed frontier; a dict gives each pool its own, e.g. a DFlash draft
        pool lagging the main one) — n>1 sampling, beam search. Whole pages are shared, the
        partial tail is COW-copied from the owner's page at the next boundary (§9.2-9.3).
        The shared whole pages stay immutable for the owner's life, as after ``share_prefix``:
        it may not truncate below the fork's last whole page even once every sharer is gone.
        Returns the new sequence's id."""
        self._usable("fork_live")
        return continuation.fork_live(self, bundle, frontier, max_output_tokens)

    @command
    def release(self, checkpoint: int) -> None:
        """Drop a checkpoint's references; leases free with their last reference (§8.3). A
        page a queued copy still reads stays pinned until the boundary has run the copy."""
        self._usable("release")
        termination.release(self, as_int("checkpoint", checkpoint))

    @command
    def release_tail(self, checkpoint: int, frontier: int | dict[str, int]) -> int | None:
        """Give up the pages of inactive ``checkpoint`` above its first ``frontier // P``
        whole pages (``frontier``: one int, or one per pool): a new checkpoint holds those
        (returned; ``None`` when no pool keeps a whole page) and ``checkpoint`` is released,
        in one record. A page frees with its last reference (§8.3); the prefix stays
        continuable — vLLM frees a cached request's blocks tail first for the same reason.
        Metadata is not carried over (``set_metadata``)."""
        self._usable("release_tail")
        return continuation.release_tail(self, checkpoint, frontier)

    # --- engine metadata and read-only answers (engine/info.py) -----------------------------
    @command
    def set_metadata(self, bundle: int, metadata: Any) -> None:
        """Attach ``metadata`` (anything msgpack can encode: token ids, a model tag, ...; at
        most ``METADATA_MAX`` bytes encoded) to an active sequence or a checkpoint; ``None``
        clears it. Journaled: it survives a restart with the checkpoint, and
        ``checkpoint_info(ck).metadata`` returns it."""
        self._usable("set_metadata")
        bundle = as_int("seq", bundle)
        if bundle not in self.state.bundles:
            raise UnknownHandle(f"{bundle} is neither an active sequence nor a checkpoint")
        try:  # what checkpoint_info must decode again: a struct-keyed map encodes, but not back
            data = b"" if metadata is None else msgspec.msgpack.encode(metadata)
            if data:
                msgspec.msgpack.decode(data)
        except (TypeError, ValueError, OverflowError, RecursionError, msgspec.MsgspecError
                ) as exc:
            raise InvalidArgument(f"set_metadata({bundle}): metadata must be msgpack-encodable "
                                  "and decodable again (dict, list, str, bytes, int, float, "
                                  f"bool, None): {type(exc).__name__}: {exc}") from None
        metadata_room(f"set_metadata({bundle})", self._pending, len(data))
        self._emit(ev.SetMetadata(bundle, data))

    def checkpoint_info(self, bundle: int, *, metadata: bool = True) -> info.CheckpointInfo:
        """Frontier, residency per pool (device/host pages and bytes), whether it survives a
        restart, and its metadata (``metadata=False``: not decoded, None) — for an active
        sequence or a checkpoint."""
        return info.checkpoint_info(self, as_int("checkpoint", bundle),
                                    as_bool("checkpoint_info: metadata", metadata))

    def sole_device_pages(self, bundle: int, now: bool = False) -> int:
        """Device pages only ``bundle`` references, over its pools: what releasing it frees;
        ``now``: at once (``checkpoint_info``'s ``sole_device_pages[_now]``)."""
        return info.sole_device_pages(self, as_int("checkpoint", bundle), as_bool("now", now))

    def reclaimable(self, bundles: Sequence[int], now: bool = False) -> dict[int, int]:
        """Per bundle: its device pages only ``bundles`` reference — what releasing all of
        them frees of it; ``now``: at once, none a queued copy pins (§5.3)."""
        return info.reclaimable(self, as_ints("checkpoints", bundles), as_bool("now", now))

    def metrics(self) -> info.StoreMetrics:
        """Counters since open and occupancy now (engine/info.py documents each field)."""
        return info.metrics(self)

    def checkpoints(self) -> list[int]:
        return [b for b, x in self.state.bundles.items() if not x.active]

    def active(self) -> list[int]:
        return [b for b, x in self.state.bundles.items() if x.active]

    # --- host tier (§5.3) — see engine/host.py ---------------------------------------------
    @command
    def offload(self, checkpoint: int, drop_device: bool = False) -> int:
        """Queue D2H copies of a checkpoint's pages; published (and synced, with a
        persistence directory) at the next boundary. Returns the pages queued. With
        ``drop_device`` the device replicas go as soon as a valid host replica exists and no
        active sequence maps them (``host.can_drop_device``)."""
        self._usable("offload")
        return host.offload(self, as_int("checkpoint", checkpoint),
                            as_bool("drop_device", drop_device))

    @command
    def drop_device(self, checkpoint: int, *, shared_with: Sequence[int] | None = None) -> int:
        """Free the device page groups of an offloaded inactive checkpoint; pages whose D2H
        copy is still queued drop when it publishes (at the next boundary). ``shared_with``:
        only pages no other checkpoint outside it holds (empty: the checkpoint's own)."""
        self._usable("drop_device")
        return host.drop_device(self, as_int("checkpoint", checkpoint),
                                None if shared_with is None else as_ints("shared_with", shared_with))

    @command
    def drop_host(self, bundle: int) -> int:
        """Free the host extents of a checkpoint's (or an active sequence's, e.g. after
        ``swap_in``) pages that live on the device and no other checkpoint holds."""
        self._usable("drop_host")
        return host.drop_host(self, as_int("bundle", bundle))

    # --- continuation (§7.3, §9) — see engine/continuation.py --------------------------------------
    @command
    def activate_from(self, checkpoint: int, frontier: int | dict[str, int], prompt_tokens: int,
                      max_output_tokens: int, *, keep_source: bool = True,
                      mode: str = "auto", carry_metadata: bool = False) -> int:
        """Continue from ``checkpoint`` at token ``frontier`` (one int, or one per pool).
        Move or Fork is decided from the real references (engine/continuation.py).
        ``carry_metadata``: the new sequence gets the checkpoint's metadata (a preempted
        request resumed); only at its whole committed frontier, which the metadata describes."""
        self._usable("activate_from")
        return continuation.activate_from(self, checkpoint, frontier, prompt_tokens,
                                          max_output_tokens, mode, keep_source, carry_metadata)

    # --- views (§12) ---------------------------------------------------------------------------------
    def batch_view(self, pool: str | PoolKind, layer: int) -> PagedKVBatchLayerView:
        """§12.2 view of one layer. In checked mode it carries a write guard that kernel
        wrappers call with the rows and positions they are about to write."""
        if self._closed:
            raise StoreClosed("batch_view refused: the store is closed")
        name = self._pool(pool).name
        pd = self.device.pools[name]
        if not pd.planes:
            raise InvalidArgument(f"pool {name} has no planes (opened with allocate_planes="
                                  "False)")
        layer = as_int("layer", layer, lo=0, hi=len(pd.planes) - 1)
        planes = pd.planes[layer]
        g = pd.geometry
        guard = checked.WriteGuard(self, name, layer) if self.config.checked else None
        return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                     planes.get("v_scale"), pd.block_tables, g.head_dim,
                                     g.num_kv_heads, self.config.model.profile
                                     if g.kind is not PoolKind.DRAFT_FULL else Profile.BF16,
                                     g.order, guard)

    def layer_view(self, bundle: int, pool: str | PoolKind, layer: int) -> PagedKVLayerView:
        sp = self._space(bundle, pool, active=True)
        return self.batch_view(pool, layer).row_view(sp.row)

    def table_rows(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Execution rows (§7.2) of active sequences, as the int32 ``table_rows`` op input."""
        if self._closed:
            raise StoreClosed("table_rows refused: the store is closed")
        rows = [self._space(b, pool, active=True).row for b in as_ints("seqs", bundles)]
        return torch.tensor(rows, dtype=torch.int32, device=self.device.device)

    # --- invariants and digest (§14) ----------------------------------------------------------------
    def violations(self) -> list[str]:
        """§14 on the state, and the device tables against it (``info.table_violations``)."""
        return violations(self.state) + info.table_violations(self)

    def check_invariants(self) -> None:
        v = self.violations()
        if v:
            raise InvariantViolation("; ".join(v[:10]))

    def digest(self) -> str:
        return digest(self.state)

    def occupancy(self) -> dict[str, dict[str, int]]:
        return info.occupancy(self)


__all__ = ["NO_PAGE", "InvariantViolation", "KVStore", "RecoveryReport", "StoreConfig"]
