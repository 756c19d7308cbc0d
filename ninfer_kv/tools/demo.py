"""``ninfer-kv demo``: the main job on the embedded default (CPU, a small model geometry).

1. Simulate a slice of the bundled Mooncake trace with MTP speculation and the host tier
   (offload, demotion under device pressure, restore on reuse), journaling every event.
2. Run the kernels on the store's real plane tensors for a sample of steps: paged append
   through published block tables, then paged decode attention checked against torch on the
   same K/V kept contiguously.
3. Replay the journal offline (no tensors) and show that the replayed digest equals the live
   one; plot the timeline.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import CapacityExhausted
from ninfer_kv.replay import replay
from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, simulate


def demo_options(journal: str) -> SimOptions:
    return SimOptions(max_concurrency=8, max_context=16384, kv_tokens=65536, layers=2,
                      kv_heads=2, head_dim=64, mtp=True, draft_window=4, accept_rate=0.7,
                      offload=True, host_bytes=192 << 20, journal_dir=journal,
                      allocate_planes=True, scale=4, checked=True)


def kernel_sample(store: KVStore, seqs_n: int = 4, seed: int = 0) -> dict[str, Any]:
    """Append + decode through store-built views; compare with contiguous attention."""
    from ninfer_kv.kernels.append import append_kv
    from ninfer_kv.kernels.attention import paged_decode

    gen = torch.Generator().manual_seed(seed)
    seqs = []
    while len(seqs) < seqs_n:
        try:
            seqs.append(store.activate(150 + 37 * len(seqs), 64))
        except CapacityExhausted:
            victims = store.checkpoints()
            if not victims:
                raise
            store.release(victims[0])
    layers = store.config.model.layers
    heads, d = store.config.model.kv_heads, store.config.model.head_dim
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {s: [] for s in seqs}
    frontier = dict.fromkeys(seqs, 0)
    steps = 0
    for n in (None, 1, 1, 1, 7, 1):  # prefill, decode steps, a verify-sized chunk
        for s in seqs:
            m = n or 150 + 37 * seqs.index(s)
            store.ensure_mapped(s, "main", frontier[s] + m)
        with store.boundary():
            for s in seqs:
                m = n or 150 + 37 * seqs.index(s)
                pos = torch.arange(frontier[s], frontier[s] + m)
                rows = store.table_rows("main", [s] * m)
                per_layer = []
                for layer in range(layers):
                    k = torch.randn(m, heads, d, generator=gen)
                    v = torch.randn(m, heads, d, generator=gen)
                    append_kv(store.batch_view("main", layer), rows, pos, k, v)
                    per_layer.append((k, v))
                kv[s].append(per_layer)  # type: ignore[arg-type]
        for s in seqs:
            frontier[s] += n or 150 + 37 * seqs.index(s)
            store.commit(s, "main", frontier[s])
        steps += 1
    q = torch.randn(len(seqs), heads * 2, d, generator=gen)
    worst = 0.0
    for layer in range(layers):
        out = paged_decode(q, store.batch_view("main", layer), store.table_rows("main", seqs),
                           torch.tensor([frontier[s] for s in seqs]))
        for i, s in enumerate(seqs):
            k = torch.cat([step[layer][0] for step in kv[s]]).bfloat16().float()  # type: ignore[index]
            v = torch.cat([step[layer][1] for step in kv[s]]).bfloat16().float()  # type: ignore[index]
            kk = k.repeat_interleave(2, 1).permute(1, 0, 2)
            vv = v.repeat_interleave(2, 1).permute(1, 0, 2)
            w = torch.softmax(kk @ q[i].unsqueeze(-1) / math.sqrt(d), 1)
            want = (w * vv).sum(1)
            worst = max(worst, (out[i] - want).abs().max().item())
    for s in seqs:
        store.finish(s, retain=False)
    with store.boundary():
        pass
    return {"sequences": len(seqs), "steps": steps, "layers": layers,
            "max_abs_error": worst, "ok": worst < 1e-3}


def demo(out: str, requests: int = 120, console: Console | None = None) -> dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    journal = os.path.join(out, "journal")
    png = os.path.join(out, "timeline.png")
    t0 = time.perf_counter()
    reqs = load_trace(DEFAULT_TRACE, requests)
    store, res = simulate(reqs, demo_options(journal))
    ks = kernel_sample(store)
    store.check_invariants()
    live = store.digest()
    stats = dict(store.stats)
    store.close()
    rep = replay(journal, verify_every=500)
    from ninfer_kv.tools.timeline import plot

    plot(journal, png)
    result = {**res.to_dict(), "kernel": ks, "kernel_ok": ks["ok"], "live_digest": live,
              "replay_digest": rep.digest, "replay_events": rep.events,
              "replay_events_per_s": round(rep.events_per_s),
              "replay_violations": len(rep.violations), "journal": journal, "plot": png,
              "d2h_pages": stats["d2h_pages"], "h2d_pages": stats["h2d_pages"],
              "seconds": round(time.perf_counter() - t0, 1)}
    if console is not None:
        _print(console, result)
    return result


def _print(console: Console, r: dict[str, Any]) -> None:
    t = Table(title="ninfer-kv demo: Mooncake trace slice, MTP speculation, host tier")
    t.add_column("")
    t.add_column("", justify="right")
    for k in ("requests", "prompt_tokens", "prefix_hit_tokens", "prefix_hit_ratio", "rounds",
              "request_steps", "cow_copies", "evictions", "demotions", "offloaded_pages",
              "d2h_pages", "h2d_pages", "peak_occupancy", "us_per_request_step",
              "journal_bytes"):
        v = r[k]
        t.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    console.print(t)
    k = r["kernel"]
    console.print(f"kernels: {k['sequences']} sequences x {k['steps']} steps x {k['layers']} "
                  f"layers through store views: paged decode vs contiguous torch max |err| = "
                  f"{k['max_abs_error']:.2e} -> " + ("[green]ok[/green]" if k["ok"]
                                                      else "[red]FAILED[/red]"))
    same = r["live_digest"] == r["replay_digest"]
    console.print(f"replay: {r['replay_events']:,} events ({r['replay_events_per_s']:,}/s), "
                  f"{r['replay_violations']} invariant violations; digest "
                  f"{r['replay_digest']} " + ("[green]== live digest[/green]" if same
                                              else f"[red]!= live {r['live_digest']}[/red]"))
    console.print(f"journal: {r['journal']}\nplot:    {r['plot']}\n({r['seconds']} s)")
