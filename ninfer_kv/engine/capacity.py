"""Capacity planner: S, C, P, L, M_min, M_max and the two policies of spec §3.2, plus the
backend pool sizes of spec §3.3.

The automatic policy uses an affine ``SequenceCapacityCurve`` ``B(M) = B_min + (M - M_min) *
B_step`` whose two numbers come from :func:`build_layout` — the same builder that later sizes
the pools the store allocates — and the planner checks that the built layout's bytes equal
``B(M)`` at the chosen M (it never probes by allocating).
"""

from __future__ import annotations

import enum
import operator
import re
from dataclasses import dataclass, field

from ninfer_kv.engine.layout import (
    P,
    PoolGeometry,
    PoolKind,
    Profile,
    align_up,
    bytes_per_token_head,
    ceil_div,
    pool_geometry,
)
from ninfer_kv.errors import CapacityError, ConfigError


def _integer(name: str, v: object) -> int:
    if isinstance(v, bool):
        raise ConfigError(f"{name}={v!r} is not an integer")
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name}={v!r} ({type(v).__name__}) is not an integer") from None


class Backend(enum.StrEnum):
    OFF = "off"
    MTP = "mtp"
    DFLASH = "dflash"


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What the planner needs of the model. ``draft_layers == 0`` = no Draft Full pool (DFlash2)."""

    layers: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    profile: Profile = Profile.BF16
    mtp_layers: int = 1
    draft_layers: int = 0
    draft_kv_heads: int = 4
    draft_head_dim: int = 128

    def __post_init__(self) -> None:
        # a profile given by name is parsed here, so an unknown one is refused at once
        object.__setattr__(self, "profile", Profile.parse(self.profile))
        for name in ("layers", "kv_heads", "head_dim", "mtp_layers", "draft_layers",
                     "draft_kv_heads", "draft_head_dim"):
            object.__setattr__(self, name, _integer(name, getattr(self, name)))


@dataclass(frozen=True, slots=True)
class ServingConfig:
    max_context: int = 8192
    """S: the logical ceiling of one sequence in tokens."""
    max_concurrency: int = 8
    """C: active address spaces (= block-table rows) per pool."""
    backend: Backend = Backend.OFF
    draft_window: int = 4
    """K: MTP draft window (tokens proposed per round, including the bonus token)."""
    allowance_bytes: int = 0
    """Fixed state, workspace and CUDA-graph allowance, supplied by the caller (spec §3.2)."""

    def __post_init__(self) -> None:
        for name in ("max_context", "max_concurrency", "draft_window", "allowance_bytes"):
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        try:
            object.__setattr__(self, "backend", Backend(self.backend))
        except ValueError:
            raise ConfigError(f"unknown speculative backend {self.backend!r}; one of "
                              f"{', '.join(b.value for b in Backend)}") from None


DEFAULT_MODEL = ModelGeometry()
"""The documented small default: 8 full-attention layers, 4 KV heads, head dim 128, BF16."""
DEFAULT_SERVING = ServingConfig()
DEFAULT_KV_TOKENS = 65536


def _positive(**values: int) -> None:
    for name, v in values.items():
        if _integer(name, v) <= 0:
            raise ConfigError(f"{name}={v} must be positive")


JOURNAL_INT_MAX = (1 << 31) - 1
"""Token frontiers, page-group ids and rows travel in the journal's packed int32 fields."""


def validate(model: ModelGeometry, serving: ServingConfig) -> None:
    """Every rule of the geometry, checked once, before any number is derived from it."""
    _positive(layers=model.layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
              max_context=serving.max_context, max_concurrency=serving.max_concurrency)
    columns = logical_pages(serving) * P  # a frontier (committed or provisional) reaches
    if columns > JOURNAL_INT_MAX or serving.max_concurrency > JOURNAL_INT_MAX:  # L * P
        raise ConfigError(f"max_context={serving.max_context} (L * P = {columns} token "
                          f"columns) and max_concurrency={serving.max_concurrency} must stay "
                          "below 2**31: token frontiers and rows are int32 in the journal")
    _integer("draft_window", serving.draft_window)
    if _integer("allowance_bytes", serving.allowance_bytes) < 0:
        raise ConfigError(f"allowance_bytes={serving.allowance_bytes} must be >= 0")
    bytes_per_token_head(model.profile, model.head_dim)  # raises on group divisibility
    # the fields of a backend not in use are ignored, whatever they hold: a journal written
    # with one (say mtp_layers=-1 without MTP) must stay openable with the same config
    if serving.backend is Backend.MTP:
        _positive(mtp_layers=model.mtp_layers, draft_window=serving.draft_window)
    if serving.backend is Backend.DFLASH and model.draft_layers:
        if model.draft_layers < 0:
            raise ConfigError(f"draft_layers={model.draft_layers} must be >= 0")
        _positive(draft_kv_heads=model.draft_kv_heads, draft_head_dim=model.draft_head_dim)


