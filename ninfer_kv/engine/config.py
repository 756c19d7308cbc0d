"""Store configuration and the recovery report."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ninfer_kv.engine.capacity import (
    DEFAULT_KV_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_SERVING,
    CapacityPlan,
    ModelGeometry,
    ServingConfig,
    plan_automatic,
    plan_explicit,
)
from ninfer_kv.errors import KVStoreError
from ninfer_kv.journal.log import SyncPolicy


class InvariantViolation(KVStoreError):
    """check_invariants() found a broken §14 invariant (a bug, never bad input)."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    model: ModelGeometry = DEFAULT_MODEL
    serving: ServingConfig = DEFAULT_SERVING
    kv_tokens: int | None = None
    """Explicit policy (K_main tokens). Default when neither policy is given: 65536 (or S)."""
    free_bytes: int | None = None
    """Automatic policy: F, with ``headroom`` R."""
    headroom: int = 0
    device: str = "cpu"
    journal_dir: str | None = None
    """None = no journal (events are applied and dropped)."""
    sync: SyncPolicy = SyncPolicy.OFF
    segment_bytes: int = 64 << 20
    allocate_planes: bool = True
    snapshot_every: int = 0
    """Write a snapshot every N records (0 = only on request)."""
    lease_growth: bool = False
    """kv_lease_growth (spec §6.2): entitle frontier + window + cushion, grow at round ends."""
    lease_window: int = 4096
    lease_cushion: int = 64
    """Per-lane cushion: covers the step about to launch and one forced control span."""
    host_bytes: int = 0
    """Host arena capacity (spec §3.3); 0 = no host tier."""
    persist_dir: str | None = None
    """Persistence: journal in ``<dir>/journal``, host arena file ``<dir>/host_arena.bin``
    (mmap). Inactive checkpoints with published host replicas survive a crash."""

    @property
    def journal_path(self) -> str | None:
        if self.journal_dir is not None:
            return self.journal_dir
        return None if self.persist_dir is None else os.path.join(self.persist_dir, "journal")

    def plan(self) -> CapacityPlan:
        if self.free_bytes is not None:
            return plan_automatic(self.model, self.serving, self.free_bytes, self.headroom)
        tokens = self.kv_tokens if self.kv_tokens is not None else max(
            DEFAULT_KV_TOKENS, self.serving.max_context)
        return plan_explicit(self.model, self.serving, tokens)


@dataclass(slots=True)
class RecoveryReport:
    records: int = 0
    snapshot_seq: int = 0
    cuts: list[str] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
