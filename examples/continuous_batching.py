"""Continuous batching over ninfer-kv's public API, with a toy model (random K/V/Q per layer).

Each step is one GPU unit: admit what fits, map the new tokens (ensure_mapped_many), publish
tables at the boundary, append every layer's K/V and attend (append_kv, paged_decode), then
commit. Finished requests are kept as checkpoints; a later request continues one at a
mid-page frontier (Fork: the shared pages are reused, the tail is copied). Every attention
output is checked against plain softmax attention over the same (bf16-rounded) K/V.

    python examples/continuous_batching.py
"""

import torch

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig, append_kv, paged_decode, warmup

LAYERS, HKV, HQ, D = 2, 2, 4, 64
warmup(["bf16"])  # compile or load the kernels before serving
store = KVStore.open(StoreConfig(model=ModelGeometry(layers=LAYERS, kv_heads=HKV, head_dim=D),
                                 serving=ServingConfig(max_context=1024, max_concurrency=4),
                                 kv_tokens=64 * 64, checked=True))
gen = torch.Generator().manual_seed(0)
history: dict[int, list[list[torch.Tensor]]] = {}  # seq -> per layer [K, V] as written
worst = 0.0


def unit(seqs: list[int], new: dict[int, int]) -> None:
    """One GPU unit over ``seqs``: ``new[s]`` tokens each (a prompt chunk or one decode token)."""
    global worst
    start = {s: store.checkpoint_info(s).frontier for s in seqs}
    end = [start[s] + new[s] for s in seqs]
    store.ensure_mapped_many("main", seqs, end)                    # before launch (§8.1)
    with store.boundary():                                         # tables published, frozen
        flat = [s for s in seqs for _ in range(new[s])]
        rows = store.table_rows("main", flat)                      # int32 [tokens]
        pos = torch.tensor([start[s] + i for s in seqs for i in range(new[s])])
        q = torch.randn(len(seqs), HQ, D, generator=gen)           # the last token's query
        for layer in range(LAYERS):
            view = store.batch_view("main", layer)
            k, v = torch.randn(2, len(flat), HKV, D, generator=gen)
            append_kv(view, rows, pos, k, v)
            out = paged_decode(q, view, store.table_rows("main", seqs),
                               torch.tensor(end, dtype=torch.int32))
            for i, s in enumerate(seqs):
                kv = history[s][layer]
                mine = [j for j, x in enumerate(flat) if x == s]
                kv[0], kv[1] = torch.cat([kv[0], k[mine]]), torch.cat([kv[1], v[mine]])
                kk, vv = (t.bfloat16().float().repeat_interleave(HQ // HKV, 1) for t in kv)
                w = torch.softmax(torch.einsum("hd,thd->ht", q[i], kk) / D ** 0.5, -1)
                want = torch.einsum("ht,thd->hd", w, vv)
                worst = max(worst, (out[i] - want).abs().max().item())
    store.commit_many("main", seqs, end)                           # after the unit succeeded


def admit(prompt: int, out: int, parent: tuple[int, int] | None = None) -> int:
    if parent is None:
        s = store.activate(prompt, out)
        history[s] = [[torch.empty(0, HKV, D), torch.empty(0, HKV, D)] for _ in range(LAYERS)]
    else:  # continue a retained checkpoint: its first `frontier` tokens are reused
        ck, frontier = parent
        s = store.activate_from(ck, frontier, prompt, out)
        history[s] = [[t[:frontier] for t in kv] for kv in history[ck]]
    store.set_metadata(s, {"prompt": prompt, "output": out})     # kept with a checkpoint
    return s


arrivals = {0: [(150, 6)], 1: [(70, 4)], 3: [(200, 3)]}  # step -> (prompt, output) requests
running: dict[int, int] = {}  # seq -> tokens still to generate
kept: list[int] = []
for step in range(14):
    fresh = [admit(p, o) for p, o in arrivals.get(step, [])]
    if step == 9:  # a new request that shares the first 90 tokens of a finished one
        donor = next(c for c in kept if store.checkpoint_info(c).frontier >= 90)
        fresh.append(admit(120, 3, parent=(donor, 90)))
    new = {s: 1 for s in running}  # decode: one token each
    for s in fresh:  # prefill: the prompt tokens not already reused
        meta = store.checkpoint_info(s).metadata
        new[s] = meta["prompt"] - store.checkpoint_info(s).frontier
        running[s] = meta["output"]
    if new:
        unit(list(new), new)
    for s in list(running):
        running[s] -= 1
        if running[s] == 0:
            del running[s]
            kept.append(store.finish(s, retain=True))              # immutable checkpoint

info = store.checkpoint_info(kept[-1])
print(f"{len(kept)} requests, {store.metrics().records} boundaries, last checkpoint "
      f"{info.frontier} tokens (parent {info.parent}), max |error| {worst:.2e}")
store.close()
assert worst < 1e-3, worst
print("ok")