def logical_pages(serving: ServingConfig) -> int:
    """L = ceil(S / P)."""
    return ceil_div(serving.max_context, P)


def m_range(serving: ServingConfig) -> tuple[int, int]:
    """(M_min, M_max) = (max(L, C), C * L) (spec §3.2)."""
    lp = logical_pages(serving)
    c = serving.max_concurrency
    return max(lp, c), c * lp


def backend_pages(serving: ServingConfig, model: ModelGeometry, m: int) -> dict[PoolKind, int]:
    """Physical pages per enabled pool for Main capacity M (spec §3.3)."""
    pages = {PoolKind.MAIN: m}
    if serving.backend is Backend.MTP:
        pages[PoolKind.MTP] = m + serving.max_concurrency * ceil_div(serving.draft_window - 1, P)
    elif serving.backend is Backend.DFLASH and model.draft_layers > 0:
        pages[PoolKind.DRAFT_FULL] = m
    return pages


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """The production layout for one M: pool geometries, block tables and the allowance."""

    pools: dict[PoolKind, PoolGeometry]
    block_table_bytes: int
    allowance_bytes: int

    @property
    def total_bytes(self) -> int:
        return (sum(g.total_bytes for g in self.pools.values()) + self.block_table_bytes
                + align_up(self.allowance_bytes))


def build_layout(model: ModelGeometry, serving: ServingConfig, m: int) -> DeviceLayout:
    """The one layout builder: the store allocates exactly what this returns."""
    validate(model, serving)
    pools: dict[PoolKind, PoolGeometry] = {}
    for kind, n in backend_pages(serving, model, m).items():
        if kind is PoolKind.MAIN:
            g = pool_geometry(kind, model.profile, model.layers, model.kv_heads, model.head_dim, n)
        elif kind is PoolKind.MTP:
            g = pool_geometry(kind, model.profile, model.mtp_layers, model.kv_heads,
                              model.head_dim, n)
        else:
            g = pool_geometry(kind, Profile.BF16, model.draft_layers, model.draft_kv_heads,
                              model.draft_head_dim, n)
        pools[kind] = g
    table = align_up(serving.max_concurrency * logical_pages(serving) * 4)  # int32 [C, L]
    return DeviceLayout(pools, table * len(pools), serving.allowance_bytes)


@dataclass(frozen=True, slots=True)
class CapacityCurve:
    """B(M) = B_min + (M - M_min) * B_step (spec §3.2)."""

    m_min: int
    b_min: int
    b_step: int

    def __call__(self, m: int) -> int:
        return self.b_min + (m - self.m_min) * self.b_step


def capacity_curve(model: ModelGeometry, serving: ServingConfig) -> CapacityCurve:
    m_min, _ = m_range(serving)
    b_min = build_layout(model, serving, m_min).total_bytes
    b_step = build_layout(model, serving, m_min + 1).total_bytes - b_min
    return CapacityCurve(m_min, b_min, b_step)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    model: ModelGeometry
    serving: ServingConfig
    policy: str
    m: int
    curve: CapacityCurve
    layout: DeviceLayout = field(repr=False)

    @property
    def S(self) -> int:  # noqa: N802 - the spec's names
        return self.serving.max_context

    @property
    def C(self) -> int:  # noqa: N802
        return self.serving.max_concurrency

    @property
    def L(self) -> int:  # noqa: N802
        return logical_pages(self.serving)

    @property
    def token_capacity(self) -> int:
        """Exposed Main capacity M * P token-equivalents; S stays the logical ceiling."""
        return self.m * P

    def to_dict(self) -> dict[str, object]:
        m_min, m_max = m_range(self.serving)
        k, v = bytes_per_token_head(self.model.profile, self.model.head_dim)
        return {
            "S": self.S, "C": self.C, "P": P, "L": self.L, "M_min": m_min, "M_max": m_max,
            "M": self.m, "token_capacity": self.token_capacity, "policy": self.policy,
            "profile": self.model.profile.value, "backend": self.serving.backend.value,
            "B_min": self.curve.b_min, "B_step": self.curve.b_step,
            "total_bytes": self.layout.total_bytes,
            "block_table_bytes": self.layout.block_table_bytes,
            "pools": {
                kind.value: {"physical_pages": g.capacity, "page_bytes": g.page_bytes,
                             "total_bytes": g.total_bytes, "order": g.order.value,
                             "layers": g.layers, "planes": len(g.planes)}
                for kind, g in self.layout.pools.items()
            },
            "bytes_per_token_head": {"k": k, "v": v},
            "model": {"layers": self.model.layers, "kv_heads": self.model.kv_heads,
                      "head_dim": self.model.head_dim, "mtp_layers": self.model.mtp_layers,
                      "draft_layers": self.model.draft_layers,
                      "draft_kv_heads": self.model.draft_kv_heads,
                      "draft_head_dim": self.model.draft_head_dim},
        }


