"""Decode-round cost of the store: C active sequences decoding one token per round.

Per round: ensure_mapped_many -> boundary (journal record + table-slice writes) -> commit_many.
Prints ns per request-step for the batched path with the journal off and on (sync off), their
ratio, the same with page crossings staggered over the rounds (as in serving: a small
Materialize in every round instead of one for all sequences every 64th), and a per-sequence
(unbatched) loop for comparison. Measures; asserts nothing.

    python benchmarks/decode_round_bench.py [--seqs 256] [--rounds 4096] [--sweep]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from ninfer_kv.engine import core
from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.journal.log import SyncPolicy

PROMPT = 100


def starts(seqs: int, stagger: bool) -> np.ndarray:
    """Each sequence's prompt: all ``PROMPT`` (every sequence crosses a page boundary in the
    same round, one round in 64), or staggered over a page (``PROMPT + j % 64``: about C/64
    sequences cross in every round, as in serving, where requests arrive at any length)."""
    return PROMPT + (np.arange(seqs) % 64 if stagger else np.zeros(seqs, np.int64))


def open_store(seqs: int, rounds: int, journal_dir: str | None, max_context: int = 0,
               sync: SyncPolicy = SyncPolicy.OFF, stagger: bool = False
               ) -> tuple[KVStore, np.ndarray]:
    ctx = PROMPT + (64 if stagger else 0) + rounds
    serving = ServingConfig(max_context=max(ctx, max_context), max_concurrency=seqs)
    pages = seqs * -(-ctx // 64)
    cfg = StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                      serving=serving, kv_tokens=pages * 64, journal_dir=journal_dir,
                      sync=sync, allocate_planes=False)
    store = KVStore.open(cfg)
    first = starts(seqs, stagger)
    ids = np.array([store.activate(int(f), rounds) for f in first])
    store.ensure_mapped_many("main", ids, first)
    with store.boundary():
        pass
    store.commit_many("main", ids, first)
    return store, ids


def run_batched(store: KVStore, ids: np.ndarray, rounds: int, lead: int = 0,
                stagger: bool = False) -> float:
    """``rounds`` decode rounds; ``lead`` > 0: MTP-style, each round also maps and sets a
    provisional frontier ``lead`` tokens past the next one (§8.2)."""
    frontier = starts(len(ids), stagger)
    t0 = time.perf_counter()
    for _ in range(rounds):
        store.ensure_mapped_many("main", ids, frontier + 1 + lead)
        if lead:
            store.set_provisional_many("main", ids, frontier + 1 + lead)
        with store.boundary():
            pass  # the GPU unit would run here
        frontier += 1
        store.commit_many("main", ids, frontier)
    return time.perf_counter() - t0


def run_unbatched(store: KVStore, ids: np.ndarray, rounds: int) -> float:
    seqs = ids.tolist()
    frontier = [PROMPT] * len(seqs)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for i, b in enumerate(seqs):
            store.ensure_mapped(b, "main", frontier[i] + 1)
        with store.boundary():
            pass
        for i, b in enumerate(seqs):
            frontier[i] += 1
            store.commit(b, "main", frontier[i])
    return time.perf_counter() - t0


def warm_up() -> None:
    """Run every timed path once on a small store first: the first call of a compiled kernel
    loads it from numba's cache (or compiles it, seconds, on a fresh checkout), which is not
    a cost of the round."""
    for journaled in (False, True):
        for batched in (False, True):
            with tempfile.TemporaryDirectory() as d:
                store, ids = open_store(4, 130, d if journaled else None)
                if batched:
                    run_batched(store, ids, 128, lead=1)
                else:
                    run_unbatched(store, ids, 128)
                store.close()


def max_context_sweep(seqs: int, pages: int = 32) -> None:
    """The same 32-page decode under tables of 8k, 32k and 128k tokens (L = 128 .. 2048)."""
    rounds = pages * 64 - PROMPT
    cost = {}
    for m in (8192, 32768, 131072):
        best = float("inf")
        for _ in range(3):
            store, ids = open_store(seqs, rounds, None, max_context=m)
            best = min(best, run_batched(store, ids, rounds) / (seqs * rounds))
            store.check_invariants()
        cost[m] = best
        print(f"max_context {m:>6} (L={m // 64:>4}), {pages}-page context: "
              f"{best * 1e9:6.0f} ns/request-step")
    print(f"ratio 128k / 8k: {cost[131072] / cost[8192]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true",
                    help="only the max_context sweep (8k / 32k / 128k, same context)")
    a = ap.parse_args()
    warm_up()
    if a.sweep:
        max_context_sweep(a.seqs)
        return
    steps = a.seqs * a.rounds
    store, ids = open_store(a.seqs, a.rounds, None)
    t_off = run_batched(store, ids, a.rounds)
    store.check_invariants()
    with tempfile.TemporaryDirectory() as d:
        store, ids = open_store(a.seqs, a.rounds, d)
        t_on = run_batched(store, ids, a.rounds)
        jbytes = store.journal.bytes_written if store.journal else 0
        store.check_invariants()
        store.close()
    t_stag = {}
    for journaled in (False, True):
        with tempfile.TemporaryDirectory() as d:
            store, ids = open_store(a.seqs, a.rounds, d if journaled else None, stagger=True)
            t_stag[journaled] = run_batched(store, ids, a.rounds, stagger=True)
            store.check_invariants()
            store.close()
    with tempfile.TemporaryDirectory() as d:
        store, ids = open_store(a.seqs, a.rounds, d)
        t_mtp = run_batched(store, ids, a.rounds - 2, lead=1)
        store.check_invariants()
        store.close()
    t_commit = {}
    for every in (False, True):  # sync=commit: durable records only (now) / every record
        saved = core.changes_what_survives
        if every:
            core.changes_what_survives = lambda events, st: True
        try:
            with tempfile.TemporaryDirectory() as d:
                store, ids = open_store(a.seqs, a.rounds // 8, d, sync=SyncPolicy.COMMIT)
                t_commit[every] = run_batched(store, ids, a.rounds // 8)
                store.close()
        finally:
            core.changes_what_survives = saved
    store, ids = open_store(a.seqs, a.rounds // 8, None)
    t_one = run_unbatched(store, ids, a.rounds // 8)
    print(f"C={a.seqs} sequences x {a.rounds} rounds = {steps:,} request-steps "
          f"({a.seqs * (a.rounds // 64 + 1):,} page crossings)")
    print(f"batched, journal off        : {t_off / steps * 1e9:8.0f} ns/request-step")
    print(f"batched, journal on (sync=off): {t_on / steps * 1e9:8.0f} ns/request-step  "
          f"(ratio on/off {t_on / t_off:.2f}; {jbytes / steps:.1f} journal bytes/step)")
    print(f"staggered crossings (~C/64 a round), journal off / on: "
          f"{t_stag[False] / steps * 1e9:8.0f} / {t_stag[True] / steps * 1e9:.0f} ns/request-step")
    mtp = t_mtp / (a.seqs * (a.rounds - 2))
    print(f"batched + provisional lead (MTP), journal on: {mtp * 1e9:8.0f} ns/request-step  "
          f"(ratio to the plain round {mtp / (t_on / steps):.2f})")
    per8 = steps // 8
    print(f"batched, journal on (sync=commit, durable records): "
          f"{t_commit[False] / per8 * 1e9:8.0f} ns/request-step")
    print(f"batched, journal on (sync=commit, every record)   : "
          f"{t_commit[True] / per8 * 1e9:8.0f} ns/request-step  "
          f"(ratio every/durable {t_commit[True] / t_commit[False]:.2f})")
    print(f"unbatched, journal off      : {t_one / (steps // 8) * 1e9:8.0f} ns/request-step  "
          f"(ratio unbatched/batched {t_one / (steps // 8) / (t_off / steps):.1f}x)")


if __name__ == "__main__":
    main()
