"""One test per journal validity rule the mutation check found otherwise unguarded: each
record check (salt, seq, chain) on its own, a damaged header or a missing segment mid-log,
refusals of open/append, payloads that do not decode or apply, snapshots of a newer schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import JournalCorrupt, JournalError
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import pack_record, pack_snapshot, parse_snapshot
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.journal.recovery import scan
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.journal.crashfs import CrashFS
from tests.journal.test_journal import batch


def three_records(d: Path) -> tuple[Journal, Path]:
    j = Journal.open(str(d), CODEC)
    for s in range(1, 4):
        j.append(batch(s))
    return j, d / "seg-00000001.log"


@pytest.mark.parametrize("field", ["salt", "seq", "chain"])
def test_each_record_check_stands_alone(tmp_path: Path, field: str) -> None:
    """A CRC-valid record wrong in exactly one framing field is never accepted."""
    j, seg = three_records(tmp_path)
    salt, seq, prev = j._salt, j.last_seq + 1, j.last_crc
    j.close()
    if field == "salt":
        salt ^= 1
    elif field == "seq":
        seq += 1
    else:
        prev ^= 1
    frame, _ = pack_record(seq, prev, salt, 0, CODEC.encode(batch(9)))
    with open(seg, "ab") as f:
        f.write(frame)
    res = scan(str(tmp_path), schema_major=1, repair=False)
    assert res.last_seq == 3 and res.cuts  # cut as a torn tail, never applied


def test_a_damaged_header_of_a_segment_that_is_not_last_is_corruption(tmp_path: Path) -> None:
    j = Journal.open(str(tmp_path), CODEC, JournalOptions(segment_bytes=512))
    for s in range(1, 40):
        j.append(batch(s))
    j.close()
    first = tmp_path / "seg-00000001.log"
    data = bytearray(first.read_bytes())
    data[3] ^= 0xFF  # the magic
    first.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="bad magic|CRC mismatch"):
        scan(str(tmp_path), schema_major=1, repair=False)


def test_a_missing_middle_segment_is_corruption(tmp_path: Path) -> None:
    j = Journal.open(str(tmp_path), CODEC, JournalOptions(segment_bytes=512))
    for s in range(1, 40):
        j.append(batch(s))
    j.close()
    segs = sorted(tmp_path.glob("seg-*.log"))
    assert len(segs) >= 3
    segs[1].unlink()
    with pytest.raises(JournalCorrupt, match="segment starts at seq"):
        scan(str(tmp_path), schema_major=1, repair=False)


def test_open_refuses_a_directory_under_a_file_and_a_repair_that_fails(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(JournalError, match="cannot create journal directory"):
        Journal.open(str(tmp_path / "f" / "j"), CODEC)
    fs = CrashFS()
    j = Journal.open("/j", CODEC, fs=fs)
    j.append(batch(1))
    j.close()
    fs.files["/j/" + "seg-00000001.log"].durable.extend(b"\x07" * 11)  # a torn tail

    def no_truncate(path: str, size: int) -> None:
        raise OSError(30, "Read-only file system")

    fs.truncate = no_truncate  # type: ignore[method-assign]
    with pytest.raises(JournalError, match="cannot repair"):
        Journal.open("/j", CODEC, fs=fs)


def test_append_after_close_is_refused(tmp_path: Path) -> None:
    j, _ = three_records(tmp_path)
    j.close()
    with pytest.raises(JournalError, match="is closed"):
        j.append(batch(4))


def test_a_payload_that_does_not_decode_is_corruption(tmp_path: Path) -> None:
    j, _ = three_records(tmp_path)
    j.append_payload(b"\xc1 not msgpack")
    j.close()
    with pytest.raises(JournalCorrupt, match="payload does not decode"):
        list(JournalReader(str(tmp_path)).records())


def test_a_record_that_does_not_apply_stops_the_open(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    s.close()
    j = Journal.open(str(tmp_path / "journal"), CODEC)
    j.append([ev.Release(999, "main")])
    j.close()
    with pytest.raises(JournalCorrupt, match="cannot be applied"):
        KVStore.open(s.config)


def test_a_snapshot_of_a_newer_schema_is_skipped(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    s.activate(10, 10)
    path = Path(s.snapshot())
    s.close()
    parsed = parse_snapshot(path.read_bytes())
    assert not isinstance(parsed, str)
    newer = pack_snapshot(parsed.schema_major + 1, parsed.seq, parsed.last_crc, parsed.payload)
    path.write_bytes(newer)
    s2 = KVStore.open(s.config)
    assert any("schema major" in why for why in s2.recovery.snapshots_skipped)
    s2.close()
    assert replay(str(tmp_path / "journal")).digest == s2.digest()


def test_a_journal_directory_that_cannot_be_made_is_a_journal_error(tmp_path: Path) -> None:
    """``Journal.open`` without taking the lock (``KVStore.open`` holds it already; a fake
    file system takes none) creates the directory itself: a path under a regular file is
    ``JournalError`` naming it (mutation check: this refusal had no test)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(JournalError, match=f"cannot create journal directory {blocker}/j"):
        Journal.open(str(blocker / "j"), CODEC, lock=False)
