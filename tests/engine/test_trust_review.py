"""Regression tests for what an independent review of the trust fixes found (issue #11): the
same classes of bug on paths the first regression tests did not walk."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
from ninfer_kv.engine.state import ID_GAP
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import (
    ConfigError,
    InvalidArgument,
    JournalCorrupt,
    StoreFailed,
    StoreLocked,
    UnappliableRecord,
    WritePermissionError,
)
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import SEG_HEADER_SIZE
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode, paged_prefill
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step, write_tokens
from tests.engine.test_host_tier import host_store
from tests.engine.test_trust_durability import tree


def churn(s: KVStore, n: int) -> None:
    for _ in range(n):
        a = s.activate(64, 64)
        s.ensure_mapped(a, "main", 64)
        step(s)
        s.finish(a)
        step(s)


def test_compaction_never_trusts_a_snapshot_recovery_would_skip(tmp_path: Path) -> None:
    def open_() -> KVStore:
        return host_store(tmp_path, segment_bytes=512)

    s = open_()
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    churn(s, 20)
    s.snapshot()
    s.close()
    segs = sorted((tmp_path / "persist" / "journal").glob("seg-*.log"))
    assert segs[-1].stat().st_size == SEG_HEADER_SIZE  # the snapshot ended its segment
    segs.pop().unlink()  # crash before the segment after the snapshot existed
    os.truncate(segs[-1], segs[-1].stat().st_size - 5)  # the snapshot now names a cut record
    with pytest.raises(JournalCorrupt, match="proves records through"):
        open_()  # the snapshot proves the cut record was durable: damage, not a torn tail
    jdir = tmp_path / "persist" / "journal"
    Journal.open(str(jdir), CODEC, JournalOptions(salvage=True)).close()  # accept the loss
    s = open_()
    assert len(list(jdir.glob("*.stale"))) == 1  # set aside: never loaded, never counted
    churn(s, 5)
    s.compact()  # old code: removed the whole log on the strength of the stale snapshot
    s.close()
    s = open_()
    assert s.recovery.kept == [ck]
    s.close()


def test_a_persistent_journal_is_not_reopened_with_an_in_memory_arena(tmp_path: Path) -> None:
    right = small_config(None, pages=80, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"))
    s = KVStore.open(right)
    ck = checkpoint_at(s, 100)
    s.offload(ck, drop_device=True)
    step(s)
    s.close()
    before = tree(tmp_path)
    wrong = small_config(None, pages=80, host_bytes=8 << 20,
                         journal_dir=str(tmp_path / "p" / "journal"))
    with pytest.raises(ConfigError, match="file-backed"):
        KVStore.open(wrong)  # old code: opened, dropped every checkpoint for good
    assert tree(tmp_path) == before
    s = KVStore.open(right)
    assert s.recovery.kept == [ck]
    s.close()


def test_a_journal_is_reopened_only_with_the_arena_it_published_in(tmp_path: Path) -> None:
    """Review finding: another persist_dir (a typo, a relative path), a missing arena file or
    another store's arena of the same size was mapped, every replica failed its CRC and the
    durable checkpoints were released for good. The arena's identity token must match the
    journal's; nothing in the journal or the right arena changes on a refusal."""
    def cfg(persist: str) -> StoreConfig:
        return small_config(None, pages=80, host_bytes=8 << 20,
                            persist_dir=str(tmp_path / persist), journal_dir=str(tmp_path / "j"))

    s = KVStore.open(cfg("a"))
    ck = checkpoint_at(s, 100)
    s.offload(ck, drop_device=True)
    step(s)
    s.close()
    other = KVStore.open(small_config(None, pages=80, host_bytes=8 << 20,
                                      persist_dir=str(tmp_path / "b"),
                                      journal_dir=str(tmp_path / "bj")))
    other.close()  # "b" holds another store's arena, of the same size
    before = {p: tree(tmp_path / p) for p in ("a", "j")}
    for wrong, why in (("new", "is not the one journal"), ("b", "belongs to another journal")):
        with pytest.raises(ConfigError, match=why):
            KVStore.open(cfg(wrong))
    assert {p: tree(tmp_path / p) for p in ("a", "j")} == before
    s = KVStore.open(cfg("a"))
    assert s.recovery.kept == [ck]
    s.close()
    for token in (tmp_path / "j" / "ARENA", tmp_path / "a" / "host_arena.bin.id"):
        token.unlink()  # a journal and arena from before the tokens: the arena must exist
    (tmp_path / "a" / "host_arena.bin").rename(tmp_path / "a.bin")
    with pytest.raises(ConfigError, match="is missing"):
        KVStore.open(cfg("a"))
    (tmp_path / "a.bin").rename(tmp_path / "a" / "host_arena.bin")
    s = KVStore.open(cfg("a"))  # adopts the arena's token
    assert s.recovery.kept == [ck]
    s.close()
    assert (tmp_path / "j" / "ARENA").read_text() == \
        (tmp_path / "a" / "host_arena.bin.id").read_text()
    # the way out the refusal names, when the arena is lost for good: the checkpoints go
    (tmp_path / "a" / "host_arena.bin").unlink()
    with pytest.raises(ConfigError, match="is not the one journal") as refused:
        KVStore.open(cfg("a"))
    assert "host_arena.bin.id" in str(refused.value)
    (tmp_path / "j" / "ARENA").unlink()
    (tmp_path / "a" / "host_arena.bin.id").unlink()
    (tmp_path / "a" / "host_arena.bin").write_bytes(b"")
    s = KVStore.open(cfg("a"))
    assert s.recovery.kept == [] and ck in s.recovery.dropped
    s.close()


