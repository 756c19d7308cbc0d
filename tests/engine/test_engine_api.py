"""The engine author's read/annotate surface: set_metadata (journaled, survives a restart),
checkpoint_info, metrics; and checked mode's commit rule (a commit covers only tokens every
layer wrote through a guarded view)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    ConfigError,
    InvalidArgument,
    StoreClosed,
    UnknownHandle,
    WritePermissionError,
)
from ninfer_kv.journal.events import METADATA_MAX, METADATA_PER_RECORD
from ninfer_kv.replay import replay
from tests.engine.conftest import assert_refusals_change_nothing, crash, small_config
from tests.engine.test_continuation import checkpoint_at, step, write_tokens
from tests.engine.test_host_tier import host_store


def test_metadata_is_journaled_and_survives_a_restart(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 100)
    meta = {"tokens": list(range(100)), "model": "tiny-llama", "blob": b"\x00\xff"}
    s.set_metadata(ck, meta)
    assert s.checkpoint_info(ck).metadata == meta
    s.offload(ck)
    step(s)
    crash(s)
    s2 = host_store(tmp_path)
    assert s2.recovery.kept == [ck]
    info = s2.checkpoint_info(ck)
    assert info.metadata == meta and info.survives_restart
    s2.set_metadata(ck, None)  # clears
    step(s2)
    assert s2.checkpoint_info(ck).metadata is None
    s2.close()
    assert replay(str(tmp_path / "persist" / "journal")).digest == s2.digest()


def test_metadata_refusals_change_nothing(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 64)
    assert_refusals_change_nothing(s, [
        (UnknownHandle, "neither an active sequence nor a checkpoint",
         lambda: s.set_metadata(999, {})),
        (InvalidArgument, "msgpack-encodable", lambda: s.set_metadata(ck, {"f": object()})),
        (InvalidArgument, "METADATA_MAX", lambda: s.set_metadata(ck, b"x" * METADATA_MAX)),
        (InvalidArgument, "seq=True", lambda: s.set_metadata(True, {})),
        (UnknownHandle, "neither", lambda: s.checkpoint_info(12345)),
    ])
    s.set_metadata(ck, b"x" * (METADATA_MAX - 8))  # the cap is on the encoded bytes
    s.close()
    assert s.checkpoint_info(ck).metadata == b"x" * (METADATA_MAX - 8)  # a query still reads
    with pytest.raises(StoreClosed):
        s.set_metadata(ck, 1)


def test_checkpoint_info_reports_frontier_and_residency(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    a = s.activate(100, 50)
    s.ensure_mapped(a, "main", 100)
    step(s)
    live = s.checkpoint_info(a)
    assert live.active and live.frontier == 0 and live.pools["main"].pages == 2
    assert not live.survives_restart
    write_tokens(s, a, "main", 0, 100)
    s.commit(a, "main", 100)
    ck = s.finish(a, retain=True)
    step(s)
    page = s.device.pools["main"].geometry.page_bytes
    info = s.checkpoint_info(ck)
    assert (info.active, info.frontier, info.parent, info.finish_reason) == (False, 100, None,
                                                                            "stop")
    main = info.pools["main"]
    assert (main.pages, main.device_pages, main.host_pages) == (2, 2, 0)
    assert main.device_bytes == 2 * page and not info.survives_restart
    s.offload(ck, drop_device=True)
    step(s)
    main = s.checkpoint_info(ck).pools["main"]
    assert (main.device_pages, main.host_pages, main.host_bytes) == (0, 2, 2 * page)
    assert s.checkpoint_info(ck).survives_restart
    y = s.activate_from(ck, 100, 100, 10)
    assert s.checkpoint_info(y).parent == ck
    s.close()


def test_metrics_count_what_happened(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    m0 = s.metrics()
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    m = s.metrics()
    assert m.materialized - m0.materialized == 2 and m.d2h_pages - m0.d2h_pages == 2
    assert (m.active, m.checkpoints) == (0, 1) and m.published == 1
    assert m.records > m0.records and m.journal_seq == s.journal.last_seq  # type: ignore[union-attr]
    assert m.pools == s.occupancy() and m.pools["main"]["allocated"] == 2
    assert m.host_used > 0 and m.host_capacity == 8 << 20
    assert set(m.as_dict()) >= {"records", "events", "pools", "journal_durable_seq"}
    s.close()


# --- checked mode: commit covers only what every layer wrote -------------------------------
def mapped(tmp_path: Path, tokens: int, checked: bool) -> tuple[KVStore, int]:
    """A store with one active sequence whose ``tokens`` are mapped and published."""
    s = KVStore.open(small_config(tmp_path, checked=checked))
    a = s.activate(tokens, 64)
    s.ensure_mapped(a, "main", tokens)
    step(s)
    return s, a


def test_checked_commit_needs_every_layer_written(tmp_path: Path) -> None:
    s, a = mapped(tmp_path, 100, checked=True)
    rows = torch.full((100,), s.space(a).row, dtype=torch.int32)
    pos = torch.arange(100)
    s.batch_view("main", 0).guard(rows, pos)  # type: ignore[misc]  # layer 0 only
    assert_refusals_change_nothing(s, [
        (WritePermissionError, "layer 1 never wrote 100", lambda: s.commit(a, "main", 100)),
    ])
    s.batch_view("main", 1).guard(rows[:60], pos[:60])  # type: ignore[misc]
    assert_refusals_change_nothing(s, [
        (WritePermissionError, "layer 1 never wrote 40 .*first: 60",
         lambda: s.commit(a, "main", 100)),
    ])
    s.commit(a, "main", 60)  # what both layers wrote
    s.batch_view("main", 1).guard(rows[60:], pos[60:])  # type: ignore[misc]
    s.commit(a, "main", 100)
    s.truncate(a, "main", 70)  # the tail is discarded: it must be written again
    with pytest.raises(WritePermissionError, match="layer 0 never wrote 30 .*first: 70"):
        s.commit(a, "main", 100)
    s.close()


def test_an_unchecked_store_trusts_the_commit(tmp_path: Path) -> None:
    s, a = mapped(tmp_path, 100, checked=False)
    s.commit(a, "main", 100)  # nothing was written: accepted (the caller's promise, §8.1)
    assert s.space(a).committed == 100
    s.close()


# --- review findings ------------------------------------------------------------------------
def test_checked_trim_forgets_the_writes_of_the_pages_it_unmaps(tmp_path: Path) -> None:
    s, a = mapped(tmp_path, 128, checked=True)
    write_tokens(s, a, "main", 0, 128)
    s.commit(a, "main", 64)
    s.trim(a, "main")  # block 1 goes; mapped again below, it is a fresh, unwritten page
    s.ensure_mapped(a, "main", 128)
    step(s)
    with pytest.raises(WritePermissionError, match="never wrote 64 .*first: 64"):
        s.commit(a, "main", 128)
    s.close()


def test_metadata_that_msgpack_cannot_hold_is_a_typed_refusal(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 64)
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    assert_refusals_change_nothing(s, [
        (InvalidArgument, "msgpack-encodable", lambda: s.set_metadata(ck, 2 ** 70)),
        (InvalidArgument, "msgpack-encodable", lambda: s.set_metadata(ck, deep)),
    ])
    s.close()


def test_survives_restart_is_what_a_reopen_keeps(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))  # in-memory arena
    empty = s.activate(0, 64)
    step(s)
    empty = s.finish(empty, retain=True)  # no pages: nothing to lose
    full = checkpoint_at(s, 64)
    s.offload(full)
    step(s)
    said = {ck: s.checkpoint_info(ck).survives_restart for ck in (empty, full)}
    s.close()
    s2 = KVStore.open(s.config)
    assert said == {ck: ck in s2.recovery.kept for ck in (empty, full)} == {empty: True,
                                                                            full: False}
    s2.close()


def test_an_in_memory_arena_is_never_trusted_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the mutation harness, whose in-process runs made this flaky: a reopened
    store's fresh in-memory arena (``torch.empty``) can reuse the closed one's memory, so the
    old replicas' CRCs still matched and recovery kept a checkpoint whose host tier died with
    the process. Here the reuse is forced: the new arena starts with the old bytes."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    full = checkpoint_at(s, 64)
    s.offload(full)
    step(s)
    old = s.arena.data.clone()  # type: ignore[union-attr]
    s.close()
    real = HostArenaBuffer.__init__

    def reused(self: HostArenaBuffer, capacity: int, path: str | None = None,
               pin: bool | None = None) -> None:
        real(self, capacity, path, pin)
        if path is None:
            self.data.copy_(old)  # what the allocator may hand back

    monkeypatch.setattr(HostArenaBuffer, "__init__", reused)
    s2 = KVStore.open(s.config)
    assert full not in s2.recovery.kept
    assert "in memory" in s2.recovery.dropped[full]
    s2.check_invariants()
    s2.close()


def test_metadata_of_one_boundary_fits_one_record(tmp_path: Path) -> None:
    """Review suspicion, confirmed by construction: 1 MiB blobs queued without a boundary
    could exceed the 256 MiB record a reader accepts; the command refuses first."""
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 64)
    blob = b"x" * (METADATA_MAX - 16)
    for _ in range(METADATA_PER_RECORD // len(blob)):
        s.set_metadata(ck, blob)
    assert_refusals_change_nothing(s, [
        (InvalidArgument, "METADATA_PER_RECORD", lambda: s.set_metadata(ck, blob)),
    ])
    step(s)
    s.set_metadata(ck, blob)  # a new boundary, a new budget
    s.close()


def test_batched_and_single_arguments_outside_64_bits_or_twice_are_typed_refusals(
        tmp_path: Path) -> None:
    """Found by the mutation check (three rules no test noticed): an integer outside 64 bits
    in a list or in a one-sequence call is refused by name (not a raw OverflowError), and a
    sequence twice in set_provisional_many is refused before anything is emitted."""
    s, a = mapped(tmp_path, 100, checked=False)
    assert_refusals_change_nothing(s, [
        (InvalidArgument, "tokens: .* does not fit in 64 bits",
         lambda: s.ensure_mapped_many("main", [a], [2 ** 70])),
        (InvalidArgument, "tokens: .* does not fit in 64 bits",
         lambda: s.ensure_mapped(a, "main", 2 ** 70)),
        (InvalidArgument, "frontier: .* does not fit in 64 bits",
         lambda: s.commit(a, "main", -2 ** 64)),
        (InvalidArgument, "seq: .* does not fit in 64 bits",
         lambda: s.commit(2 ** 70, "main", 10)),
        (InvalidArgument, "seq: .* does not fit in 64 bits",
         lambda: s.ensure_mapped(-2 ** 63 - 1, "main", 10)),
        (InvalidArgument, r"seqs: \[\d+\] appear more than once",
         lambda: s.set_provisional_many("main", [a, a], [10, 20])),
    ])
    s.close()


def test_argument_refusals_found_by_review(tmp_path: Path) -> None:
    """Review findings (2026-12-02), each once accepted: a ``str`` subclass as a finish
    reason (msgspec cannot encode it: the next boundary failed the store) and one past any
    record (the same); ``grow`` by more tokens than a sequence can hold (int64 wrap in its
    compiled pass, or an untyped OverflowError); a torch bool as a frontier; a bare int as
    ``reclaimable``'s list; float positions to ``slot_mapping`` (truncated)."""
    import numpy as np

    from ninfer_kv import slot_mapping
    from ninfer_kv.journal.events import REASON_MAX

    s = KVStore.open(small_config(tmp_path, lease_growth=True))
    a = s.activate(100, 10)
    s.ensure_mapped(a, "main", 100)
    step(s)
    rows, pos = s.table_rows("main", [a]), torch.tensor([64])
    view = s.batch_view("main", 0)
    big = s.plan.S + 1
    assert_refusals_change_nothing(s, [
        (InvalidArgument, "reason=", lambda: s.finish(a, retain=True, reason=np.str_("stop"))),
        (InvalidArgument, f"{REASON_MAX + 1} UTF-8 bytes > REASON_MAX",
         lambda: s.finish(a, retain=True, reason="x" * (REASON_MAX + 1))),
        (InvalidArgument, f"step_tokens={big} must be <=", lambda: s.grow(big)),
        (InvalidArgument, "step_tokens=", lambda: s.grow(2**63)),
        (InvalidArgument, "a bool is not an integer",
         lambda: s.commit(a, "main", torch.tensor(True))),
        (InvalidArgument, "want a sequence", lambda: s.reclaimable(a)),  # type: ignore[arg-type]
        (InvalidArgument, "positions must be an integer tensor",
         lambda: slot_mapping(view, rows, pos.float())),
        (InvalidArgument, "table_rows must be an integer tensor",
         lambda: slot_mapping(view, rows.float(), pos)),
    ])
    assert s.finish(a, retain=True, reason="é" * (REASON_MAX // 2)) is not None  # at the cap
    step(s)
    s.close()


@pytest.mark.parametrize("name", ["lease_window", "lease_cushion"])
def test_lease_settings_past_any_context_are_refused(tmp_path: Path, name: str) -> None:
    """Review finding: a window or cushion near 2**63 wrapped in ``grow``'s int64 sums."""
    with pytest.raises(ConfigError, match=f"{name}=1099511627777 must be <= 2\\*\\*40"):
        small_config(tmp_path, lease_growth=True, **{name: (1 << 40) + 1})
