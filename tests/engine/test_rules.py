"""One test per safety rule that the mutation check (benchmarks/mutation_check.py) found no
other test would notice disabled: configuration ranges, the checked-mode write guard,
continuation refusals, the host-tier page filters, open-time refusals, fail-stop of close/
snapshot/compact, write permission. Each test fails when its rule is removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ninfer_kv.engine.capacity import (
    Backend,
    ModelGeometry,
    ServingConfig,
    plan_automatic,
)
from ninfer_kv.engine.config import InvariantViolation
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import (
    CapacityExhausted,
    ConfigError,
    FrontierError,
    HostArenaError,
    InvalidArgument,
    StoreFailed,
    UnknownHandle,
    WritePermissionError,
)
from tests.engine.conftest import crash, small_config
from tests.engine.test_continuation import checkpoint_at, step, write_tokens
from tests.engine.test_host_tier import host_store


# --- configuration ranges -------------------------------------------------------------------
@pytest.mark.parametrize("make,pattern", [
    (lambda: ModelGeometry(layers=True), "layers=True is not an integer"),
    (lambda: StoreConfig(serving=ServingConfig(allowance_bytes=-1)).plan(),
     "allowance_bytes=-1 must be >= 0"),
    (lambda: StoreConfig(model=ModelGeometry(draft_layers=-1),
                         serving=ServingConfig(backend=Backend.DFLASH)).plan(),
     "draft_layers=-1 must be >= 0"),
    (lambda: plan_automatic(ModelGeometry(), ServingConfig(), 1 << 40, -1),
     "headroom=-1 must be >= 0"),
    (lambda: StoreConfig(host_bytes=True), "host_bytes=True is not an integer"),
])
def test_configuration_ranges(make, pattern: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=pattern):
        make()


# --- the checked-mode write guard -------------------------------------------------------------
def guarded(tmp_path: Path) -> tuple[KVStore, int]:
    s = KVStore.open(small_config(tmp_path, checked=True))
    a = s.activate(64, 64)
    s.ensure_mapped(a, "main", 64)
    step(s)
    return s, a


def test_guard_refuses_mismatched_batches_and_unmapped_positions(tmp_path: Path) -> None:
    s, a = guarded(tmp_path)
    guard = s.batch_view("main", 0).guard
    rows = s.table_rows("main", [a])
    with pytest.raises(InvalidArgument, match="2 table_rows, 1 positions"):
        guard(rows.repeat(2), torch.tensor([0]))
    with pytest.raises(WritePermissionError, match="is not mapped"):
        guard(rows, torch.tensor([64]))  # the guard alone (append_kv refuses it earlier too)
    guard(rows, torch.tensor([0]))
    s.close()


def test_guard_checks_the_published_entry_and_the_page_owner(tmp_path: Path) -> None:
    s, a = guarded(tmp_path)
    guard = s.batch_view("main", 0).guard
    rows = s.table_rows("main", [a])
    table = s.device.pools["main"].block_tables
    real = int(table[rows[0], 0])
    table[rows[0], 0] = real + 1  # what a stale or foreign table would say
    with pytest.raises(WritePermissionError, match="published table maps page group"):
        guard(rows, torch.tensor([3]))
    table[rows[0], 0] = real
    pg = s.state.pools["main"].pages[s.space(a).members[0]]
    pg.writer = -1  # not reachable through the API today: the guard must still hold
    with pytest.raises(WritePermissionError, match="only its single unpinned writer"):
        guard(rows, torch.tensor([3]))
    pg.writer = a
    s.close()


# --- continuation refusals ----------------------------------------------------------------------
def test_continuation_refusals(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=64))
    ck = checkpoint_at(s, 100)
    live = s.activate(64, 10)
    s.activate(1500, 500)  # 32 pages reserved: 28 left, fewer than a long continuation needs
    cases = [
        (UnknownHandle, "999 is not an inactive checkpoint", (999, 10, 10, 10), {}),
        (UnknownHandle, f"{live} is not an inactive checkpoint", (live, 10, 10, 10), {}),
        (FrontierError, "need a positive budget", (ck, 0, 0, 0), {}),
        (FrontierError, "> S=2048", (ck, 10, 2000, 100), {}),
        (FrontierError, "frontier 90 > prompt_tokens 50", (ck, 90, 50, 10), {}),
        (WritePermissionError, "the caller keeps the source", (ck, 64, 64, 10),
         {"mode": "move", "keep_source": True}),
        (CapacityExhausted, "continuation needs", (ck, 64, 64, 1900), {}),
    ]
    for exc, pattern, args, kw in cases:
        d = s.digest()
        with pytest.raises(exc, match=pattern):
            s.activate_from(*args, **kw)
        assert s.digest() == d
    s.close()


# --- host-tier page filters ---------------------------------------------------------------------
def grown_from_offloaded(s: KVStore, truncate_to: int | None, to: int = 50) -> int:
    """ck offloaded at 40 tokens; Moved into y; y (optionally truncated) commits to ``to``;
    finished: a checkpoint whose page has an older host replica than its content."""
    ck = checkpoint_at(s, 40)
    s.offload(ck)
    step(s)
    y = s.activate_from(ck, 40, 40, 60, keep_source=False, mode="move")
    step(s)
    if truncate_to is not None:
        s.truncate(y, "main", truncate_to)  # new epoch: the old replica is stale
        step(s)
    start = s.space(y).committed
    s.ensure_mapped(y, "main", to)
    step(s)
    write_tokens(s, y, "main", start, to)
    s.commit(y, "main", to)
    s.finish(y, retain=True)
    step(s)
    return y


@pytest.mark.parametrize("truncate_to,to", [(None, 50), (20, 40)], ids=["coverage", "epoch"])
def test_a_stale_host_replica_is_offloaded_again(tmp_path: Path, truncate_to: int | None,
                                                 to: int) -> None:
    """Coverage: the replica covers 40 of 50 columns. Epoch: it covers all 40, but columns
    20..40 were rewritten after a truncate (§5.1: the epoch no longer matches)."""
    s = host_store(tmp_path)
    y = grown_from_offloaded(s, truncate_to, to)
    assert s.drop_device(y) == 0  # no valid replica: dropping would lose committed bytes
    assert s.offload(y) == 1
    s.close()


def test_a_checkpoint_whose_replica_is_short_does_not_survive_a_restart(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    y = grown_from_offloaded(s, None)  # host replica covers 40 of 50 committed columns
    crash(s)
    s2 = host_store(tmp_path)
    assert "coverage 40" in s2.recovery.dropped[y]
    s2.close()


def test_drop_device_keeps_a_page_a_queued_copy_reads(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    s.activate_from(ck, 100, 100, 10)  # shares page 0 (active) and pins the tail (COW)
    assert s.drop_device(ck) == 0
    step(s)
    s.check_invariants()
    s.close()


def test_drop_device_schedules_only_its_own_checkpoints_pages(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    a, b = checkpoint_at(s, 100), checkpoint_at(s, 130)
    s.offload(a)
    s.offload(b)
    assert s.drop_device(a) == 2
    step(s)
    main = s.state.pools["main"]
    assert all(main.pages[x].device == -1 for x in s.space(a).members)
    assert all(main.pages[x].device != -1 for x in s.space(b).members)
    s.close()


def test_host_commands_refuse_unknown_checkpoints_and_a_missing_arena(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    for call in (lambda: s.offload(999), lambda: s.drop_device(999)):
        with pytest.raises(UnknownHandle, match="999 is not an inactive checkpoint"):
            call()
    with pytest.raises(UnknownHandle, match="999 is neither an active sequence nor a checkpoint"):
        s.drop_host(999)  # it takes an active sequence too (after swap_in)
    s.close()
    s = KVStore.open(small_config(tmp_path / "nohost"))
    ck = checkpoint_at(s, 64)
    with pytest.raises(HostArenaError, match="without a host arena"):
        s.offload(ck)
    s.close()


def test_pins_are_checked_without_a_host_tier(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 10)
    s.ensure_mapped(a, "main", 64)
    s.state.pools["main"].pages[s.space(a).members[0]].pins = 1
    assert any("pins 1 != queued copies 0" in v for v in violations(s.state))
    with pytest.raises(InvariantViolation, match="pins 1"):
        s.check_invariants()
    s.state.pools["main"].pages[s.space(a).members[0]].pins = 0
    s.close()


# --- open-time refusals ---------------------------------------------------------------------------
def test_open_refuses_a_symlinked_directory_cuda_without_a_gpu_and_an_unmappable_arena(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ConfigError, match="is not a directory"):
        KVStore.open(small_config(None, journal_dir=str(tmp_path / "link")))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            KVStore.open(small_config(None, device="cuda"))
    from ninfer_kv.engine import opening

    def cannot_map(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(opening, "HostArenaBuffer", cannot_map)
    with pytest.raises(ConfigError, match="cannot map host arena"):
        host_store(tmp_path)


def test_open_names_the_pools_a_journal_was_written_for(tmp_path: Path) -> None:
    """Another pool set is refused by its own rule, naming both sets (the geometry check
    after it would refuse too, naming one plan entry)."""
    KVStore.open(small_config(tmp_path)).close()
    with pytest.raises(ConfigError, match=r"was written for pools \[.*\], this config plans"):
        KVStore.open(small_config(tmp_path, pages=128))


def test_a_view_of_a_store_without_planes_says_why(tmp_path: Path) -> None:
    """Not only 'layer 0 out of range': the store was opened without planes."""
    s = KVStore.open(small_config(tmp_path, allocate_planes=False))
    with pytest.raises(InvalidArgument,
                       match=r"pool main has no planes \(opened with allocate_planes=False\)"):
        s.batch_view("main", 0)
    s.close()


# --- fail-stop of close, snapshot and compaction -----------------------------------------------
def failing(monkeypatch, target: object, name: str) -> None:  # noqa: ANN001
    def eio(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(target, name, eio)


def test_a_failed_sync_at_close_is_reported(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = KVStore.open(small_config(tmp_path))
    s.activate(10, 10)
    step(s)
    failing(monkeypatch, type(s.journal._file), "fsync")
    with pytest.raises(StoreFailed, match="close"):
        s.close()
    assert s.closed


def test_a_failed_snapshot_stops_the_store(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = KVStore.open(small_config(tmp_path))
    s.activate(10, 10)
    step(s)
    failing(monkeypatch, s.journal.fs, "create")
    with pytest.raises(StoreFailed, match="snapshot"):
        s.snapshot()
    with pytest.raises(StoreFailed):
        s.activate(10, 10)
    monkeypatch.undo()
    s.close()


def test_a_failed_compaction_stops_the_store(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = KVStore.open(small_config(tmp_path, segment_bytes=512))
    for _ in range(20):
        s.finish(s.activate(64, 10))
        step(s)
    s.snapshot()
    failing(monkeypatch, s.journal.fs, "remove")
    with pytest.raises(StoreFailed, match="compact"):
        s.compact()
    monkeypatch.undo()
    s.close()


# --- commands ---------------------------------------------------------------------------------------
def test_an_empty_activation_is_refused(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    with pytest.raises(FrontierError, match="positive sum"):
        s.activate(0, 0)
    s.close()


def test_write_permission_of_multi_block_commits_trims_and_truncates(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=64))
    ck = checkpoint_at(s, 40)
    s.activate_from(ck, 40, 40, 10)  # Fork: its COW pins ck's tail until the boundary
    y = s.activate_from(ck, 40, 40, 300, keep_source=False, mode="move")  # y writes the tail
    s.ensure_mapped(y, "main", 200)
    d = s.digest()
    with pytest.raises(WritePermissionError, match="pins=1"):
        s.commit(y, "main", 200)  # spans blocks 0-3; block 0 is pinned
    with pytest.raises(WritePermissionError, match="pins=1"):
        s.truncate(y, "main", 0)  # would unmap the pinned page
    assert s.digest() == d
    step(s)
    s.commit(y, "main", 200)
    s.close()


def test_a_moved_full_page_is_its_new_owners_to_truncate_into(tmp_path: Path) -> None:
    """A Move leaves no checkpoint behind (§9.1): the full pages it hands over are the
    sequence's alone, so it may rewrite them from a truncated frontier and becomes their
    writer (tests/engine/test_continuation_review.py: a Fork's shared pages may not)."""
    s = KVStore.open(small_config(tmp_path, pages=64))
    ck = checkpoint_at(s, 128)
    y = s.activate_from(ck, 128, 128, 50, keep_source=False, mode="move")
    step(s)
    page = s.page(s.handles(y, "main")[1])
    assert page.writer == -1  # handed over whole: no writer until it rewrites one
    s.truncate(y, "main", 100)  # before: WritePermissionError, writer=-1
    assert page.writer == y
    step(s)
    s.close()


def test_check_invariants_raises_on_a_broken_counter(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    s.activate(64, 10)
    s.state.pools["main"].reserved += 1
    with pytest.raises(InvariantViolation, match="reserved"):
        s.check_invariants()
    s.state.pools["main"].reserved -= 1
    s.close()
