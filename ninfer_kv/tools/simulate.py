"""Drive a KVStore with a Mooncake-format trace: a small scheduler, prefix reuse through
retained checkpoints with the cache layer's retention policy (ninfer_kv/cache/retention.py:
LRU, leaves before parents, demote to host before release), optional MTP speculation and host
offload.

The policy lives here, not in the engine (the store never chooses requests, sources or
victims). One simulated round = one GPU unit: prefill of newly admitted requests (whole prompt)
and one decode (or speculative verify) step of every running request.

Trace lines: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
one hash id per 512-token prefix block; equal ids = reusable prefix KV.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ninfer_kv.cache.preemption import Swapped, swap_in, swap_out
from ninfer_kv.cache.retention import LruRetention
from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import CapacityExhausted, HostArenaError
from ninfer_kv.journal.log import SyncPolicy
from ninfer_kv.tools.sim_data import DEFAULT_TRACE, Request, SimOptions, SimResult, load_trace

__all__ = ["DEFAULT_TRACE", "Request", "SimOptions", "SimResult", "load_trace", "make_store",
           "simulate"]

HASH_BLOCK = 512
STALL_ROUNDS = 8
"""Rounds in a row that may neither step a request nor admit a new one (pages a swap-out or
demotion frees come back at the next boundary) before ``simulate`` reports a livelock instead
of spinning."""


@dataclass(slots=True)
class _Running:
    req: Request
    seq: int
    frontier: int
    target: int
    parent: int | None = None
    prefill: int = 0  # tokens the admission's unit computes and commits (0: none)


def make_store(opts: SimOptions) -> KVStore:
    model = ModelGeometry(layers=opts.layers, kv_heads=opts.kv_heads, head_dim=opts.head_dim)
    serving = ServingConfig(max_context=opts.max_context, max_concurrency=opts.max_concurrency,
                            backend=Backend.MTP if opts.mtp else Backend.OFF,
                            draft_window=opts.draft_window)
    cfg = StoreConfig(model=model, serving=serving, kv_tokens=opts.kv_tokens,
                      journal_dir=opts.journal_dir, sync=SyncPolicy.OFF,
                      allocate_planes=opts.allocate_planes,
                      host_bytes=opts.host_bytes if opts.offload else 0, checked=opts.checked,
                      lease_growth=opts.lease_growth, lease_window=opts.lease_window)
    return KVStore.open(cfg)


def _unit_wrote(store: KVStore, pool: str, seq: int, end: int) -> None:
    """Checked mode: the simulated GPU unit writes ``[committed, end)`` of ``seq`` in every
    layer, through each layer view's write guard (which checks the writer, the frontier and
    the published table, and records the write so the commit is allowed)."""
    sp = store.space(seq, pool)
    if end <= sp.committed:
        return
    rows = torch.full((end - sp.committed,), sp.row, dtype=torch.int32)
    positions = torch.arange(sp.committed, end)
    for layer in range(store.device.pools[pool].geometry.layers):
        guard = store.batch_view(pool, layer).guard
        assert guard is not None
        guard(rows, positions)


def simulate(requests: list[Request], opts: SimOptions,
             on_round: Callable[[KVStore, SimResult], None] | None = None,
             store: KVStore | None = None) -> tuple[KVStore, SimResult]:
    rng = random.Random(opts.seed)
    if opts.scale > 1:
        requests = [Request(r.rid, r.arrival_ms, max(2, r.prompt // opts.scale),
                            max(1, r.output // opts.scale), r.hash_ids) for r in requests]
    store = store or make_store(opts)
    res = SimResult()
    cache = LruRetention()  # whole releases: tail-first trims (block_tokens=) measured 0.374
    # of prompt tokens reused on the full trace, device only, against 0.377
    seen: set[int] = set()
    waiting = iter(sorted(requests, key=lambda r: (r.arrival_ms, r.rid)))
    queue: list[Request] = []
    running: list[_Running] = []
    swapped: dict[int, tuple[Swapped, _Running]] = {}  # request id -> preempted request
    now = 0.0
    k = opts.draft_window if opts.mtp else 1
    nxt = next(waiting, None)
    pools = store.pools
    stalled_rounds = 0

    def timed(fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            res.store_seconds += time.perf_counter() - t0

    while nxt is not None or queue or running:
        while nxt is not None and nxt.arrival_ms <= now:
            queue.append(nxt)
            nxt = next(waiting, None)
        if not queue and not running and nxt is not None:
            now = float(nxt.arrival_ms)
            continue
        # running requests grow first (as vLLM schedules them before waiting ones); no
        # admission in a round that preempted (as vLLM)
        swaps, first_admissions = res.swaps, res.requests
        stalled: set[int] = set()
        if opts.lease_growth and running:
            stalled = timed(_grow, store, cache, res, running, queue, swapped, k)
        # admit in arrival order while rows and capacity allow (evicting LRU checkpoints)
        admitted: list[_Running] = []
        swapped_in: list[int] = []  # their host extents free once the restore has run
        while queue and len(running) + len(admitted) < opts.max_concurrency \
                and res.swaps == swaps:
            req = queue[0]
            if req.prompt + req.output + k > opts.max_context:
                res.skipped += 1
                queue.pop(0)
                continue
            if req.rid in swapped:
                before = res.swap_ins
                r = _resume(store, swapped, req.rid, cache, res, timed, k)
                if r is not None and res.swap_ins > before and store.arena is not None:
                    swapped_in.append(r.seq)
            else:
                r = _admit(store, req, cache, res, timed, k, HASH_BLOCK // max(1, opts.scale),
                           seen)
            if r is None:
                res.refused_admissions += 1
                break
            queue.pop(0)
            admitted.append(r)
        # prefill the admitted requests (one unit), then one decode/verify step for the rest
        for r in admitted:
            for pool in pools:
                timed(store.ensure_mapped, r.seq, pool, r.prefill + (k - 1 if pool == "mtp"
                                                                     else 0))
        steps = [r for r in running if r.seq not in stalled]
        seqs = [r.seq for r in steps]
        for pool in pools:
            lead = k - 1 if pool == "mtp" else 0
            cap = store.plan.L * P
            timed(store.ensure_mapped_many, pool, seqs,
                  [min(r.frontier + k + lead, cap) for r in steps])
        timed(store.close_boundary)
        timed(store.unit_complete)
        for seq in swapped_in:  # a resumed request's replicas are a cache, not durability
            timed(store.drop_host, seq)
        for r in admitted:
            for pool in pools:
                if store.space(r.seq, pool).committed >= r.prefill:
                    continue  # resumed from its checkpoint: nothing to prefill
                if opts.checked:
                    _unit_wrote(store, pool, r.seq, r.prefill)
                timed(store.commit, r.seq, pool, r.prefill)
            r.frontier = max(r.frontier, r.prefill)
            if opts.share:
                _share(store, r, cache, timed, HASH_BLOCK // max(1, opts.scale))
        done = []
        for r in steps:
            acc = 1 if k == 1 else min(k, 1 + sum(rng.random() < opts.accept_rate
                                                   for _ in range(k - 1)))
            acc = min(acc, r.target - r.frontier)
            r.frontier += acc
            res.request_steps += 1
            res.output_tokens += acc
            if r.frontier >= r.target:
                done.append(r)
        for pool in pools:  # each pool commits its accepted frontier, then trims (§8.2 order)
            if opts.checked:
                for r in steps:
                    _unit_wrote(store, pool, r.seq, r.frontier)
            timed(store.commit_many, pool, seqs, [r.frontier for r in steps])
            if k > 1:
                for r in steps:
                    timed(store.trim, r.seq, pool)
        for r in done:
            ck = timed(store.finish, r.seq, retain=True)
            cache.retain(ck, r.req.hash_ids, r.parent)
            running.remove(r)
            if opts.offload:
                _offload(store, ck, cache, res, timed)
        running.extend(admitted)
        res.rounds += 1
        # liveness: a round steps a request or admits a new one (a resume alone is no
        # progress: resume -> preempt could cycle forever)
        progressed = bool(steps) or res.requests > first_admissions
        stalled_rounds = 0 if progressed else stalled_rounds + 1
        if stalled_rounds > STALL_ROUNDS:
            raise RuntimeError(
                f"simulate stalled: no request stepped or newly admitted for {stalled_rounds} rounds "
                f"({len(running)} running, {len(queue)} queued); occupancy "
                f"{store.occupancy()['main']}, {len(cache)} retained")
        occ = store.occupancy()["main"]
        used = (occ["allocated"] + occ["reserved"]) / occ["capacity"]
        res.peak_occupancy = max(res.peak_occupancy, used)
        if res.rounds % 16 == 0:
            res.timeline.append({"round": res.rounds, "main_used": used,
                                 "hit_ratio": res.hit_ratio})
        if on_round is not None:
            on_round(store, res)
        now += opts.round_ms
    timed(store.close_boundary)
    store.unit_complete()
    res.cow_copies = store.stats["cow_copies"]
    res.digest = store.digest()
    res.journal_bytes = store.journal.bytes_written if store.journal else 0
    return store, res


def _admit(store: KVStore, req: Request, cache: LruRetention, res: SimResult,
           timed: Callable[..., Any], k: int, block: int, seen: set[int]) -> _Running | None:
    """Admit ``req``, continuing the retained checkpoint with the longest prefix; make room
    through the retention policy while the store refuses. ``seen``: every block admitted so
    far (what an unbounded cache would hold: the ideal)."""
    blocks = 0
    for h in req.hash_ids:
        if h not in seen:
            break
        blocks += 1
    ideal = min(blocks * block, req.prompt - 1)
    while True:
        ck, blocks = cache.lookup(req.hash_ids)
        t0 = time.perf_counter()
        try:
            if ck is not None:
                f = min(blocks * block, req.prompt - 1,
                        *(store.space(ck, p).committed for p in store.pools))
                seq = timed(store.activate_from, ck, f, req.prompt, req.output + k - 1,
                            keep_source=True)
                cache.restored(ck)
                hit = f
            else:
                seq = timed(store.activate, req.prompt, req.output + k - 1)
                hit = 0
        except CapacityExhausted as exc:
            action = timed(cache.make_room, store, exc.short)
            if action is None:
                return None  # wait for running requests to finish
            if action == "demote":
                res.demotions += 1  # device pages freed, the checkpoint lives on in host
            else:
                res.evictions += 1  # released, or its tail given up
            continue
        res.activation_seconds += time.perf_counter() - t0
        res.activations += 1
        res.requests += 1
        res.prompt_tokens += req.prompt
        res.prefix_hit_tokens += hit
        res.ideal_hit_tokens += ideal
        seen.update(req.hash_ids)
        frontier = store.space(seq).committed
        return _Running(req, seq, frontier, req.prompt + req.output, ck, req.prompt)


def _grow(store: KVStore, cache: LruRetention, res: SimResult, running: list[_Running],
          queue: list[Request], swapped: dict[int, tuple[Swapped, _Running]], k: int) -> set[int]:
    """Top up every running request's lease for this round (§6.2). While some cannot grow:
    the retention policy frees checkpoints; else the most recently admitted request is
    preempted (vLLM's victim) and re-queued first. A request swapped to the host tier frees
    its page groups only when its copy publishes (the next boundary): the requests still
    short then wait a round. Returns the sequences that do not step this round."""
    g = store.grow(k)
    while g.exhausted:
        action = cache.make_room(store, max(g.short.values(), default=1))
        if action is not None:
            res.demotions += action == "demote"
            res.evictions += action in ("release", "trim")
        elif len(running) > 1:
            victim = running.pop()
            sw = swap_out(store, victim.seq, victim.req.prompt + victim.req.output + k - 1)
            res.swaps += 1
            swapped[victim.req.rid] = (sw, victim)
            queue.insert(0, victim.req)
            if sw.offloaded:
                return set(g.exhausted) - {victim.seq}
            # still on the device: the retention policy may keep it (a later swap_in) or
            # release it (a recompute) — its prompt blocks are a prefix like any other
            cache.retain(sw.checkpoint, victim.req.hash_ids, victim.parent)
        else:
            return set(g.exhausted)
        g = store.grow(k)
    return set()


def _resume(store: KVStore, swapped: dict[int, tuple[Swapped, _Running]], rid: int,
            cache: LruRetention, res: SimResult, timed: Callable[..., Any],
            k: int) -> _Running | None:
    """Re-admit a preempted request: swap its checkpoint back in, or — when the retention
    policy released it meanwhile — prefill its committed tokens again (recompute)."""
    sw, old = swapped[rid]
    front = sw.frontier["main"]
    while True:
        alive = sw.offloaded or sw.checkpoint in cache.entries
        try:
            if alive:
                seq = timed(swap_in, store, sw)
            else:
                seq = timed(store.activate, front, sw.budget - front)
            break
        except CapacityExhausted as exc:
            action = timed(cache.make_room, store, exc.short)
            if action is None:
                return None
            res.demotions += action == "demote"
            res.evictions += action in ("release", "trim")
    del swapped[rid]
    if alive:
        res.swap_ins += 1
        if sw.checkpoint in cache.entries:
            cache.forget(sw.checkpoint)   # swap_in consumed it
    else:
        res.recomputed += 1
    return _Running(old.req, seq, store.space(seq).committed, old.target, old.parent,
                    0 if alive else front)


def _share(store: KVStore, r: _Running, cache: LruRetention, timed: Callable[..., Any],
           block: int) -> None:
    """Live sharing (``share_prefix``): the prompt's whole hash blocks (at least one token
    left to compute the first logits from, as for a hit) become a checkpoint that requests
    arriving while ``r`` decodes continue from — when they add blocks nobody holds yet."""
    n = min(len(r.req.hash_ids), (r.req.prompt - 1) // block)
    have = cache.lookup(r.req.hash_ids[:n])[1] if n else 0
    if n * block < P or n <= have:
        return
    ck = timed(store.share_prefix, r.seq, n * block)
    cache.retain(ck, r.req.hash_ids[:n])


def _offload(store: KVStore, ck: int, cache: LruRetention, res: SimResult,
             timed: Callable[..., Any]) -> None:
    """Copy a fresh checkpoint to the host tier; while the arena is full, the retention
    policy frees host space (least valuable checkpoint first), or this one stays device-only."""
    while True:
        try:
            res.offloaded_pages += timed(store.offload, ck)
            return
        except HostArenaError:
            action = timed(cache.make_host_room, store, ck)
            if action is None:
                return
            if action == "release":
                res.evictions += 1