def test_a_new_journal_never_takes_over_another_journals_arena(tmp_path: Path) -> None:
    """Review finding: a new (or mistyped) journal_dir on an existing persist_dir adopted the
    arena's token, resized the arena and wrote its replicas over the first journal's durable
    checkpoints, which its next open released for good. A store without a journal may not
    open a journal's arena either; a refusal leaves every file as it was."""
    def cfg(journal: str | None, host_bytes: int = 8 << 20) -> StoreConfig:
        return small_config(None, pages=80, host_bytes=host_bytes,
                            persist_dir=str(tmp_path / "p"),
                            journal_dir=None if journal is None else str(tmp_path / journal))

    s = KVStore.open(cfg("j1"))
    ck = checkpoint_at(s, 100)
    s.offload(ck, drop_device=True)
    step(s)
    s.close()
    before = tree(tmp_path)
    for journal, host_bytes in (("j2", 4 << 20), ("j2", 8 << 20), (None, 8 << 20)):
        with pytest.raises(ConfigError, match="belongs to another journal"):
            KVStore.open(cfg(journal, host_bytes))  # old code: opened, resized, overwrote
    assert tree(tmp_path) == before
    s = KVStore.open(cfg("j1"))
    assert s.recovery.kept == [ck]
    s.close()


def test_a_crash_between_the_two_token_writes_is_adopted(tmp_path: Path) -> None:
    """The journal's token is written before the arena's: a first open that died between
    them left an arena without a token, which the next open takes (nothing was published)."""
    cfg = small_config(None, pages=80, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"),
                       journal_dir=str(tmp_path / "j"))
    KVStore.open(cfg).close()
    (tmp_path / "p" / "host_arena.bin.id").unlink()
    s = KVStore.open(cfg)
    ck = checkpoint_at(s, 100)
    s.offload(ck, drop_device=True)
    step(s)
    s.close()
    assert (tmp_path / "j" / "ARENA").read_text() == \
        (tmp_path / "p" / "host_arena.bin.id").read_text()
    s = KVStore.open(cfg)
    assert s.recovery.kept == [ck]
    s.close()


