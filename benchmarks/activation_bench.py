"""Admission cost: activation (fresh, Fork aligned, Fork mid-page) and mapping a long prompt.

Each figure is a batch of ``--seqs`` operations followed by the one boundary that publishes
them (journal record, device copies, table writes), divided by the batch: the operation plus
its boundary share, as an engine admitting ``--seqs`` requests in one step pays it. The source
checkpoint of the Forks holds a 4,096-token prompt. Mapping a prompt is shown twice: as the
difference of "activate + map" and "activate" (which also counts how the two interleave in
the caches), and timed by itself, one ``ensure_mapped`` a prompt after untimed activations.
Journal on (sync=off), control plane only (``allocate_planes=False``). Medians of
``--repeats``; measures, asserts nothing.

    python benchmarks/activation_bench.py [--seqs 64] [--repeats 7] [--prompt 4096]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.store import KVStore, StoreConfig

OUT = 256


def open_store(seqs: int, prompt: int, journal_dir: str) -> tuple[KVStore, int]:
    """A store with room for ``seqs`` sequences of prompt+OUT and one source checkpoint."""
    ctx = prompt + OUT
    cfg = StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                      serving=ServingConfig(max_context=ctx, max_concurrency=seqs + 1),
                      kv_tokens=(seqs + 1) * -(-ctx // 64) * 64, journal_dir=journal_dir,
                      allocate_planes=False)
    store = KVStore.open(cfg)
    src = store.activate(prompt, OUT)
    store.ensure_mapped(src, "main", prompt)
    with store.boundary():
        pass
    store.commit(src, "main", prompt)
    ck = store.finish(src, retain=True)
    with store.boundary():
        pass
    assert ck is not None
    return store, ck


def finish_all(store: KVStore, ids: list[int]) -> None:
    """Release the measured sequences (untimed), so the next batch finds the same room."""
    for b in ids:
        store.finish(b)
    with store.boundary():
        pass


def per_op(store: KVStore, seqs: int, op: Callable[[], int]) -> float:
    """Seconds per ``op`` including its share of the boundary; the sequences are finished
    (untimed) afterwards."""
    t0 = time.perf_counter()
    ids = [op() for _ in range(seqs)]
    with store.boundary():
        pass
    dt = time.perf_counter() - t0
    finish_all(store, ids)
    return dt / seqs


def map_batch(store: KVStore, seqs: int, prompt: int, one_call: bool = True) -> float:
    """Seconds per prompt to map ``seqs`` freshly activated prompts in one
    ``ensure_mapped_many`` call (``one_call=False``: one ``ensure_mapped`` each), plus the
    boundary share (the activations are not timed)."""
    ids = [store.activate(prompt, OUT) for _ in range(seqs)]
    with store.boundary():
        pass
    t0 = time.perf_counter()
    if one_call:
        store.ensure_mapped_many("main", ids, [prompt] * seqs)
    else:
        for b in ids:
            store.ensure_mapped(b, "main", prompt)
    with store.boundary():
        pass
    dt = time.perf_counter() - t0
    finish_all(store, ids)
    return dt / seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=4096)
    a = ap.parse_args()
    n, prompt = a.seqs, a.prompt
    with tempfile.TemporaryDirectory() as d:
        store, ck = open_store(n, prompt, d)
        half = (prompt // 2) // 64 * 64

        def fresh() -> int:
            return store.activate(prompt, OUT)

        def fork_aligned() -> int:
            return store.activate_from(ck, half, prompt, OUT)

        def fork_mid_page() -> int:
            return store.activate_from(ck, half + 17, prompt, OUT)

        def map_prompt() -> int:
            b = store.activate(prompt, OUT)
            store.ensure_mapped(b, "main", prompt)
            return b

        cases = {"activate (fresh)": fresh, "activate_from, Fork aligned": fork_aligned,
                 "activate_from, Fork mid-page (COW tail)": fork_mid_page,
                 f"activate + map a {prompt}-token prompt": map_prompt}
        res = {k: statistics.median(per_op(store, n, op) for _ in range(a.repeats))
               for k, op in cases.items()}
        batched = statistics.median(map_batch(store, n, prompt) for _ in range(a.repeats))
        single = statistics.median(map_batch(store, n, prompt, False) for _ in range(a.repeats))
        store.check_invariants()
        store.close()
    print(f"{n} operations per boundary, median of {a.repeats}; target <= 10 us each")
    for k, v in res.items():
        print(f"  {k:42s} {v * 1e6:8.2f} us")
    m = res[f"activate + map a {prompt}-token prompt"] - res["activate (fresh)"]
    print(f"  {'mapping alone (difference)':42s} {m * 1e6:8.2f} us")
    print(f"  {'mapping alone, timed (one prompt a call)':42s} {single * 1e6:8.2f} us"
          "  (ensure_mapped + boundary share; the activations untimed)")
    print(f"  {f'mapping, {n} prompts in one call':42s} {batched * 1e6:8.2f} us"
          "  (ensure_mapped_many + boundary, per prompt)")


if __name__ == "__main__":
    main()