GEOMETRY_KEYS = ("S", "C", "P", "L", "M", "profile", "backend", "pools", "model")
"""The plan entries a journal's pages depend on: a reopen whose plan differs in any of them
would serve another model's (or layout's) KV from the recovered host replicas."""


def geometry_mismatch(journaled: dict[str, object], planned: dict[str, object]) -> list[str]:
    """``key: journaled != planned`` for every geometry entry both plans record."""
    return [f"{k}: journal {journaled[k]!r} != config {planned[k]!r}" for k in GEOMETRY_KEYS
            if k in journaled and k in planned and journaled[k] != planned[k]]


def default_kv_tokens(serving: ServingConfig) -> int:
    """The documented default Main capacity (65536 tokens, at least S), clamped into
    [M_min, M_max] pages (§3.2) so that every valid geometry opens without a kv_tokens."""
    m_min, m_max = m_range(serving)
    return min(max(DEFAULT_KV_TOKENS, serving.max_context, m_min * P), m_max * P)


def _finish(model: ModelGeometry, serving: ServingConfig, policy: str, m: int,
            curve: CapacityCurve) -> CapacityPlan:
    big = {k.value: n for k, n in backend_pages(serving, model, m).items()
           if n > JOURNAL_INT_MAX}
    if big:
        raise CapacityError(f"pool pages {big} past 2**31 - 1: page-group ids are int32 in "
                            "the journal")
    layout = build_layout(model, serving, m)
    if layout.total_bytes != curve(m):  # the curve must describe the layout we will build
        raise CapacityError(f"layout bytes {layout.total_bytes} != B({m}) = {curve(m)}: "
                            "the capacity curve is not affine for this geometry")
    return CapacityPlan(model, serving, policy, m, curve, layout)


def plan_explicit(model: ModelGeometry, serving: ServingConfig, kv_tokens: int) -> CapacityPlan:
    """K_main tokens -> M = ceil(K_main / P); requires K_main >= S and M in [M_min, M_max]."""
    validate(model, serving)
    s = serving.max_context
    kv_tokens = _integer("kv_tokens", kv_tokens)
    if kv_tokens < s:
        raise CapacityError(f"K_main={kv_tokens} tokens < S={s}: one sequence could not reach "
                            "max_context (§3.2 requires K_main >= S)")
    m = ceil_div(kv_tokens, P)
    m_min, m_max = m_range(serving)
    if not m_min <= m <= m_max:
        raise CapacityError(f"M=ceil({kv_tokens}/{P})={m} outside [M_min={m_min}, M_max={m_max}] "
                            f"(S={s}, C={serving.max_concurrency}; §3.2)")
    return _finish(model, serving, "explicit", m, capacity_curve(model, serving))


def plan_automatic(model: ModelGeometry, serving: ServingConfig, free_bytes: int,
                   headroom: int) -> CapacityPlan:
    """M = min(M_max, M_min + floor((F - R - B_min) / B_step)); requires F >= R + B_min."""
    validate(model, serving)
    free_bytes, headroom = _integer("free_bytes", free_bytes), _integer("headroom", headroom)
    if free_bytes < 0 or headroom < 0:
        raise ConfigError(f"free_bytes={free_bytes} and headroom={headroom} must be >= 0")
    m_min, m_max = m_range(serving)
    curve = capacity_curve(model, serving)
    if free_bytes < headroom + curve.b_min:
        raise CapacityError(f"F={free_bytes} B < R={headroom} B + B_min={curve.b_min} B: "
                            f"not even M_min={m_min} pages fit (§3.2)")
    m = m_max if m_min == m_max else min(
        m_max, m_min + (free_bytes - headroom - curve.b_min) // curve.b_step)
    return _finish(model, serving, "automatic", m, curve)


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'80GiB', '512 MiB', '1.5G', '4096' -> bytes (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read a byte size from {text!r} (use e.g. 80GiB, 512MiB, 4096)")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit if unit != "B" else ""])
