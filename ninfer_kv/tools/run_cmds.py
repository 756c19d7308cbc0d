"""Run tools: ``simulate`` (drive a store with a Mooncake trace), ``plot`` (timeline of a
journal) and ``demo`` (the main job: simulate, run kernels, replay, plot)."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from ninfer_kv.journal import events as ev
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay_start
from ninfer_kv.replay.core import apply_event
from ninfer_kv.tools.argtypes import fraction, non_negative, positive
from ninfer_kv.tools.output import emit_json
from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, simulate

Command = Callable[[argparse.Namespace, Console], int]


def register(sub: argparse._SubParsersAction) -> dict[str, Command]:
    p = sub.add_parser("simulate", help="drive the store with a Mooncake-format trace")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--journal", default=None, help="write the journal to this directory")
    p.add_argument("--limit", type=non_negative, default=None, help="first N requests")
    p.add_argument("--seed", type=non_negative, default=0)
    p.add_argument("--max-concurrency", type=positive, default=32)
    p.add_argument("--max-context", type=positive, default=131072)
    p.add_argument("--kv-tokens", type=positive, default=1 << 22)
    p.add_argument("--mtp", action="store_true", help="MTP speculation (draft window 4)")
    p.add_argument("--accept-rate", type=fraction, default=0.7)
    p.add_argument("--offload", action="store_true", help="host tier: offload + demote")
    p.add_argument("--host-bytes", type=non_negative, default=1 << 30)
    p.add_argument("--scale", type=positive, default=1, help="divide lengths by this")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("plot", help="occupancy and prefix-hit ratio over boundaries (PNG)")
    p.add_argument("dir")
    p.add_argument("-o", "--output", default="timeline.png")
    p.add_argument("--json", action="store_true", help="print the plotted data as JSON")
    p = sub.add_parser("demo", help="the main job on a small default model (CPU)")
    p.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    p.add_argument("--requests", type=positive, default=120)
    p.add_argument("--json", action="store_true")
    return {"simulate": run_simulate, "plot": run_plot, "demo": run_demo}


def sim_options(a: argparse.Namespace) -> SimOptions:
    return SimOptions(max_concurrency=a.max_concurrency, max_context=a.max_context,
                      kv_tokens=a.kv_tokens, mtp=a.mtp, accept_rate=a.accept_rate,
                      offload=a.offload, host_bytes=a.host_bytes, seed=a.seed,
                      journal_dir=a.journal, scale=a.scale)


def run_simulate(a: argparse.Namespace, console: Console) -> int:
    reqs = load_trace(a.trace, a.limit)
    store, res = simulate(reqs, sim_options(a))
    store.close()
    d = res.to_dict()
    if a.json:
        emit_json(d)
        return 0
    t = Table(title=f"simulate {os.path.basename(a.trace)} ({len(reqs)} requests)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in d.items():
        t.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    console.print(t)
    if a.journal:
        console.print(f"journal: {a.journal}")
    return 0


# --- plot ----------------------------------------------------------------------------------------
def timeline(directory: str, max_points: int = 2000) -> dict[str, Any]:
    """Per-record series: pool occupancy (allocated, allocated+reserved over capacity), host
    arena use, and the cumulative prefix-hit ratio (Fork/Move frontier over prompt tokens)."""
    reader = JournalReader(directory)
    step = max(1, reader.last_seq // max_points)
    st, start = replay_start(reader)
    data: dict[str, Any] = {"record": [], "pools": {}, "host_used": [], "prefix_hit_ratio": []}
    hit = prompt = 0
    for seq, events in reader.records(start):
        for i, e in enumerate(events):
            if isinstance(e, ev.Activate) and e.pool == "main":
                prompt += e.prompt
            elif isinstance(e, ev.Fork | ev.Move) and e.pool == "main":
                hit += e.frontier
            apply_event(st, e, seq, i)
        if seq % step and seq != reader.last_seq:
            continue
        data["record"].append(seq)
        for name, p in st.pools.items():
            d = data["pools"].setdefault(name, {"allocated": [], "used": []})
            d["allocated"].append(p.allocated / p.capacity)
            d["used"].append((p.allocated + p.reserved) / p.capacity)
        data["host_used"].append(st.host.live_bytes / st.host.capacity
                                 if st.host is not None and st.host.capacity else 0.0)
        data["prefix_hit_ratio"].append(hit / prompt if prompt else 0.0)
    return data


def plot(directory: str, output: str) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = timeline(directory)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    x = data["record"]
    for name, d in data["pools"].items():
        ax1.plot(x, d["used"], label=f"{name}: allocated+reserved")
        ax1.plot(x, d["allocated"], linestyle="--", label=f"{name}: allocated")
    if any(data["host_used"]):
        ax1.plot(x, data["host_used"], label="host arena")
    ax1.set_ylabel("fraction of capacity")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="lower right", fontsize=8)
    ax2.plot(x, data["prefix_hit_ratio"], color="tab:green")
    ax2.set_ylabel("prefix-hit ratio (cumulative)")
    ax2.set_xlabel("journal record (GPU boundary)")
    fig.suptitle(f"ninfer-kv timeline: {directory}")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return data


def run_plot(a: argparse.Namespace, console: Console) -> int:
    data = plot(a.dir, a.output)
    if a.json:
        emit_json({"output": a.output, **data})
    else:
        console.print(f"wrote {a.output} ({len(data['record'])} points)")
    return 0


# --- demo ----------------------------------------------------------------------------------------
def run_demo(a: argparse.Namespace, console: Console) -> int:
    from ninfer_kv.tools.demo import demo

    out = a.out or tempfile.mkdtemp(prefix="ninfer-kv-demo-")
    result = demo(out, a.requests, console=None if a.json else console)
    if a.json:
        emit_json(result)
    return 0 if result["replay_digest"] == result["live_digest"] and result["kernel_ok"] else 1
