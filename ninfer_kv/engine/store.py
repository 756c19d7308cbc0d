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

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from ninfer_kv.engine import continuation, growth, host, restart
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import (
    CapacityPlan,
)
from ninfer_kv.engine.config import InvariantViolation, RecoveryReport, StoreConfig
from ninfer_kv.engine.device import UNMAPPED, DeviceState
from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.layout import P, PoolKind, Profile, ceil_div
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage, PageHandle
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState, decode_state, digest, encode_state
from ninfer_kv.engine.views import PagedKVBatchLayerView, PagedKVLayerView
from ninfer_kv.errors import (
    CapacityExhausted,
    ConfigError,
    EntitlementExceeded,
    FrontierError,
    FrozenUnit,
    InactiveSpace,
    StaleHandle,
    StateError,
    UnknownHandle,
    WritePermissionError,
)
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC, pack
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.journal.recovery import recover_state

log = structlog.get_logger(__name__)


class KVStore:
    """The storage engine. Open with :meth:`open`; not thread-safe (one engine loop)."""

    def __init__(self, config: StoreConfig, plan: CapacityPlan, state: StoreState,
                 journal: Journal | None) -> None:
        self.config = config
        self.plan = plan
        self.state = state
        self.journal = journal
        self.device = DeviceState({k.value: g for k, g in plan.layout.pools.items()},
                                  plan.C, plan.L, config.device, config.allocate_planes)
        self._pending: list[Any] = []
        # device copies for the next boundary, in emission order (a page group freed and
        # reused within one record must be read by an earlier copy before it is overwritten)
        self._effects: list[ev.CopyTail | ev.DeviceRestore] = []
        self._touched: dict[tuple[str, int], int] = {}  # (pool, bundle) -> first block to publish
        self._transfers: list[host.Transfer] = []       # D2H copies for the next boundary
        self.arena: HostArenaBuffer | None = None
        self._frozen = False
        self.fault_hook: Callable[[str, str], None] | None = None
        """Test hook called as (step, pool) at each planning step of an activation."""
        self.recovery = RecoveryReport()
        self.stats = {"records": 0, "events": 0, "materialized": 0, "cow_copies": 0,
                      "d2h_pages": 0, "d2h_runs": 0, "h2d_pages": 0, "published": 0}

    # --- open / close -----------------------------------------------------------------------
    @classmethod
    def open(cls, config: StoreConfig | None = None) -> KVStore:
        config = config or StoreConfig()
        plan = config.plan()
        specs = [ev.PoolSpec(kind.value, g.capacity, plan.C, plan.L, g.page_bytes)
                 for kind, g in plan.layout.pools.items()]
        journal = None
        state = StoreState()
        report = RecoveryReport()
        jdir = config.journal_path
        if jdir is not None:
            journal = Journal.open(jdir, CODEC, JournalOptions(sync=config.sync,
                                                               segment_bytes=config.segment_bytes))

            def apply_record(st: StoreState, seq: int, payload: memoryview) -> None:
                for e in CODEC.decode(payload):
                    apply(st, e)
                st.seq = seq

            state, last, res = recover_state(
                jdir, schema_major=CODEC.schema[0], initial=StoreState,
                load_snapshot=decode_state, apply_record=apply_record,
                scan_result=journal.recovery)
            report.records = last
            report.cuts = [f"segment {c.segment} @ {c.offset}: {c.bytes_cut} B ({c.reason})"
                           for c in res.cuts]
        store = cls(config, plan, state, journal)
        store.recovery = report
        if config.host_bytes:
            path = None
            if config.persist_dir is not None:
                os.makedirs(config.persist_dir, exist_ok=True)
                path = os.path.join(config.persist_dir, "host_arena.bin")
            store.arena = HostArenaBuffer(config.host_bytes, path)
        if not state.configured:
            store._emit(ev.Configure(specs, plan.to_dict()))
            if config.host_bytes:
                store._emit(ev.HostConfigure(config.host_bytes))
        else:
            if state.pool_specs != specs:
                raise ConfigError(f"journal {jdir} was written for pools "
                                  f"{state.pool_specs}, this config plans {specs}")
            have = state.host.capacity if state.host is not None else 0
            if have != config.host_bytes:
                raise ConfigError(f"journal {jdir} was written with host_bytes={have}, "
                                  f"this config has {config.host_bytes}")
            store._recover_cleanup()
        store._publish_record()
        if store.journal is not None:
            store.journal.sync()
        return store

    def _recover_cleanup(self) -> None:
        restart.recover_cleanup(self)

    def close(self) -> None:
        if self._pending or self._transfers:
            self._publish_record()
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def snapshot(self) -> str | None:
        if self.journal is None:
            return None
        self._require_thawed("snapshot")
        if self._pending:
            self._publish_record()
        return self.journal.write_snapshot(encode_state(self.state))

    # --- event plumbing ---------------------------------------------------------------------
    def _emit(self, *events: Any) -> None:
        for e in events:
            apply(self.state, e)
            self._pending.append(e)

    def _touch(self, pool: str, bundle: int, block: int) -> None:
        key = (pool, bundle)
        cur = self._touched.get(key)
        if cur is None or block < cur:
            self._touched[key] = block

    def _append_pending(self) -> int:
        seq = self.state.seq
        if self._pending:
            if self.journal is not None:
                seq = self.journal.append(self._pending)
            else:
                seq += 1
            self.state.seq = seq
            self.stats["records"] += 1
            self.stats["events"] += len(self._pending)
            self._pending = []
        return seq

    def _publish_record(self) -> int:
        """Append pending events as one record, then run the device effects in order:
        H2D restores and COW copies (in emission order), table-slice writes; then complete
        queued D2H transfers and journal their publication as a second record, synced (a
        durability point)."""
        seq = self._append_pending()
        for e in self._effects:
            if isinstance(e, ev.DeviceRestore):
                host.restore_pages(self, [e])
            else:
                self.device.copy_columns(e.pool, e.src_page, e.page, e.columns)
        self._effects.clear()
        for (pool, bundle), start in self._touched.items():
            sp = self.state.pools[pool].spaces.get(bundle)
            if sp is None or not sp.active:
                continue
            pages = self.state.pools[pool].pages
            ids = [pages[s].device for s in sp.members[start:]]  # type: ignore[union-attr]
            ids.extend([UNMAPPED] * (self.plan.L - start - len(ids)))  # no stale entries
            self.device.write_table(pool, sp.row, start, ids)
        self._touched.clear()
        if self._transfers:
            published = host.run_transfers(self)
            self._emit(*published)
            seq = self._append_pending()
            if self.journal is not None:
                self.journal.sync()
            self.stats["published"] += sum(isinstance(e, ev.HostPublish) for e in published)
        every = self.config.snapshot_every
        if every and self.journal is not None and seq and seq % every == 0:
            self.journal.write_snapshot(encode_state(self.state))
        return seq

    # --- the GPU boundary (§8.4, §13) ---------------------------------------------------------
    def close_boundary(self) -> int:
        """Publish: journal record, device effects; then freeze until unit_complete()."""
        self._require_thawed("close_boundary")
        seq = self._publish_record()
        self._frozen = True
        return seq

    def unit_complete(self) -> None:
        self._frozen = False

    @contextlib.contextmanager
    def boundary(self) -> Iterator[int]:
        seq = self.close_boundary()
        try:
            yield seq
        finally:
            self.unit_complete()

    def _require_thawed(self, what: str) -> None:
        if self._frozen:
            raise FrozenUnit(f"{what} refused: a GPU unit is in flight; tables, memberships and "
                             "frontiers are frozen until unit_complete() (§8.4)")

    # --- lookups ------------------------------------------------------------------------------
    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self.state.pools)

    def _pool(self, pool: str | PoolKind) -> PoolState:
        try:
            return self.state.pools[str(pool)]
        except KeyError:
            raise UnknownHandle(f"pool {pool!r} is not enabled; pools: {self.pools}") from None

    def _space(self, bundle: int, pool: str | PoolKind, *, active: bool | None = None
               ) -> KVAddressSpace:
        p = self._pool(pool)
        sp = p.spaces.get(bundle)
        if sp is None:
            raise UnknownHandle(f"seq {bundle} has no address space in pool {p.name}")
        if active is True and not sp.active:
            raise InactiveSpace(f"seq {bundle} in pool {p.name} is an inactive checkpoint; "
                                "only an active address space can map or commit")
        if active is False and sp.active:
            raise InactiveSpace(f"seq {bundle} in pool {p.name} is active, not a checkpoint")
        return sp

    def space(self, bundle: int, pool: str | PoolKind = PoolKind.MAIN) -> KVAddressSpace:
        """Read-only access for callers and tests (do not mutate)."""
        return self._space(bundle, pool)

    def page(self, handle: PageHandle) -> LogicalKVPage:
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
        tokens = budget
        if self.config.lease_growth:
            tokens = min(budget, frontier + self.config.lease_window + self.config.lease_cushion)
        if pool == PoolKind.MTP.value:
            tokens += self.config.serving.draft_window - 1
        return min(self.plan.L, ceil_div(tokens, P))

    def activate(self, prompt_tokens: int, max_output_tokens: int) -> int:
        """Activate a new sequence from root; returns its id (the bundle id)."""
        self._require_thawed("activate")
        total = prompt_tokens + max_output_tokens
        if prompt_tokens < 0 or max_output_tokens < 0 or total <= 0:
            raise FrontierError(f"prompt_tokens={prompt_tokens}, max_output_tokens="
                                f"{max_output_tokens}: need non-negative sizes and a positive sum")
        if total > self.plan.S:
            raise FrontierError(f"prompt {prompt_tokens} + output {max_output_tokens} = {total} "
                                f"tokens > S={self.plan.S}, the logical ceiling (§3.2)")
        plan = {p: self.entitlement_pages(p, prompt_tokens, total) for p in self.pools}
        self._check_capacity(plan)
        bundle = self.state.next_bundle
        events = [ev.Activate(bundle, p, n, self.state.pools[p].free_rows[0], total,
                              prompt_tokens)
                  for p, n in plan.items()]
        self._emit(*events, ev.PublishActive(bundle))
        for p in plan:
            self._touch(p, bundle, 0)  # the leased row is published whole: no stale entries
        return bundle

    def grow(self, step_tokens: int = 1) -> growth.GrowResult:
        """kv_lease_growth at a decode-round boundary (engine/growth.py)."""
        self._require_thawed("grow")
        return growth.grow(self, step_tokens)

    def _check_capacity(self, pages: dict[str, int]) -> None:
        for name, n in pages.items():
            if self.fault_hook:
                self.fault_hook("reserve", name)
            p = self.state.pools[name]
            if n > p.available:
                raise CapacityExhausted(f"pool {name}: need {n} pages, {p.available} available "
                                        f"(allocated {p.allocated}, reserved {p.reserved}, "
                                        f"capacity {p.capacity})")
            if not p.free_rows:
                raise CapacityExhausted(f"pool {name}: all {p.rows} execution rows are leased "
                                        f"(max_concurrency C={p.rows})")

    # --- mapping (§8.1) -------------------------------------------------------------------------
    def ensure_mapped(self, bundle: int, pool: str | PoolKind, tokens: int) -> int:
        """``ensure_mapped_to_tokens``: a lower bound. Returns the pages materialized."""
        return self.ensure_mapped_many(pool, [bundle], [tokens])

    def ensure_mapped_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                           tokens: Sequence[int] | np.ndarray) -> int:
        self._require_thawed("ensure_mapped")
        p = self._pool(pool)
        spaces = p.spaces
        need_b: list[int] = []
        need_n: list[int] = []
        if isinstance(bundles, np.ndarray):
            bundles = bundles.tolist()
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        limit = p.logical_pages
        _no_duplicates(bundles)
        for b, t in zip(bundles, tokens, strict=True):
            sp = spaces.get(b)
            if sp is None or not sp.active:
                self._space(b, p.name, active=True)  # raises the precise error
            needed = (t + P - 1) // P
            have = len(sp.members)  # type: ignore[union-attr]
            if needed <= have and t >= 0:
                continue
            if t < 0 or needed > limit:
                raise FrontierError(f"seq {b} pool {p.name}: tokens={t} outside [0, L*P="
                                    f"{limit * P}]")
            if needed > sp.entitlement:  # type: ignore[union-attr]
                raise EntitlementExceeded(
                    f"seq {b} pool {p.name} needs {needed} pages for {t} tokens, entitlement is "
                    f"{sp.entitlement} (§8.1)")  # type: ignore[union-attr]
            need_b.extend([b] * (needed - have))
            need_n.append(have)
        if not need_b:
            return 0
        slots = p.pick_slots(len(need_b))
        pages = p.pick_pages(len(need_b))
        self._emit(ev.Materialize(p.name, pack(need_b), pack(slots), pack(pages)))
        prev = None
        i = 0
        for b in need_b:
            if b != prev:
                self._touch(p.name, b, need_n[i])
                i += 1
                prev = b
        self.stats["materialized"] += len(need_b)
        return len(need_b)

    # --- frontiers (§8.1, §8.2) ------------------------------------------------------------------
    def commit(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        self.commit_many(pool, [bundle], [frontier])

    def commit_many(self, pool: str | PoolKind, bundles: Sequence[int] | np.ndarray,
                    frontiers: Sequence[int] | np.ndarray) -> None:
        """Advance committed frontiers after the unit succeeded; one event for the batch."""
        self._require_thawed("commit")
        p = self._pool(pool)
        spaces, pages = p.spaces, p.pages
        bl = bundles.tolist() if isinstance(bundles, np.ndarray) else list(bundles)
        fl = frontiers.tolist() if isinstance(frontiers, np.ndarray) else list(frontiers)
        _no_duplicates(bl)
        for b, f in zip(bl, fl, strict=True):
            sp = spaces.get(b)
            if sp is None or not sp.active:
                self._space(b, p.name, active=True)
            members = sp.members  # type: ignore[union-attr]
            old = sp.committed  # type: ignore[union-attr]
            if f < old or f > len(members) * P:
                raise FrontierError(
                    f"seq {b} pool {p.name}: commit frontier {f} outside [committed={old}, "
                    f"membership={len(members) * P}] (use truncate to move back)")
            # write permission (§9.4) of every block the new columns land in; a decode step
            # touches one block, so that case is checked without a loop
            lo, hi = old // P, (f + P - 1) // P
            if hi - lo == 1:
                pg = pages[members[lo]]
                if pg.writer != b or pg.pins or pg.protected > old - lo * P:  # type: ignore[union-attr]
                    raise WritePermissionError(self._why_not_writable(p, b, lo))
            else:
                for blk in range(lo, hi):
                    pg = pages[members[blk]]
                    first = old - blk * P if blk == lo else 0  # first column written here
                    if pg.writer != b or pg.pins or pg.protected > first:  # type: ignore[union-attr]
                        raise WritePermissionError(self._why_not_writable(p, b, blk))
        self._emit(ev.CommitFrontiers(p.name, pack(bl), pack(fl)))

    def _why_not_writable(self, p: PoolState, bundle: int, block: int) -> str:
        pg = p.pages[p.spaces[bundle].members[block]]
        assert pg is not None
        return (f"seq {bundle} pool {p.name} block {block} (page {p.name}:{pg.slot}): writer="
                f"{pg.writer}, refs={pg.refs}, protected={pg.protected}, pins={pg.pins}, epoch="
                f"{pg.epoch}: only the single private writer may write (§9.4)")

    def set_provisional(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        self.set_provisional_many(pool, [bundle], [frontier])

    def set_provisional_many(self, pool: str | PoolKind, bundles: Sequence[int],
                             frontiers: Sequence[int]) -> None:
        self._require_thawed("set_provisional")
        p = self._pool(pool)
        _no_duplicates(bundles)
        for b, f in zip(bundles, frontiers, strict=True):
            sp = self._space(b, p.name, active=True)
            if not 0 <= f <= len(sp.members) * P:
                raise FrontierError(f"seq {b} pool {p.name}: provisional frontier {f} beyond "
                                    f"membership {len(sp.members) * P}")
        self._emit(ev.ProvisionalFrontiers(p.name, pack(list(bundles)), pack(list(frontiers))))

    def trim(self, bundle: int, pool: str | PoolKind) -> int:
        """Unmap trailing pages: NeededPages = ceil(max(committed, provisional) / P) (§8.2).
        Returns the pages unmapped; their leases go back to this space's reservation."""
        self._require_thawed("trim")
        sp = self._space(bundle, pool, active=True)
        keep = ceil_div(max(sp.committed, sp.provisional), P)
        if keep >= len(sp.members):
            return 0
        self._check_private(self._pool(pool), sp, keep)
        n = len(sp.members) - keep
        self._emit(ev.Trim(bundle, sp.pool, keep))
        self._touch(sp.pool, bundle, keep)
        return n

    def _check_private(self, p: PoolState, sp: KVAddressSpace, start: int) -> None:
        for blk in range(start, len(sp.members)):
            pg = p.pages[sp.members[blk]]
            if pg is None or pg.refs != 1 or pg.pins:
                raise WritePermissionError(self._why_not_writable(p, sp.bundle, blk))

    def truncate(self, bundle: int, pool: str | PoolKind, frontier: int) -> None:
        """Move the committed frontier back (not below the protected frontier), then trim."""
        self._require_thawed("truncate")
        p = self._pool(pool)
        sp = self._space(bundle, pool, active=True)
        if not sp.protected <= frontier <= sp.committed:
            raise FrontierError(f"seq {bundle} pool {p.name}: truncate to {frontier} outside "
                                f"[protected={sp.protected}, committed={sp.committed}]")
        if frontier % P and frontier < sp.committed:
            pg = p.pages[sp.members[frontier // P]]
            if pg is None or pg.writer != bundle:
                raise WritePermissionError(self._why_not_writable(p, bundle, frontier // P))
        keep = ceil_div(max(frontier, min(sp.provisional, frontier)), P)
        self._check_private(p, sp, keep)
        events: list[Any] = [ev.Truncate(bundle, p.name, frontier)]
        if keep < len(sp.members):
            events.append(ev.Trim(bundle, p.name, keep))
            self._touch(p.name, bundle, keep)
        self._emit(*events)

    # --- termination (§8.3) -----------------------------------------------------------------------
    def finish(self, bundle: int, retain: bool = False, reason: str = "stop") -> int | None:
        """Leave execution; retain an immutable checkpoint (returns its id) or release all."""
        self._require_thawed("finish")
        b = self.state.bundles.get(bundle)
        if b is None or not b.active:
            raise InactiveSpace(f"seq {bundle} is not an active sequence")
        events: list[Any] = []
        for pool in b.pools:
            sp = self.state.pools[pool].spaces[bundle]
            keep = ceil_div(sp.committed, P)
            if keep < len(sp.members):
                self._check_private(self.state.pools[pool], sp, keep)
                events.append(ev.Trim(bundle, pool, keep))
            events.append(ev.Finish(bundle, pool, retain, reason))
        self._emit(*events)
        return bundle if retain else None

    def release(self, checkpoint: int) -> None:
        """Drop a checkpoint's references; leases free with their last reference (§8.3)."""
        self._require_thawed("release")
        b = self.state.bundles.get(checkpoint)
        if b is None or b.active:
            raise UnknownHandle(f"{checkpoint} is not an inactive checkpoint")
        self._emit(*(ev.Release(checkpoint, pool) for pool in b.pools))

    def checkpoints(self) -> list[int]:
        return [b for b, x in self.state.bundles.items() if not x.active]

    def active(self) -> list[int]:
        return [b for b, x in self.state.bundles.items() if x.active]

    # --- host tier (§5.3) — see engine/host.py ---------------------------------------------
    def offload(self, checkpoint: int, drop_device: bool = False) -> int:
        """Queue D2H copies of a checkpoint's pages; published (and synced, with a
        persistence directory) at the next boundary. Returns the pages queued."""
        self._require_thawed("offload")
        return host.offload(self, checkpoint, drop_device)

    def drop_device(self, checkpoint: int) -> int:
        """Free the device page groups of an offloaded inactive checkpoint."""
        self._require_thawed("drop_device")
        return host.drop_device(self, checkpoint)

    def drop_host(self, checkpoint: int) -> int:
        """Free the host extents of a checkpoint that still lives on the device."""
        self._require_thawed("drop_host")
        return host.drop_host(self, checkpoint)

    # --- continuation (§7.3, §9) — see engine/continuation.py --------------------------------------
    def activate_from(self, checkpoint: int, frontier: int | dict[str, int], prompt_tokens: int,
                      max_output_tokens: int, *, keep_source: bool = True,
                      mode: str = "auto") -> int:
        """Continue from ``checkpoint`` at token ``frontier`` (one int, or one per pool).
        Move or Fork is decided from the real references (engine/continuation.py)."""
        self._require_thawed("activate_from")
        return continuation.activate_from(self, checkpoint, frontier, prompt_tokens,
                                          max_output_tokens, mode, keep_source)

    # --- views (§12) ---------------------------------------------------------------------------------
    def batch_view(self, pool: str | PoolKind, layer: int) -> PagedKVBatchLayerView:
        pd = self.device.pools[str(pool)]
        planes = pd.planes[layer]
        g = pd.geometry
        return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                     planes.get("v_scale"), pd.block_tables, g.head_dim,
                                     g.num_kv_heads, self.config.model.profile
                                     if g.kind is not PoolKind.DRAFT_FULL else Profile.BF16,
                                     g.order)

    def layer_view(self, bundle: int, pool: str | PoolKind, layer: int) -> PagedKVLayerView:
        sp = self._space(bundle, pool, active=True)
        return self.batch_view(pool, layer).row_view(sp.row)

    def table_rows(self, pool: str | PoolKind, bundles: Sequence[int]) -> torch.Tensor:
        rows = [self._space(b, pool, active=True).row for b in bundles]
        return torch.tensor(rows, dtype=torch.int32, device=self.device.device)

    # --- invariants and digest (§14) ----------------------------------------------------------------
    def violations(self) -> list[str]:
        out = violations(self.state)
        for name, pd in self.device.pools.items():
            if self._frozen or self._touched:
                break
            tables = pd.block_tables.cpu()
            pool = self.state.pools[name]
            for sp in pool.spaces.values():
                if sp.active:
                    want = [pool.pages[s].device for s in sp.members]  # type: ignore[union-attr]
                    want += [UNMAPPED] * (pool.logical_pages - len(want))
                    got = tables[sp.row].tolist()
                    if got != want:
                        out.append(f"{name}: row {sp.row} of seq {sp.bundle} publishes {got}, "
                                   f"membership maps {want}")
        return out

    def check_invariants(self) -> None:
        v = self.violations()
        if v:
            raise InvariantViolation("; ".join(v[:10]))

    def digest(self) -> str:
        return digest(self.state)

    def occupancy(self) -> dict[str, dict[str, int]]:
        return {n: {"capacity": p.capacity, "allocated": p.allocated, "reserved": p.reserved,
                    "available": p.available, "rows_leased": len(p.row_owner)}
                for n, p in self.state.pools.items()}


def _no_duplicates(bundles: Sequence[int]) -> None:
    if len(set(bundles)) != len(bundles):
        dup = sorted({b for b in bundles if list(bundles).count(b) > 1})
        raise StateError(f"seqs {dup} appear more than once in one batched command")


__all__ = ["NO_PAGE", "InvariantViolation", "KVStore", "RecoveryReport", "StoreConfig"]
