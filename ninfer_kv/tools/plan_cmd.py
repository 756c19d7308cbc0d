"""``ninfer-kv plan``: the capacity plan of spec §3.2/§3.3 as a table or one JSON object."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from ninfer_kv.engine.capacity import (
    DEFAULT_MODEL,
    DEFAULT_SERVING,
    Backend,
    CapacityPlan,
    ModelGeometry,
    ServingConfig,
    default_kv_tokens,
    parse_bytes,
    plan_automatic,
    plan_explicit,
)
from ninfer_kv.engine.layout import Profile
from ninfer_kv.errors import ConfigError
from ninfer_kv.tools.argtypes import int_at_least
from ninfer_kv.tools.output import emit_json

MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 4096  # far above any model: a typo's bound


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    m, s = DEFAULT_MODEL, DEFAULT_SERVING
    # bounded: the plane inventory is per layer and head (a huge value would never return)
    p.add_argument("--layers", type=int_at_least(1, MAX_LAYERS), default=m.layers,
                   help="main full-attention layers")
    p.add_argument("--kv-heads", type=int_at_least(1, MAX_HEADS), default=m.kv_heads)
    p.add_argument("--head-dim", type=int_at_least(1, MAX_HEAD_DIM), default=m.head_dim)
    p.add_argument("--profile", default=m.profile.value, choices=[x.value for x in Profile])
    p.add_argument("--backend", default=s.backend.value, choices=[b.value for b in Backend])
    p.add_argument("--mtp-layers", type=int_at_least(0, MAX_LAYERS), default=m.mtp_layers)
    p.add_argument("--draft-window", type=int, default=s.draft_window)
    p.add_argument("--draft-layers", type=int_at_least(0, MAX_LAYERS), default=m.draft_layers,
                   help="draft full-attention layers (0 = DFlash2: no Draft Full pool)")
    p.add_argument("--draft-kv-heads", type=int_at_least(0, MAX_HEADS), default=m.draft_kv_heads)
    p.add_argument("--draft-head-dim", type=int_at_least(0, MAX_HEAD_DIM),
                   default=m.draft_head_dim)
    p.add_argument("--max-context", type=int, default=s.max_context, help="S")
    p.add_argument("--max-concurrency", type=int, default=s.max_concurrency, help="C")


def geometry_from_args(a: argparse.Namespace) -> tuple[ModelGeometry, ServingConfig]:
    model = ModelGeometry(a.layers, a.kv_heads, a.head_dim, Profile.parse(a.profile),
                          a.mtp_layers, a.draft_layers, a.draft_kv_heads, a.draft_head_dim)
    serving = ServingConfig(a.max_context, a.max_concurrency, Backend(a.backend), a.draft_window)
    return model, serving


def plan_from_args(a: argparse.Namespace) -> CapacityPlan:
    model, serving = geometry_from_args(a)
    if a.free_bytes is not None or a.headroom is not None:
        if a.kv_tokens is not None:
            raise ConfigError("give either --kv-tokens (explicit) or --free-bytes/--headroom")
        if a.free_bytes is None:
            raise ConfigError("--headroom needs --free-bytes (automatic policy)")
        return plan_automatic(model, serving, parse_bytes(a.free_bytes),
                              parse_bytes(a.headroom or "0"))
    return plan_explicit(model, serving, a.kv_tokens if a.kv_tokens is not None
                         else default_kv_tokens(serving))


def register(sub: argparse._SubParsersAction) -> tuple[str, Callable[..., int]]:
    p = sub.add_parser("plan", help="print the capacity plan (spec §3.2, §3.3)",
                       description="Capacity plan. Default: a small documented model "
                       "(8 layers, 4 KV heads, head dim 128, BF16, S=8192, C=8, 65536 KV tokens).")
    add_geometry_args(p)
    p.add_argument("--kv-tokens", type=int, default=None, help="explicit policy: K_main tokens")
    p.add_argument("--free-bytes", default=None, help="automatic policy: F (e.g. 80GiB)")
    p.add_argument("--headroom", default=None, help="automatic policy: R (e.g. 2GiB)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return "plan", run


def run(a: argparse.Namespace, console: Console) -> int:
    plan = plan_from_args(a)
    d = plan.to_dict()
    if a.json:
        emit_json(d)
        return 0
    t = Table(title=f"capacity plan ({d['policy']}, profile {d['profile']}, backend {d['backend']})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for key in ("S", "C", "P", "L", "M_min", "M_max", "M", "token_capacity", "B_min", "B_step",
                "total_bytes"):
        t.add_row(key, f"{d[key]:,}")
    bpt = d["bytes_per_token_head"]
    t.add_row("bytes/token/head K+V", f"{bpt['k']} + {bpt['v']} = {bpt['k'] + bpt['v']}")
    console.print(t)
    pt = Table(title="pools")
    for col in ("pool", "order", "layers", "physical_pages", "page_bytes", "total_bytes"):
        pt.add_column(col, justify="right" if col not in ("pool", "order") else "left")
    for name, pool in d["pools"].items():
        pt.add_row(name, pool["order"], str(pool["layers"]), f"{pool['physical_pages']:,}",
                   f"{pool['page_bytes']:,}", f"{pool['total_bytes']:,}")
    console.print(pt)
    return 0
