"""Run tools: ``simulate`` (drive a store with a Mooncake trace), ``plot`` (timeline of a
journal) and ``demo`` (the main job: simulate, run kernels, replay, plot)."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from ninfer_kv.errors import InvalidArgument
from ninfer_kv.tools.argtypes import FROM_SNAPSHOT_HELP, fraction, non_negative, positive
from ninfer_kv.tools.output import emit_json
from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, simulate
from ninfer_kv.tools.timeline import plot

Command = Callable[[argparse.Namespace, Console], int]
_SIM_DEFAULTS: dict[str, object] = {}
"""``simulate``'s option defaults (filled in by ``register``)."""


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
    p.add_argument("--share", action="store_true",
                   help="live prefix sharing: share each prompt's whole blocks at prefill")
    p.add_argument("--host-bytes", type=non_negative, default=1 << 30)
    p.add_argument("--no-lease-growth", action="store_true",
                   help="reserve each request's whole budget at admission (no preemption)")
    p.add_argument("--lease-window", type=positive, default=4096,
                   help="kv_lease_growth window in tokens (§6.2)")
    p.add_argument("--scale", type=positive, default=1, help="divide lengths by this")
    p.add_argument("--tp", type=positive, default=1,
                   help="TP replicas on N local gloo processes (docs/multi-gpu.md)")
    p.add_argument("--disagg", action="store_true",
                   help="prefill/decode disaggregation: checkpoint transfer between 2 processes")
    p.add_argument("--standby", action="store_true",
                   help="with --tp: the last rank is a standby, promoted once the stream ends")
    p.add_argument("--json", action="store_true")
    _SIM_DEFAULTS.update({x.dest: x.default for x in p._actions if x.dest != "help"})
    p = sub.add_parser("plot", help="occupancy and prefix-hit ratio over boundaries (PNG)")
    p.add_argument("dir")
    p.add_argument("-o", "--output", default="timeline.png")
    p.add_argument("--from-snapshot", action="store_true", help=FROM_SNAPSHOT_HELP)
    p.add_argument("--json", action="store_true", help="print the plotted data as JSON")
    p = sub.add_parser("demo", help="the main job on a small default model (CPU)")
    p.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    p.add_argument("--requests", type=positive, default=120)
    p.add_argument("--json", action="store_true")
    return {"simulate": run_simulate, "plot": run_plot, "demo": run_demo}


def sim_options(a: argparse.Namespace) -> SimOptions:
    return SimOptions(max_concurrency=a.max_concurrency, max_context=a.max_context,
                      kv_tokens=a.kv_tokens, mtp=a.mtp, accept_rate=a.accept_rate,
                      offload=a.offload, share=a.share, host_bytes=a.host_bytes, seed=a.seed,
                      journal_dir=a.journal, scale=a.scale, lease_growth=not a.no_lease_growth,
                      lease_window=a.lease_window)


_DIST_OPTIONS = {"limit", "seed", "tp", "disagg", "standby", "json", "command", "func"}
"""What ``simulate --tp`` / ``--disagg`` reads (its own small synthetic workload)."""


def run_simulate(a: argparse.Namespace, console: Console) -> int:
    dist = a.tp > 1 or a.disagg
    if a.standby and a.tp < 2:
        raise InvalidArgument("simulate: --standby needs --tp 2 or more (the last rank stands by)")
    if dist:  # refuse what it would silently ignore
        ignored = sorted(f"--{k.replace('_', '-')}" for k, v in vars(a).items()
                         if k not in _DIST_OPTIONS and k in _SIM_DEFAULTS
                         and v != _SIM_DEFAULTS[k])
        if ignored:
            raise InvalidArgument(f"simulate --tp/--disagg runs its own synthetic workload: "
                                  f"{', '.join(ignored)} would be ignored")
        from ninfer_kv.tools.dist_sim import run_cli

        return run_cli(a, console)
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
def run_plot(a: argparse.Namespace, console: Console) -> int:
    if not a.output.lower().endswith(".png") or a.output.lower() == ".png":
        raise InvalidArgument(f"plot: -o {a.output!r} must name a .png file (it writes a PNG)")
    data = plot(a.dir, a.output, a.from_snapshot)
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
