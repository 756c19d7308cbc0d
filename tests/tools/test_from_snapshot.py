"""Damage in a segment a snapshot covers: the store reopens the journal (its recovery starts
at the snapshot and never reads those segments), so a user must be able to replay and inspect
what the store runs from. By default the tools still check the whole log and refuse the
damage, saying that a snapshot covers it; ``--from-snapshot`` reads as recovery does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import InvalidArgument, JournalCorrupt
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.journal.restore import snapshot_segment
from ninfer_kv.replay import replay
from ninfer_kv.tools.cli import main
from tests.engine.conftest import small_config


def work(s: KVStore, n: int) -> None:
    for _ in range(n):
        s.finish(s.activate(64, 10))
        with s.boundary():
            pass


def flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(b)


@pytest.fixture
def covered(tmp_path: Path) -> tuple[str, str]:
    """(journal, the digest the store reopens it with): segment 1 damaged mid-log, a snapshot
    past it."""
    s = KVStore.open(small_config(tmp_path))
    work(s, 6)
    s.snapshot()
    work(s, 4)
    s.close()
    j = tmp_path / "journal"
    flip(j / "seg-00000001.log")
    s = KVStore.open(small_config(tmp_path))
    digest = s.digest()
    s.close()
    return str(j), digest


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    out = capsys.readouterr()
    return code, out.out, out.err


def test_default_refuses_and_names_the_way_out(covered: tuple[str, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    j, _ = covered
    with pytest.raises(JournalCorrupt, match="a snapshot covers this segment"):
        JournalReader(j)
    code, _, err = run(capsys, "replay", j)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "--from-snapshot" in lines[0], err


@pytest.mark.parametrize("cmd", ["replay", "inspect", "dump", "events"])
def test_from_snapshot_reads_what_the_store_reopens(covered: tuple[str, str], cmd: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    j, digest = covered
    code, out, err = run(capsys, cmd, j, "--from-snapshot", "--json")
    assert code == 0, err
    first = json.loads(out.splitlines()[0])
    if cmd in ("replay", "inspect"):
        assert first["digest"] == digest
    elif cmd == "dump":
        assert first["seq"] > 1  # the covered records are not read


def test_from_snapshot_plot(covered: tuple[str, str], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    j, _ = covered
    code, out, err = run(capsys, "plot", j, "--from-snapshot", "-o", str(tmp_path / "t.png"),
                         "--json")
    assert code == 0 and json.loads(out)["record"], err


def test_damage_past_the_snapshot_is_refused_either_way(tmp_path: Path) -> None:
    """Recovery reads this damage too (the store refuses it): so do both modes, and the
    default says nothing of a snapshot."""
    s = KVStore.open(small_config(tmp_path, segment_bytes=1024))
    work(s, 4)
    s.snapshot()
    work(s, 30)
    s.close()
    j = tmp_path / "journal"
    segs = sorted(j.glob("seg-*.log"))
    assert snapshot_segment(str(j), CODEC.schema[0]) < int(segs[-2].name[4:12])
    flip(segs[-2])  # after the snapshot's segment, with a later one: mid-log damage
    with pytest.raises(JournalCorrupt) as exc:
        JournalReader(str(j))
    assert "snapshot covers" not in str(exc.value)
    with pytest.raises(JournalCorrupt):
        JournalReader(str(j), from_snapshot=True)
    with pytest.raises(JournalCorrupt):
        KVStore.open(small_config(tmp_path, segment_bytes=1024))


def test_a_record_before_the_oldest_state_read_is_the_callers_request(
        covered: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Review finding: asking for a record the read starts after (--from-snapshot skips the
    records the snapshot covers) was reported as ``JournalCorrupt`` of an intact view: it
    is an out-of-range argument, ``InvalidArgument`` naming the record and the snapshot."""
    j, _ = covered
    reader = JournalReader(j, from_snapshot=True)
    first = reader.scan.first_seq
    assert first > 3
    with pytest.raises(InvalidArgument, match="record 3 lies before the oldest state"):
        replay(reader, until_record=3)
    assert replay(reader, until_record=first).state.seq == first
    for cmd in (["inspect", j, "--from-snapshot", "--at", "3"],
                ["replay", j, "--from-snapshot", "--until", "3"],
                ["dump", j, "--from-snapshot", "--from", "3"]):  # it began at the first
        code, _, err = run(capsys, *cmd)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and "InvalidArgument" in lines[0], err
        assert "corrupt" not in lines[0], err
    code, out, err = run(capsys, "dump", j, "--from-snapshot", "--from",
                         str(reader.last_seq + 1))  # a poller's next ask: nothing yet
    assert code == 0 and out == "", err
