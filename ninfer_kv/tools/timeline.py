"""The timeline of a journal: per-record pool occupancy, host arena use and prefix-hit ratio
(``timeline``), drawn by ``plot`` (``ninfer-kv plot``, the demo)."""

from __future__ import annotations

from typing import Any

from ninfer_kv.journal import events as ev
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay_start
from ninfer_kv.replay.core import apply_event


def timeline(directory: str, max_points: int = 2000, from_snapshot: bool = False
             ) -> dict[str, Any]:
    """Per-record series: pool occupancy (allocated, allocated+reserved over capacity), host
    arena use, and the cumulative prefix-hit ratio (Fork/Move frontier over prompt tokens)."""
    reader = JournalReader(directory, from_snapshot=from_snapshot)
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


def plot(directory: str, output: str, from_snapshot: bool = False) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = timeline(directory, from_snapshot=from_snapshot)
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