def test_another_model_geometry_is_refused(tmp_path: Path) -> None:
    def cfg(layers: int, heads: int) -> StoreConfig:
        return StoreConfig(model=ModelGeometry(layers=layers, kv_heads=heads, head_dim=64),
                           serving=ServingConfig(max_context=2048, max_concurrency=4),
                           kv_tokens=80 * 64, host_bytes=8 << 20,
                           persist_dir=str(tmp_path / "p"))

    s = KVStore.open(cfg(2, 2))
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    s.close()
    with pytest.raises(ConfigError, match="another geometry"):
        KVStore.open(cfg(4, 1))  # the same page bytes: old code served this KV to it
    KVStore.open(cfg(2, 2)).close()


def test_offload_copies_a_page_that_a_queued_copy_pins(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    c = checkpoint_at(s, 40)
    s.activate_from(c, 40, 40, 40)  # the COW of c's tail pins it until the boundary
    assert s.offload(c) == 1  # old code: 0, "already offloaded", and nothing was
    step(s)
    s.close()
    s = host_store(tmp_path)
    assert s.recovery.kept == [c]
    s.close()


def test_a_forked_child_neither_uses_nor_keeps_the_parents_store(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child: any use of the inherited store is refused; then it lingers
        try:
            s.activate(10, 10)
            code = 1
        except StoreFailed:
            code = 0
        s.close()  # writes nothing
        time.sleep(3)
        os._exit(code)
    time.sleep(0.5)
    a = s.activate(10, 10)
    step(s)
    s.finish(a)
    s.close()
    s2 = host_store(tmp_path)  # old code: StoreLocked by the child's inherited descriptor
    assert s2.recovery.cuts == []  # the child wrote nothing into the parent's journal
    s2.close()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_released_lock_is_free_while_a_fork_still_shares_its_descriptor(tmp_path: Path) -> None:
    """Review finding: ``release()`` only closed its descriptor, so while a child forked a
    moment before still held its copy (its at-fork hook not run yet) the lock stayed and the
    parent's own reopen was refused (20 of 20 runs). A dup stands for the child's copy: the
    release unlocks the description. A copy that is not the owner's never unlocks it."""
    from ninfer_kv.journal.lock import DirLock, _unlock_and_close

    d = str(tmp_path / "d")
    lk = DirLock(d)
    child_copy = os.dup(lk._fd)  # type: ignore[arg-type]
    lk.release()
    DirLock(d).release()  # old code: StoreLocked naming this process
    os.close(child_copy)
    lk = DirLock(d)
    _unlock_and_close(os.dup(lk._fd), owner=os.getpid() + 1)  # type: ignore[arg-type]
    with pytest.raises(StoreLocked):  # a child's close left the owner's lock in place
        DirLock(d)
    lk.release()
    DirLock(d).release()


def test_checked_writes_through_an_unpublished_table_are_refused(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=40, checked=True))
    a = s.activate(128, 64)
    s.ensure_mapped(a, "main", 128)
    step(s)
    write_tokens(s, a, "main", 0, 64)
    s.commit(a, "main", 64)
    s.truncate(a, "main", 64)  # a's second page group is freed; no boundary yet
    b = s.activate(64, 64)
    s.ensure_mapped(b, "main", 64)  # ... and handed to b
    s.ensure_mapped(a, "main", 128)
    k = torch.ones(1, 2, 64)
    with pytest.raises(WritePermissionError, match="not yet published"):
        append_kv(s.batch_view("main", 0), s.table_rows("main", [a]), torch.tensor([64]), k, k)
    step(s)
    append_kv(s.batch_view("main", 0), s.table_rows("main", [a]), torch.tensor([64]), k, k)
    s.close()


def test_mtp_lease_growth_runs_to_the_end_of_the_budget(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=128, backend=Backend.MTP, lease_growth=True))
    a = s.activate(2000, 48)  # budget 2048 = S: the MTP lead cannot reach past L pages
    for pool in s.pools:
        s.ensure_mapped(a, pool, 2000)
    step(s)
    for pool in s.pools:
        s.commit(a, pool, 2000)
    assert s.grow(1).exhausted == {}  # old code: exhausted 48 tokens early
    s.close()


