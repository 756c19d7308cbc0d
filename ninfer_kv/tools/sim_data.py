"""The simulator's data: a trace request, the Mooncake trace loader, the options and the
result of ``tools.simulate.simulate``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer_kv.errors import InvalidArgument

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    arrival_ms: int
    prompt: int
    output: int
    hash_ids: tuple[int, ...]


def _count(d: dict, name: str, lo: int) -> int:
    """Field ``name`` of a trace line: a finite number (an integral one for a length), at
    least ``lo``."""
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v in (_INF, -_INF):
        raise ValueError(f"{name}={v!r} is not a finite number")
    if name != "timestamp" and v != int(v):
        raise ValueError(f"{name}={v!r} is not an integer")
    if v < lo:
        raise ValueError(f"{name}={v!r} must be >= {lo}")
    return int(v)


_INF = float("inf")


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Mooncake jsonl: one object per line with timestamp, input_length (>= 1),
    output_length and hash_ids (integers). A malformed line — not UTF-8, not JSON, a field
    missing, of the wrong type, infinite or out of range — is an ``InvalidArgument`` naming
    the file and line."""
    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if limit is not None and i >= limit:
                break
            try:
                d = json.loads(raw.decode("utf-8"))
                if not isinstance(d, dict):
                    raise TypeError("not a JSON object")
                ids = d["hash_ids"]
                if not isinstance(ids, list) or any(type(h) is not int for h in ids):
                    raise TypeError("hash_ids must be a list of integers")
                req = Request(i, _count(d, "timestamp", 0), _count(d, "input_length", 1),
                              max(1, _count(d, "output_length", 0)), tuple(ids))
            except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError included
                raise InvalidArgument(f"{path}:{i + 1}: not a Mooncake trace line "
                                      f"({type(exc).__name__}: {exc})") from None
            out.append(req)
    return out


@dataclass(slots=True)
class SimOptions:
    max_concurrency: int = 32
    max_context: int = 131072
    kv_tokens: int = 1 << 22
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    mtp: bool = False
    draft_window: int = 4
    accept_rate: float = 0.7
    offload: bool = False
    share: bool = False  # live sharing: a prompt's whole blocks become a checkpoint at prefill
    host_bytes: int = 1 << 30
    round_ms: float = 25.0
    seed: int = 0
    journal_dir: str | None = None
    allocate_planes: bool = False
    scale: int = 1
    """Divide prompt/output lengths and the 512-token hash block by this (small demos)."""
    checked: bool = False
    """StoreConfig.checked: kernel writes are checked against their writer (the demo)."""
    lease_growth: bool = True
    """kv_lease_growth (§6.2): a request is entitled its frontier + ``lease_window`` and grows
    every round; when the pool cannot grow it, the retention policy frees checkpoints, then
    the most recently admitted request is preempted (swapped to the host tier, or retained
    for the retention policy to keep or recompute). False: the whole prompt + output budget
    is reserved at admission and nothing is ever preempted."""
    lease_window: int = 4096


@dataclass(slots=True)
class SimResult:
    requests: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    ideal_hit_tokens: int = 0
    """What an unbounded cache would reuse: each prompt's longest block prefix seen before."""
    refused_admissions: int = 0
    """Times a waiting request could not be admitted and nothing was left to free."""
    swaps: int = 0
    """Running requests preempted (swapped out) so others could grow (lease growth only)."""
    swap_ins: int = 0
    """Preempted requests resumed from their checkpoint (the rest were recomputed)."""
    recomputed: int = 0
    """Preempted requests whose checkpoint the retention policy released: prefilled again."""
    output_tokens: int = 0
    rounds: int = 0
    request_steps: int = 0
    peak_occupancy: float = 0.0
    evictions: int = 0
    demotions: int = 0
    offloaded_pages: int = 0
    cow_copies: int = 0
    activations: int = 0
    store_seconds: float = 0.0
    activation_seconds: float = 0.0
    journal_bytes: int = 0
    digest: str = ""
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "skipped": self.skipped,
            "prompt_tokens": self.prompt_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_ratio": round(self.hit_ratio, 4),
            "ideal_hit_ratio": round(self.ideal_hit_tokens / max(1, self.prompt_tokens), 4),
            "refused_admissions": self.refused_admissions, "swaps": self.swaps,
            "swap_ins": self.swap_ins, "recomputed": self.recomputed,
            "output_tokens": self.output_tokens,
            "rounds": self.rounds, "request_steps": self.request_steps,
            "peak_occupancy": round(self.peak_occupancy, 4), "evictions": self.evictions,
            "demotions": self.demotions, "offloaded_pages": self.offloaded_pages,
            "cow_copies": self.cow_copies, "activations": self.activations,
            "us_per_request_step": round(self.store_seconds / max(1, self.request_steps) * 1e6, 3),
            "us_per_activation": round(self.activation_seconds / max(1, self.activations) * 1e6,
                                       1),
            "journal_bytes": self.journal_bytes, "digest": self.digest,
        }
