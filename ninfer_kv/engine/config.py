"""Store configuration and the recovery report."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field

import torch

from ninfer_kv.engine.capacity import (
    DEFAULT_MODEL,
    DEFAULT_SERVING,
    CapacityPlan,
    ModelGeometry,
    ServingConfig,
    default_kv_tokens,
    plan_automatic,
    plan_explicit,
)
from ninfer_kv.errors import ConfigError, KVStoreError
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
    sync_interval_ms: float = 10.0
    """``sync="interval"``: a boundary fsyncs once this long passed since the last fsync."""
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
    checked: bool = False
    """Checked mode: kernel wrappers given this store's views also refuse writes below the
    writer's committed frontier and into pages the writer does not own (on in tests and the
    demo; off by default: it costs a host-side walk of every written position)."""

    def __post_init__(self) -> None:
        """Normalize and validate every field before anything is planned or opened."""
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        try:
            put("sync", SyncPolicy(self.sync))
        except ValueError:
            raise ConfigError(f"sync={self.sync!r}: must be one of "
                              f"{', '.join(p.value for p in SyncPolicy)}") from None
        ms = self.sync_interval_ms
        if type(ms) not in (int, float) or not 0 < ms < float("inf"):
            raise ConfigError(f"sync_interval_ms={ms!r}: must be a positive, finite number")
        put("sync_interval_ms", float(ms))
        ints = {"headroom": 0, "segment_bytes": 512, "snapshot_every": 0, "lease_window": 1,
                "lease_cushion": 0, "host_bytes": 0}
        for name, lo in ints.items():
            put(name, _int(name, getattr(self, name), lo))
        for name in ("lease_window", "lease_cushion"):  # tokens: past 2**40 changes nothing
            if getattr(self, name) > TOKENS_MAX:          # (S is smaller) but int64 sums wrap
                raise ConfigError(f"{name}={getattr(self, name)} must be <= 2**40 tokens")
        for name in ("kv_tokens", "free_bytes"):
            if getattr(self, name) is not None:
                put(name, _int(name, getattr(self, name), 0))
        if not isinstance(self.model, ModelGeometry) or not isinstance(self.serving,
                                                                        ServingConfig):
            raise ConfigError(f"model={self.model!r} / serving={self.serving!r} must be a "
                              "ModelGeometry and a ServingConfig")
        for name in ("journal_dir", "persist_dir"):
            v = getattr(self, name)
            if v is not None:
                try:
                    path = os.fspath(v)
                except TypeError:
                    raise ConfigError(f"{name}={v!r} is not a path") from None
                if not isinstance(path, str) or not path or "\0" in path:
                    raise ConfigError(f"{name}={v!r}: want a non-empty str path without a "
                                      "NUL byte")
                put(name, path)
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError, ValueError, OverflowError):  # torch's parse errors
            raise ConfigError(f"device={self.device!r} is not a torch device") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: the store runs on cpu or cuda only")
        for name in ("allocate_planes", "lease_growth", "checked"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a bool")

    @property
    def journal_path(self) -> str | None:
        if self.journal_dir is not None:
            return self.journal_dir
        return None if self.persist_dir is None else os.path.join(self.persist_dir, "journal")

    def plan(self) -> CapacityPlan:
        if self.free_bytes is not None:
            return plan_automatic(self.model, self.serving, self.free_bytes, self.headroom)
        tokens = self.kv_tokens if self.kv_tokens is not None else default_kv_tokens(
            self.serving)
        return plan_explicit(self.model, self.serving, tokens)


TOKENS_MAX = 1 << 40
"""Largest token count a setting may name (``grow`` adds a window and a cushion to
frontiers in int64)."""


def _int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool):
        raise ConfigError(f"{name}={v!r} is not an integer")
    try:
        n = operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name}={v!r} ({type(v).__name__}) is not an integer") from None
    if n < lo:
        raise ConfigError(f"{name}={n} must be >= {lo}")
    if n >= 1 << 63:  # sizes and counts reach torch, mmap and the journal as int64
        raise ConfigError(f"{name}={n} does not fit in 64 bits (must be < 2**63)")
    return n


@dataclass(slots=True)
class RecoveryReport:
    records: int = 0
    snapshot_seq: int = 0
    """The snapshot recovery started from (0: none, the whole log was replayed)."""
    cuts: list[str] = field(default_factory=list)
    cut_bytes: int = 0
    """Bytes this and earlier recoveries cut (``journal.ids.CUT_NOTE``): the reopen skips as
    many more seq ids (engine/restart.py)."""
    id_floor: int = 0
    """The first seq id the last reopen handed out from (``journal.ids.NEXT_ID``)."""
    kept: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    snapshots_skipped: list[str] = field(default_factory=list)
    """Snapshots recovery refused (damaged, beyond the log, or not on the log's CRC chain)."""
