"""Engine core I against the spec's wording (§5-§8, §12-§14)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog.testing
import torch

from ninfer_kv.engine.device import UNMAPPED
from ninfer_kv.engine.pages import PageHandle
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    CapacityExhausted,
    EntitlementExceeded,
    FrontierError,
    FrozenUnit,
    InactiveSpace,
    InvalidArgument,
    KVStoreError,
    StaleHandle,
    UnknownHandle,
)
from ninfer_kv.journal.events import Materialize
from ninfer_kv.replay import replay
from tests.engine.conftest import MakeStore, assert_refusals_change_nothing, small_config


def step(s: KVStore) -> None:
    with s.boundary():
        pass
    s.check_invariants()


def test_activate_reserves_entitlement_and_leases_row(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(100, 100)  # 200 tokens -> 4 pages
    occ = s.occupancy()["main"]
    assert occ == {"capacity": 64, "allocated": 0, "reserved": 4, "available": 60,
                   "rows_leased": 1, "checkpoint_only": 0}
    sp = s.space(a)
    assert sp.entitlement == 4 and sp.reserved == 4 and sp.row == 0 and sp.active
    step(s)


def test_ensure_mapped_lower_bound_and_larger_membership(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(100, 200)
    assert s.ensure_mapped(a, "main", 130) == 3
    step(s)
    before = (s.digest(), len(s._pending))
    assert s.ensure_mapped(a, "main", 64) == 0      # membership larger than asked: no work
    assert s.ensure_mapped(a, "main", 192) == 0     # exactly covered
    assert (s.digest(), len(s._pending)) == before
    assert s.space(a).committed == 0               # never moves frontiers
    assert s.space(a).entitlement == 5             # never changes the entitlement
    table = s.device.pools["main"].block_tables[s.space(a).row]
    assert table[:3].tolist() == [s.state.pools["main"].pages[x].device for x in s.space(a).members]
    assert table[3:].eq(UNMAPPED).all()


def test_decode_round_without_page_crossing_emits_no_materialization(make_store: MakeStore) -> None:
    s = make_store()
    seqs = [s.activate(70, 100) for _ in range(3)]
    s.ensure_mapped_many("main", seqs, [71] * 3)
    step(s)
    s.commit_many("main", seqs, [71] * 3)
    for t in range(72, 128):  # stay inside page 1
        s.ensure_mapped_many("main", seqs, [t] * 3)
        assert not any(isinstance(e, Materialize) for e in s._pending)
        step(s)
        s.commit_many("main", seqs, [t] * 3)
    s.ensure_mapped_many("main", seqs, [129] * 3)  # crossing: one page each
    mats = [e for e in s._pending if isinstance(e, Materialize)]
    assert len(mats) == 1 and len(mats[0].pages) == 3 * 4
    step(s)


def test_trim_returns_leases_to_same_reservation(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(64, 256)  # 5 pages
    s.ensure_mapped(a, "main", 64 * 4)
    step(s)
    s.commit(a, "main", 70)
    avail = s.occupancy()["main"]["available"]
    assert s.space(a).reserved == 1
    assert s.trim(a, "main") == 2  # keeps ceil(70/64) = 2 pages
    step(s)
    assert s.space(a).reserved == 3 and len(s.space(a).members) == 2
    assert s.occupancy()["main"]["available"] == avail  # not to global capacity
    s.set_provisional(a, "main", 128)
    assert s.trim(a, "main") == 0


def test_finish_returns_unmaterialized_entitlement(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(64, 64 * 9)  # 10 pages
    s.ensure_mapped(a, "main", 100)
    step(s)
    s.commit(a, "main", 100)
    assert s.occupancy()["main"]["available"] == 54
    ck = s.finish(a, retain=True)
    step(s)
    assert ck == a and s.checkpoints() == [a]
    occ = s.occupancy()["main"]
    assert occ["available"] == 62 and occ["allocated"] == 2 and occ["reserved"] == 0
    assert s.space(a).row == -1 and not s.space(a).active and s.space(a).protected == 100
    handles = s.handles(a)
    s.release(ck)
    step(s)
    assert s.occupancy()["main"]["available"] == 64
    with pytest.raises(StaleHandle, match="stale"):
        s.page(handles[0])


def test_finish_without_retain_releases_everything(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(10, 10)
    s.ensure_mapped(a, "main", 20)
    step(s)
    s.commit(a, "main", 20)
    assert s.finish(a) is None
    step(s)
    assert s.occupancy()["main"]["available"] == 64 and not s.state.bundles


def test_truncate(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(64, 200)
    s.ensure_mapped(a, "main", 200)
    step(s)
    s.commit(a, "main", 200)
    page = s.page(s.handles(a)[1])
    epoch = page.epoch
    s.truncate(a, "main", 100)
    step(s)
    assert s.space(a).committed == 100 and len(s.space(a).members) == 2
    assert page.committed == 36 and page.epoch == epoch + 1
    with pytest.raises(FrontierError, match="truncate to 150"):
        s.truncate(a, "main", 150)


def test_views_and_stable_addresses(make_store: MakeStore) -> None:
    s = make_store()
    v0 = s.batch_view("main", 1)
    ptrs = (v0.k_pages.data_ptr(), v0.v_pages.data_ptr(), v0.block_tables.data_ptr())
    seqs = [s.activate(100, 100) for _ in range(3)]
    s.ensure_mapped_many("main", seqs, [150, 10, 64])
    step(s)
    rows = s.table_rows("main", seqs)
    v = s.batch_view("main", 1)
    assert (v.k_pages.data_ptr(), v.v_pages.data_ptr(), v.block_tables.data_ptr()) == ptrs
    assert v.k_pages.shape == (64, 2, 64, 64) and v.k_pages.dtype == torch.uint16
    lv = s.layer_view(seqs[0], "main", 1)
    assert lv.block_table.data_ptr() == v.block_tables[int(rows[0])].data_ptr()
    assert not hasattr(lv, "frontier") and not hasattr(lv, "reservation")


def test_frozen_unit_refuses_mutation(make_store: MakeStore) -> None:
    s = make_store()
    a = s.activate(10, 10)
    with s.boundary():
        d = s.digest()
        for call in (lambda: s.ensure_mapped(a, "main", 10), lambda: s.commit(a, "main", 0),
                     lambda: s.activate(1, 1), lambda: s.finish(a), lambda: s.trim(a, "main")):
            with pytest.raises(FrozenUnit, match="frozen"):
                call()
        assert s.digest() == d
    s.ensure_mapped(a, "main", 10)  # allowed again after unit_complete


def _errors(s: KVStore):
    a = s.activate(100, 28)  # 2 pages
    s.ensure_mapped(a, "main", 64)
    step(s)
    s.commit(a, "main", 64)
    ck = s.activate(10, 10)
    s.ensure_mapped(ck, "main", 10)
    step(s)
    s.commit(ck, "main", 10)
    s.finish(ck, retain=True)
    s.activate(1024, 1000)  # 32 pages reserved: 29 stay available
    step(s)
    return a, ck, [
        (EntitlementExceeded, "needs 3 pages.*entitlement is 2", lambda: s.ensure_mapped(a, "main", 129)),
        (FrontierError, "outside", lambda: s.ensure_mapped(a, "main", 64 * 33)),
        (FrontierError, "outside", lambda: s.ensure_mapped(a, "main", -1)),
        (FrontierError, "commit frontier 65 outside", lambda: s.commit(a, "main", 65)),
        (FrontierError, "commit frontier 10 outside", lambda: s.commit(a, "main", 10)),
        (InactiveSpace, "inactive checkpoint", lambda: s.commit(ck, "main", 10)),
        (InactiveSpace, "inactive", lambda: s.ensure_mapped(ck, "main", 10)),
        (UnknownHandle, "no address space", lambda: s.commit(999, "main", 1)),
        (UnknownHandle, "not enabled", lambda: s.commit(a, "mtp", 1)),
        (UnknownHandle, "not an inactive checkpoint", lambda: s.release(a)),
        (InactiveSpace, "not an active", lambda: s.finish(ck)),
        (FrontierError, "> S=2048", lambda: s.activate(2000, 49)),
        (InvalidArgument, "prompt_tokens=-1 must be >= 0", lambda: s.activate(-1, 5)),
        (CapacityExhausted, "need 32 pages, 29 available", lambda: s.activate(2000, 48)),
        (InvalidArgument, "more than once", lambda: s.commit_many("main", [a, a], [64, 64])),
        (StaleHandle, "stale", lambda: s.page(PageHandle("main", 0, 7))),
        (FrontierError, "provisional frontier 999", lambda: s.set_provisional(a, "main", 999)),
        (FrontierError, r"provisional frontier -1 outside \[0,",
         lambda: s.set_provisional(a, "main", -1)),
    ]


def test_every_refused_command_leaves_digest_unchanged(make_store: MakeStore) -> None:
    s = make_store(pages=64)
    _, _, cases = _errors(s)
    assert_refusals_change_nothing(s, cases)


def test_rows_exhausted(make_store: MakeStore) -> None:
    s = make_store(concurrency=2)
    s.activate(10, 10)
    s.activate(10, 10)
    d = s.digest()
    with pytest.raises(CapacityExhausted, match="all 2 execution rows"):
        s.activate(10, 10)
    assert s.digest() == d


def test_errors_are_typed() -> None:
    for cls in (EntitlementExceeded, FrozenUnit, StaleHandle, CapacityExhausted):
        assert issubclass(cls, KVStoreError)


def test_replay_matches_live_and_restart_releases(make_store: MakeStore, tmp_path) -> None:
    s = make_store()
    a = s.activate(100, 100)
    s.ensure_mapped(a, "main", 150)
    step(s)
    s.commit(a, "main", 150)
    s.finish(a, retain=True)
    b = s.activate(30, 30)
    s.ensure_mapped(b, "main", 30)
    step(s)
    live = s.digest()
    s.close()
    r = replay(str(tmp_path / "journal"), verify_every=1)
    assert r.digest == live and not r.violations
    s2 = KVStore.open(s.config)
    assert s2.recovery.dropped == {a: "pool main block 0: device-only page (no host replica)",
                                   b: "active at crash"}
    assert s2.occupancy()["main"]["available"] == 64
    s2.check_invariants()
    s2.close()
    assert replay(str(tmp_path / "journal")).digest == s2.digest()


def test_snapshot_recovery_equals_full_replay(make_store: MakeStore, tmp_path) -> None:
    s = make_store()
    a = s.activate(100, 100)
    s.ensure_mapped(a, "main", 150)
    step(s)
    s.commit(a, "main", 150)
    s.snapshot()
    s.commit(a, "main", 151)
    step(s)
    live = s.digest()
    s.journal.sync()  # simulate a crash: no close()
    from ninfer_kv.engine.apply import apply_all
    from ninfer_kv.engine.state import decode_state, digest
    from ninfer_kv.journal.events import CODEC
    from ninfer_kv.journal.restore import recover_state

    def apply_record(st, seq, payload) -> None:  # noqa: ANN001
        apply_all(st, CODEC.decode(payload))

    used: list[int] = []
    st, last, _ = recover_state(str(tmp_path / "journal"), schema_major=1, initial=lambda: None,
                                load_snapshot=decode_state, apply_record=apply_record,
                                on_snapshot=used.append)
    assert digest(st) == live and last == s.state.seq
    assert used == [s.state.seq - 1]  # the snapshot ended the record before the last one


def test_the_recovery_report_names_the_snapshot_it_started_from(tmp_path: Path) -> None:
    """Review finding: ``RecoveryReport.snapshot_seq`` was never set (0 after any reopen)."""
    cfg = small_config(tmp_path)
    s = KVStore.open(cfg)
    step(s)
    s.snapshot()
    at = s.state.seq
    s.activate(10, 10)
    step(s)
    s.close()
    s = KVStore.open(cfg)
    assert s.recovery.snapshot_seq == at > 0
    s.close()


def test_recovery_logs_one_warning_for_all_dropped_checkpoints(make_store: MakeStore) -> None:
    """A store without a host tier drops every retained checkpoint at reopen: one warning
    line with the count, the first ids and the reasons counted, not one line each."""
    s = make_store()
    kept = []
    for _ in range(12):
        a = s.activate(10, 10)
        s.ensure_mapped(a, "main", 10)
        step(s)
        s.commit(a, "main", 10)
        s.finish(a, retain=True)
        kept.append(a)
    step(s)
    s.close()
    with structlog.testing.capture_logs() as logs:
        s2 = KVStore.open(s.config)
    s2.close()
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1, warned
    w = warned[0]
    assert w["event"] == "store.recovery_dropped" and w["count"] == 12
    assert w["checkpoints"] == kept[:8]
    assert w["reasons"] == {"pool main block 0: device-only page (no host replica)": 12}
    assert w["more_reasons"] == 0
    assert sorted(s2.recovery.dropped) == kept  # the full list stays on the report
