"""Configurations a store cannot serve are refused at open, typed, before any file changes.

From an outside review (2026-12-03): ``ModelGeometry(layers=10**9)`` with CPU planes opened
until the kernel's OOM killer ended the process (no error to catch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    monkeypatch.setattr(opening, "memory_limit", lambda: need - 1)
    with pytest.raises(ConfigError, match=f"needs {need:,} bytes of CPU memory.*"
                                          f"at most {need - 1:,}"):
        KVStore.open(cfg)  # old code: opened (here), or the OOM killer (planes past RAM)
    assert tree(tmp_path) == before
    # what does not allocate planes, or fits, opens
    KVStore.open(dataclasses.replace(cfg, allocate_planes=False)).close()
    monkeypatch.setattr(opening, "memory_limit", lambda: need)
    KVStore.open(cfg).close()
    monkeypatch.setattr(opening, "memory_limit", lambda: None)  # no /proc/meminfo
    KVStore.open(cfg).close()


def test_the_limit_is_all_the_memory_not_what_is_free_now() -> None:
    """A bound, not MemAvailable: caches give memory back, so a store that fits after they
    shrink must open (a review: ZFS's ARC is not counted as available)."""
    limit = opening.memory_limit()
    if not Path("/proc/meminfo").exists():
        return
    kib = {line.split(":")[0]: int(line.split()[1])
           for line in Path("/proc/meminfo").read_text().splitlines() if line.split()[1:]}
    total = (kib["MemTotal"] + kib.get("SwapTotal", 0)) * 1024
    assert limit is not None and 0 < limit <= total
    assert limit >= kib["MemAvailable"] * 1024 or limit < total  # lower only by a cgroup


def test_an_unused_backend_field_is_ignored_so_its_journal_reopens(tmp_path: Path) -> None:
    """Refusing mtp_layers=-1 without MTP (3c2446d) made the journals such a config had written
    unopenable by any config: the value is journaled in the plan, and another value is
    another geometry. A field of a backend not in use is ignored, as before."""
    model = ModelGeometry(layers=1, kv_heads=1, head_dim=64, mtp_layers=-1)
    cfg = StoreConfig(model=model, serving=ServingConfig(max_context=256, max_concurrency=2),
                      kv_tokens=512, journal_dir=str(tmp_path / "j"), allocate_planes=False)
    s = KVStore.open(cfg)
    s.finish(s.activate(10, 10), retain=True)
    with s.boundary():
        pass
    s.close()
    again = KVStore.open(cfg)
    assert len(again.checkpoints()) == 1
    again.close()
    with pytest.raises(ConfigError, match="mtp_layers=-1 must be positive"):
        plan_explicit(model, ServingConfig(max_context=256, max_concurrency=2,
                                           backend=Backend.MTP), 512)


def fake_files(files: dict[str, str]) -> Callable[[str], str | None]:
    return files.get


MEMINFO = "MemTotal:       8388608 kB\nSwapTotal:      2097152 kB\nMemAvailable: 1 kB\n"


def test_the_limit_reads_the_process_cgroup_with_its_swap() -> None:
    """A review of 6c5e681: memory.max alone (and only the root cgroup's file) refused planes
    a container with swap could hold, and missed the limit of the process's own cgroup."""
    gib = 1 << 30
    host = {"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "0::/job\n"}
    assert opening.memory_limit(fake_files(host)) == 10 * gib  # no limit file: the host's
    box = {**host, "/sys/fs/cgroup/job/memory.max": f"{4 * gib}\n",
           "/sys/fs/cgroup/job/memory.swap.max": f"{4 * gib}\n"}
    assert opening.memory_limit(fake_files(box)) == 8 * gib
    box["/sys/fs/cgroup/job/memory.swap.max"] = "max\n"  # unlimited: the host's swap
    assert opening.memory_limit(fake_files(box)) == 6 * gib
    box["/sys/fs/cgroup/job/memory.max"] = "max\n"
    assert opening.memory_limit(fake_files(box)) == 10 * gib
    root = {"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": f"{gib}\n"}
    assert opening.memory_limit(fake_files(root)) == gib  # no meminfo, a root cgroup limit
    assert opening.memory_limit(fake_files({})) is None
