"""Configurations a store cannot serve are refused at open, typed, before any file changes.

From an outside review (2026-12-03): ``ModelGeometry(layers=10**9)`` with CPU planes opened
until the kernel's OOM killer ended the process (no error to catch), and a negative
``mtp_layers`` was accepted, and journaled in the plan, whenever the backend was not MTP."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ninfer_kv.engine import opening
from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig, plan_explicit
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import ConfigError
from tests.engine.conftest import small_config
from tests.engine.test_continuation import step
from tests.engine.test_trust_durability import tree


def test_planes_larger_than_free_memory_are_refused_before_any_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config(tmp_path)
    s = KVStore.open(cfg)
    s.activate(10, 10)
    step(s)
    s.close()
    before = tree(tmp_path)
    need = sum(g.total_bytes for g in s.plan.layout.pools.values())
    monkeypatch.setattr(opening, "memory_available", lambda: need - 1)
    with pytest.raises(ConfigError, match=f"needs {need:,} bytes of CPU memory.*"
                                          f"{need - 1:,} available"):
        KVStore.open(cfg)  # old code: opened (here), or the OOM killer (planes past RAM)
    assert tree(tmp_path) == before
    # what does not allocate planes, or fits, opens
    KVStore.open(dataclasses.replace(cfg, allocate_planes=False)).close()
    monkeypatch.setattr(opening, "memory_available", lambda: need)
    KVStore.open(cfg).close()
    monkeypatch.setattr(opening, "memory_available", lambda: None)  # no /proc/meminfo
    KVStore.open(cfg).close()


def test_free_memory_is_read_from_meminfo() -> None:
    have = opening.memory_available()
    if not Path("/proc/meminfo").exists():
        assert have is None
        return
    kib = {line.split(":")[0]: int(line.split()[1])
           for line in Path("/proc/meminfo").read_text().splitlines() if line.split()[1:]}
    assert have is not None and 0 < have <= (kib["MemTotal"] + kib.get("SwapTotal", 0)) * 1024


@pytest.mark.parametrize("field", ["mtp_layers", "draft_layers", "draft_kv_heads",
                                   "draft_head_dim", "draft_window"])
@pytest.mark.parametrize("backend", list(Backend))
def test_negative_counts_are_refused_whatever_the_backend(field: str, backend: Backend) -> None:
    model = ModelGeometry(layers=1, kv_heads=1, head_dim=64)
    serving = ServingConfig(max_context=256, max_concurrency=2, backend=backend)
    if field == "draft_window":
        serving = dataclasses.replace(serving, draft_window=-1)
    else:
        model = dataclasses.replace(model, **{field: -1})
    with pytest.raises(ConfigError, match=f"{field}=-1 must be >= 0"):
        plan_explicit(model, serving, 1024)  # old code: accepted unless the backend used it
    with pytest.raises(ConfigError, match=f"{field}=-1 must be >= 0"):
        KVStore.open(StoreConfig(model=model, serving=serving, kv_tokens=1024,
                                 allocate_planes=False))