def test_strings_that_cannot_be_journaled_are_refused(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(10, 10)
    d = s.digest()
    with pytest.raises(InvalidArgument, match="UTF-8"):
        s.finish(a, reason="stop\ud800")
    assert s.digest() == d
    step(s)  # old code: StoreFailed here
    s.close()


def test_a_failed_allocation_is_refused_before_the_journal_changes(tmp_path: Path,
                                                                   monkeypatch) -> None:  # noqa: ANN001
    cfg = small_config(tmp_path)
    s = KVStore.open(cfg)
    s.activate(10, 10)
    step(s)
    s.close()
    last = sorted((tmp_path / "journal").glob("seg-*.log"))[-1]
    with open(last, "ab") as f:  # (a new file under a segment's name is damage, not a tail)
        f.write(b"\x01" * 37)  # a torn tail that a writable open would cut
    before = tree(tmp_path)
    from ninfer_kv.engine import opening

    def no_memory(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(opening, "DeviceState", no_memory)
    with pytest.raises(ConfigError, match="cannot allocate"):
        KVStore.open(cfg)  # old code: raw RuntimeError after the tail was cut
    assert tree(tmp_path) == before


def test_unappliable_records_are_typed_in_replay_and_the_tools(tmp_path: Path,
                                                               capsys) -> None:  # noqa: ANN001
    from ninfer_kv.tools.cli import main

    d = str(tmp_path / "j")
    j = Journal.open(d, CODEC)
    j.append([ev.Release(7, "main")])  # well-formed, but no such pool or sequence
    j.close()
    with pytest.raises(UnappliableRecord, match="record 1 event 0 \\(Release\\)"):
        replay(d)
    for cmd in (["replay", d], ["inspect", d], ["events", d, "--json"], ["plot", d, "-o",
                                                                            str(tmp_path / "x.png")]):
        assert main(cmd) == 2, cmd  # old code: KeyError traceback
        assert capsys.readouterr().err.startswith("error: UnappliableRecord")


def test_a_failed_journal_closes_its_descriptor(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = host_store(tmp_path)
    c = checkpoint_at(s, 100)
    f = s.journal._file
    monkeypatch.setattr(type(f), "fsync",
                        lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    s.offload(c)
    with pytest.raises(StoreFailed):
        step(s)
    fd = f._fd
    s.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # old code: the segment stayed open


def test_kernel_index_tensors_must_be_integer_tensors(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 64)
    s.ensure_mapped(a, "main", 64)
    step(s)
    view = s.batch_view("main", 0)
    rows = s.table_rows("main", [a])
    k = torch.zeros(1, 2, 64)
    for bad in (lambda: append_kv(view, rows, torch.tensor([3.9]), k, k),
                lambda: append_kv(view, rows.float(), torch.tensor([3]), k, k),
                lambda: append_kv(view, [0], torch.tensor([3]), k, k),
                lambda: paged_decode(torch.zeros(1, 64), view, rows, torch.tensor([3])),
                lambda: paged_decode(torch.zeros(1, 4, 64), view, rows, torch.tensor([3.0])),
                lambda: paged_prefill(torch.zeros(1, 4, 64), view, rows, torch.tensor([3])),
                lambda: paged_prefill(torch.zeros(1, 1, 4, 64), view, rows,
                                      torch.tensor([[3]]))):
        with pytest.raises(InvalidArgument):
            bad()
    s.close()


def test_more_bad_inputs_are_typed(tmp_path: Path) -> None:
    from ninfer_kv.engine.pages import PageHandle

    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 64)
    for call in (lambda: s.page(PageHandle("main", 1.5, 0)),
                 lambda: s.page(PageHandle("main", None, 0)),
                 lambda: s.entitlement_pages("main", None, None),
                 lambda: s.entitlement_pages("main", -1, 10),
                 lambda: s.commit_many("main", {a: 1}, {64: 1})):
        with pytest.raises(InvalidArgument):
            call()
    step(s)
    events = s.stats["events"]
    s.commit_many("main", [], [])  # nothing to commit: nothing journaled
    step(s)
    assert s.stats["events"] == events
    for cfg in (lambda: StoreConfig(model=None), lambda: StoreConfig(serving="x"),
                lambda: StoreConfig(journal_dir=b"/tmp/x"), lambda: StoreConfig(persist_dir=""),
                lambda: StoreConfig(journal_dir="")):
        with pytest.raises(ConfigError):
            cfg()
    s.close()


def test_plan_cli_uses_the_clamped_default(capsys) -> None:  # noqa: ANN001
    from ninfer_kv.tools.cli import main

    assert main(["plan", "--max-context", "2048", "--max-concurrency", "4", "--json"]) == 0
    assert '"M": 128' in capsys.readouterr().out


def test_a_malformed_trace_is_one_error_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from ninfer_kv.tools.cli import main

    for text in ("not json\n", '{"timestamp": 1, "input_length": "x"}\n', '{"timestamp": 1}\n'):
        (tmp_path / "t.jsonl").write_text(text)
        assert main(["simulate", "--trace", str(tmp_path / "t.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: InvalidArgument") and "t.jsonl:1" in err


def test_a_snapshot_that_breaks_the_invariants_is_skipped(tmp_path: Path) -> None:
    """The snapshot is judged when it is loaded, before any record is applied to it: refused
    like one that does not decode, so the store recovers from the log (before: it was used,
    and the open failed at the end, or a later record was blamed for its damage)."""
    import copy

    from ninfer_kv.engine.state import encode_state

    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 64)
    step(s)
    broken = copy.deepcopy(s.state)  # well-formed, on the log's CRC chain, and wrong:
    broken.pools["main"].spaces[a].provisional = 10_000  # past its membership
    s.close()
    j = Journal.open(str(tmp_path / "journal"), CODEC)
    j.write_snapshot(encode_state(broken))
    j.close()
    s2 = KVStore.open(s.config)
    skipped = " | ".join(s2.recovery.snapshots_skipped)
    assert "breaks §14" in skipped and "provisional" in skipped, skipped
    assert s2.recovery.records == s.state.seq  # every record replayed from the log
    s2.close()
    assert replay(str(tmp_path / "journal")).digest == s2.digest()


def test_a_compacted_log_under_a_broken_snapshot_is_refused(tmp_path: Path) -> None:
    """With the records before it compacted away, nothing replaces the refused snapshot:
    ``JournalCorrupt``, nothing written; replay refuses it too (before: it replayed from
    the broken state)."""
    from ninfer_kv.engine.state import decode_state, encode_state
    from ninfer_kv.journal.format import pack_snapshot, parse_snapshot

    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 64)
    step(s)
    path = Path(s.snapshot())
    assert s.compact() > 0
    s.close()
    good = parse_snapshot(path.read_bytes())
    assert not isinstance(good, str)
    broken = decode_state(good.payload)
    broken.pools["main"].spaces[a].provisional = 10_000
    path.write_bytes(pack_snapshot(good.schema_major, good.seq, good.last_crc,
                                   encode_state(broken)))
    before = tree(tmp_path)
    with pytest.raises(JournalCorrupt, match="no usable snapshot"):
        KVStore.open(s.config)
    assert tree(tmp_path) == before
    with pytest.raises(JournalCorrupt, match="breaks §14"):  # replay judges it as open does
        replay(str(tmp_path / "journal"))


def test_compact_keeps_what_a_snapshot_open_would_skip_needs(tmp_path: Path) -> None:
    """Review repro: compact judged snapshots by whether they decode, so one that decodes but
    breaks §14 licensed removing 5 segments — and open, which skips it, then had no log to
    fall back to (JournalCorrupt). compact now asks what open asks."""
    from ninfer_kv.engine.state import decode_state, encode_state

    cfg = small_config(tmp_path, segment_bytes=512)
    s = KVStore.open(cfg)
    for _ in range(6):
        s.release(checkpoint_at(s, 300))
        step(s)
    bad = decode_state(encode_state(s.state))
    bad.pools["main"].reserved += 1          # decodes; breaks §14
    assert s.journal is not None
    s.journal.write_snapshot(encode_state(bad))
    assert s.compact() == 0
    s.close()
    s2 = KVStore.open(cfg)
    assert "breaks §14" in s2.recovery.snapshots_skipped[0]
    assert s2.recovery.snapshot_seq == 0  # the whole log, replayed
    s2.close()


def test_recovered_state_must_pass_the_invariants(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check after replay is the second line behind apply's refusals and the snapshot's
    own check: a record applied wrongly (here an apply bug, simulated) fails the open."""
    from ninfer_kv.engine import opening

    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 64)
    step(s)
    s.close()
    real = opening._apply_record

    def buggy(st, seq, payload) -> None:  # noqa: ANN001
        real(st, seq, payload)
        if a in st.pools["main"].spaces:
            st.pools["main"].spaces[a].provisional = 10_000

    monkeypatch.setattr(opening, "_apply_record", buggy)
    with pytest.raises(JournalCorrupt, match="the recovered state breaks §14"):
        KVStore.open(s.config)


@pytest.mark.parametrize("damage", ["member", "negative member", "row", "page slot",
                                    "page group", "pin", "negative seq", "seq past the next",
                                    "negative bundle", "host offset", "half a host replica",
                                    "pending extent", "float row", "float budget"])
def test_a_snapshot_with_ids_out_of_range_does_not_load(tmp_path: Path, damage: str) -> None:
    """A snapshot's ids index the pool's arrays, and the compiled loops that read them later do
    not bounds-check: a Finish(retain) of a membership naming slot 67 of a 2-slot pool wrote
    past the arrays (found in review). decode_state refuses such a snapshot (ValueError: it
    is then skipped like one that does not decode), and the store recovers from the log."""
    import msgspec

    from ninfer_kv.engine.state import _StateSnap, decode_state, encode_state

    host = {"host_bytes": 8 << 20} if damage == "pending extent" else {}
    s = KVStore.open(small_config(tmp_path, **host))
    a = s.activate(100, 100)
    s.ensure_mapped(a, "main", 100)
    step(s)
    s.commit(a, "main", 100)
    ck = s.finish(a, retain=True)
    step(s)
    st = decode_state(encode_state(s.state))
    p = st.pools["main"]
    sp = p.spaces[ck]
    if damage == "member":
        sp.members = [sp.members[0], p.n_slots + 3]
    elif damage == "negative member":
        sp.members = [-1]
    elif damage == "row":
        sp.row = p.rows + 1
    elif damage in ("page slot", "negative seq", "seq past the next", "negative bundle",
                    "host offset", "half a host replica", "float row", "float budget"):
        pass  # below, in the encoded snapshot
    elif damage == "page group":
        p.pg_device[sp.members[0]] = p.capacity + 5
    else:
        st.copy_pins[("main", p.n_slots + 9)] = 1
    if damage == "pending extent":  # a transfer in flight whose extent was never carved
        s.offload(ck)
        st = decode_state(encode_state(s.state))
        (first, (name, slots, offs)), = st.host_pending.items()
        st.host_pending[first] = (name, slots, (offs[0], -4096, *offs[2:]))
        step(s)  # let the real transfer finish before the store closes
    payload = encode_state(st)
    if damage == "page slot":
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)
        snap.pools[0].pages[-1][0] = len(snap.pools[0].gens) + 7
        payload = msgspec.msgpack.encode(snap)
    elif damage in ("negative seq", "seq past the next"):  # a space's seq: bundle_index[-1]
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)   # would wrap to the last one
        t = snap.pools[0].spaces[0]
        snap.pools[0].spaces[0] = (-1 if damage == "negative seq" else snap.next_bundle, *t[1:])
        payload = msgspec.msgpack.encode(snap)
    elif damage == "negative bundle":
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)
        snap.bundles[0] = (-2, *snap.bundles[0][1:])
        payload = msgspec.msgpack.encode(snap)
    elif damage == "float row":  # the space tuple is loosely typed: numpy would truncate it
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)
        t = snap.pools[0].spaces[0]
        snap.pools[0].spaces[0] = (*t[:6], -0.5, *t[7:])
        payload = msgspec.msgpack.encode(snap)
    elif damage == "float budget":
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)
        snap.bundles[0] = (*snap.bundles[0][:5], 1.5, *snap.bundles[0][6:])
        payload = msgspec.msgpack.encode(snap)
    elif damage in ("host offset", "half a host replica"):  # page columns 10..13: the replica
        snap = msgspec.msgpack.decode(payload, type=_StateSnap)
        page = snap.pools[0].pages[-1]
        page[10:14] = [-5, 0, 0, 0] if damage == "host offset" else [-1, 3, 0, 0]
        payload = msgspec.msgpack.encode(snap)
    with pytest.raises(ValueError, match="out of range|wrong type"):
        decode_state(payload)
    s.close()
    shutil.copytree(tmp_path / "journal", tmp_path / "clean")
    j = Journal.open(str(tmp_path / "journal"), CODEC)
    j.write_snapshot(payload)
    j.close()
    again = KVStore.open(s.config)  # the snapshot is skipped: the whole log is replayed
    clean = KVStore.open(dataclasses.replace(s.config, journal_dir=str(tmp_path / "clean")))
    assert again.digest() == clean.digest() and not again.check_invariants()
    assert again.recovery.snapshots_skipped  # and says so
    again.close()
    clean.close()


def test_a_boundary_stops_on_an_execution_row_outside_the_table(tmp_path: Path) -> None:
    """The boundary's compiled table write does not bounds-check: an active sequence whose
    row lies past the table (a damaged state; apply never leases one) stops the store before
    anything is written into another row's memory, instead of publishing through it."""
    s = KVStore.open(small_config(tmp_path))
    a, b = s.activate(100, 100), s.activate(100, 100)
    step(s)
    p, pd = s.state.pools["main"], s.device.pools["main"]
    before = pd.host_tables.copy()
    p.sp_row[p.spaces[a].i] = p.rows + 3   # damage: a row the table does not have
    s.ensure_mapped_many("main", [a, b], [100, 100])
    with pytest.raises(StoreFailed, match=f"row {p.rows + 3}, outside the {p.rows} rows"):
        step(s)
    assert (pd.host_tables == before).all()


def test_a_boundary_stops_on_a_membership_naming_another_page(tmp_path: Path) -> None:
    """The same for a membership (damaged in memory: only a bug gets there, since open checks
    §14 first) whose new block names a negative slot: numba would wrap it onto another
    sequence's page and map that page group into this sequence's row."""
    s = KVStore.open(small_config(tmp_path))
    a, b = s.activate(100, 100), s.activate(100, 100)
    s.ensure_mapped_many("main", [a, b], [64, 64])
    step(s)
    p, pd = s.state.pools["main"], s.device.pools["main"]
    s.ensure_mapped_many("main", [a], [100])             # a's block 1, published at the step
    before = pd.host_tables.copy()
    i = p.spaces[a].i
    p.sp_members[i, 1] = p.spaces[b].member(0) - len(p.pg_live)   # damage: wraps onto b's page
    with pytest.raises(StoreFailed, match="names a slot that is no live page"):
        step(s)
    assert (pd.host_tables == before).all()


@pytest.mark.parametrize("damage", ["new extent", "replaced extent", "dead slot"])
def test_a_host_publish_refused_changes_nothing(tmp_path: Path, damage: str) -> None:
    """Review finding: a HostPublish whose pending transfer names an extent that is not
    allocated (a damaged state; apply and decode_state never make one) was refused midway —
    the transfer gone, one page published and unpinned, the others pinned. Every rule is now
    checked before anything changes."""
    from ninfer_kv.engine.apply import apply
    from ninfer_kv.engine.state import digest
    from ninfer_kv.errors import APPLY_ERRORS

    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20, pages=64))
    ck = checkpoint_at(s, 150)
    s.offload(ck)   # HostReserve applied; its HostPublish would come at the boundary
    st = s.state
    (first, (pool, slots, offs)), = st.host_pending.items()
    p = st.pools[pool]
    if damage == "new extent":
        st.host_pending[first] = (pool, slots, (offs[0], -4096, *offs[2:]))
    elif damage == "replaced extent":  # an older replica the publish would free
        p.host_of[slots[1]] = (1 << 40, 0, 64, 1)
    else:
        p.pg_live[slots[1]] = False
    before = (digest(st), dict(st.host_pending), p.pg_pins[list(slots)].tolist())
    n = len(slots)
    e = ev.HostPublish(pool, first, ev.pack(list(slots)), ev.pack([0] * n), ev.pack([64] * n),
                       ev.pack_u32([1] * n))
    with pytest.raises(APPLY_ERRORS, match="are not live pages" if damage == "dead slot"
                       else r"extents \[.*\] are not allocated"):
        apply(st, e)
    assert (digest(st), dict(st.host_pending), p.pg_pins[list(slots)].tolist()) == before


@pytest.mark.parametrize("token", ["j/ARENA", "a/host_arena.bin.id"])
def test_an_unreadable_arena_token_is_a_config_error(tmp_path: Path, token: str) -> None:
    """Review finding: a directory under an arena identity token's name made open raise a
    bare IsADirectoryError naming no file."""
    def cfg() -> StoreConfig:
        return small_config(None, pages=80, host_bytes=8 << 20,
                            persist_dir=str(tmp_path / "a"), journal_dir=str(tmp_path / "j"))

    KVStore.open(cfg()).close()
    (tmp_path / token).unlink()
    (tmp_path / token).mkdir()
    with pytest.raises(ConfigError, match=f"cannot read .*{token.split('/')[1]}: Is a direct"):
        KVStore.open(cfg())


def test_a_child_forked_by_c_code_writes_nothing_into_the_parents_journal(
        tmp_path: Path) -> None:
    """Review finding (55d1b19): commands check a pid that ``os.register_at_fork`` renews,
    which a fork made by C code (here ``libc.fork`` through ctypes) bypasses. Such a child
    published a record into the parent's journal, and the parent's own next record was then
    cut on reopen as a torn tail. Now what writes files (a boundary, snapshot, compact) asks
    the kernel: the child is refused there; its own store, opened after the fork, works."""
    import ctypes

    s = host_store(tmp_path / "parent")
    s.activate(10, 10)
    step(s)
    pid = ctypes.CDLL(None).fork()
    if pid == 0:  # the child: exit 0 only if the parent's store refuses and its own works
        code = 1
        try:
            s.activate(10, 10)  # its own memory only
            try:
                with s.boundary():
                    pass
            except StoreFailed:
                for what in (s.snapshot, s.compact):
                    try:
                        what()
                        break
                    except StoreFailed:
                        pass
                else:
                    own = KVStore.open(small_config(tmp_path / "child", pages=64,
                                                    concurrency=4, allocate_planes=False))
                    b = own.activate(10, 10)
                    step(own)
                    own.finish(b)
                    own.close()
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    b = s.activate(10, 10)
    step(s)
    s.close()
    s2 = host_store(tmp_path / "parent")
    assert s2.recovery.cuts == [] and s2.state.next_bundle == b + 1 + ID_GAP  # the reopen's
    s2.close()
