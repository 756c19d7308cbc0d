"""Trust issue item 18: every bad CLI input is one ``error:`` line on stderr and exit code 2 —
never a traceback, never exit 0. Run as a real subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from tests.engine.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("clierr")
    s = KVStore.open(small_config(d))
    s.finish(s.activate(64, 10))
    s.close()
    (d / "afile").write_text("not a journal")
    (d / "empty").mkdir()
    line = '{{"timestamp": {t}, "input_length": {n}, "output_length": 3, "hash_ids": {h}}}\n'
    bad = {"inf": line.format(t="Infinity", n=100, h="[1]"),     # review findings: tracebacks
           "listid": line.format(t=0, n=100, h="[[1]]"),          # (OverflowError, TypeError,
           "zero": line.format(t=0, n=0, h="[]"),                 # UnicodeDecodeError), or a
           "float": line.format(t=0, n=100.5, h="[1]")}           # negative ideal hit ratio
    for name, text in bad.items():
        (d / f"{name}.jsonl").write_text(text)
    (d / "bin.jsonl").write_bytes(b"\xff\xfe\x00\n")
    from ninfer_kv.journal import events as ev
    from ninfer_kv.journal.log import Journal, JournalOptions

    odd = Journal.open(str(d / "odd"), ev.CODEC, JournalOptions())  # a CRC-valid record whose
    odd.append([ev.Pin("main", b"abc")])  # packed int32 field is 3 bytes (a hand-made journal)
    odd.close()
    torn = Journal.open(str(d / "torn"), ev.CODEC, JournalOptions())
    for _ in range(3):
        torn.append([ev.CommitFrontiers("main", ev.pack([]), ev.pack([]))])
    torn.close()
    seg = d / "torn" / "seg-00000001.log"
    os.truncate(seg, seg.stat().st_size - 3)  # the last record torn, as a crash leaves it
    return {"j": str(d / "journal"), "file": str(d / "afile"), "empty": str(d / "empty"),
            "odd": str(d / "odd"), "torn": str(d / "torn"),
            "missing": str(d / "nope"), "root": str(d)}


CASES = [
    ["replay", "{missing}"], ["replay", "{file}"], ["replay", "{empty}"],
    ["inspect", "{missing}"], ["inspect", "{file}"], ["inspect", "{empty}"],
    ["dump", "{missing}"], ["events", "{empty}"], ["plot", "{file}", "-o", "{root}/x.png"],
    ["replay", "{j}", "--until", "-5"], ["replay", "{j}", "--verify", "--every", "0"],
    ["replay", "{j}", "--until", "ten"], ["inspect", "{j}", "--at", "-1"],
    ["inspect", "{j}", "--page", "nopool:3"], ["inspect", "{j}", "--page", "main"],
    ["simulate", "--limit", "-1"], ["simulate", "--accept-rate", "5"],
    ["simulate", "--host-bytes", "-1"], ["simulate", "--trace", "{missing}", "--limit", "2"],
    ["simulate", "--limit", "2", "--journal", "{file}"], ["plan", "--layers", "-3"],
    ["replay"], ["nosuchcommand"],
    # review findings (2026-12-02): each was a traceback, or exit 0 doing something else
    ["simulate", "--trace", "{root}/inf.jsonl"], ["simulate", "--trace", "{root}/bin.jsonl"],
    ["simulate", "--trace", "{root}/listid.jsonl"], ["simulate", "--trace", "{root}/zero.jsonl"],
    ["simulate", "--trace", "{root}/float.jsonl"], ["plot", "{j}", "-o", "{root}/out.xyz"],
    ["plot", "{j}", "-o", "{root}/noext"],
    ["simulate", "--tp", "2", "--limit", "2", "--journal", "{root}/tpj"],
    ["simulate", "--disagg", "--mtp"], ["simulate", "--standby", "--limit", "2"],
    # inspect answered exit 0 for what the journal does not hold: the last record's state
    # for a record past the end, an empty table for a sequence with no space
    ["inspect", "{j}", "--at", "999999"], ["replay", "{j}", "--until", "999999"],
    ["inspect", "{j}", "--seq", "999999"], ["inspect", "{j}", "--seq", "1", "--json"],
    # review findings (evening): a traceback (a Unicode digit, a packed field of 3 bytes) or
    # a plan that never returned (its plane inventory is per layer)
    ["inspect", "{j}", "--page", "main:\u00b3"], ["dump", "{odd}"],
    # review of the replay fix: dump --from past the end printed nothing with exit 0 (the
    # record after the last, a poller's next ask, still answers empty)
    ["dump", "{j}", "--from", "999999"],
    ["plan", "--layers", "100000000000000000000"], ["plan", "--head-dim", "99999"],
    # review findings (2026-12-03): on a torn journal (what a crash leaves) the library's
    # journal.cut warning came first, a second line; a slot never used answered exit 0
    ["replay", "{torn}", "--until", "99"], ["dump", "{torn}", "--from", "99"],
    ["inspect", "{torn}", "--seq", "99"], ["inspect", "{j}", "--page", "main:99999"],
]


def small_journal(tmp_path: Path, records: int) -> None:
    """``tmp_path / "journal"``: ``records`` records, each a sequence activated and finished."""
    s = KVStore.open(small_config(tmp_path))
    for _ in range(records):
        s.finish(s.activate(64, 10))
        with s.boundary():
            pass
    s.close()


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ninfer_kv.tools.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse refusals
        code = exc.code  # type: ignore[assignment]
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_bad_input_is_one_error_line_and_exit_2(dirs: dict[str, str], argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(**dirs) for a in argv]
    code, err = run_cli(args, capsys)
    lines = [x for x in err.splitlines() if x.strip()]  # a warning too is a second line
    assert code == 2, (args, code, err[-800:])
    assert len(lines) == 1 and lines[0].startswith("error:"), (args, err[-800:])


@pytest.mark.parametrize("argv", [["replay", "{missing}"], ["inspect", "{j}", "--at", "-1"],
                                  ["replay", "{torn}", "--until", "99"]])
def test_the_installed_entry_point_too(dirs: dict[str, str], argv: list[str]) -> None:
    args = [a.format(**dirs) for a in argv]
    r = subprocess.run([sys.executable, "-m", "ninfer_kv.tools.cli", *args], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_closed_pipe_is_not_an_error(dirs: dict[str, str], tmp_path: Path) -> None:
    """``ninfer-kv dump DIR | head -1``: the reader leaves early; no error line."""
    small_journal(tmp_path, 400)
    r = subprocess.run(f"{sys.executable} -m ninfer_kv.tools.cli dump {tmp_path / 'journal'} "
                       "| head -1", shell=True, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.stdout.count("\n") == 1 and "error" not in r.stderr, r.stderr[-500:]


def test_held_log_lines_are_printed_when_the_command_succeeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A command that succeeds on a torn journal prints the library's journal.cut warning
    (held while it ran), after its output."""
    small_journal(tmp_path, 3)
    seg = sorted((tmp_path / "journal").glob("seg-*.log"))[-1]
    os.truncate(seg, seg.stat().st_size - 3)  # the last record torn, as a crash leaves it
    code, err = run_cli(["replay", str(tmp_path / "journal"), "--json"], capsys)
    assert code == 0 and "journal.cut" in err, err[-500:]


def test_held_log_lines_stream_past_the_cap(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from ninfer_kv import LOG_SINK

    monkeypatch.setattr(LOG_SINK, "HOLD_MAX", 3)
    held: list[str] = []
    monkeypatch.setattr(LOG_SINK, "held", held)
    for i in range(3):
        LOG_SINK.write(f"line {i}\n")
    assert capsys.readouterr().err == "" and len(held) == 3
    LOG_SINK.write("line 3\n")  # past the cap: what was held, then this, and no more holding
    assert capsys.readouterr().err == "line 0\nline 1\nline 2\nline 3\n"
    assert LOG_SINK.held is None and not held
    LOG_SINK.write("line 4\n")
    assert capsys.readouterr().err == "line 4\n"


def test_held_log_lines_survive_a_sigterm(tmp_path: Path) -> None:
    """Review of 737d725: a long command ended by SIGTERM (timeout, systemd) lost every line
    it had logged; the CLI now unwinds on SIGTERM and writes them."""
    import signal
    import time

    j = tmp_path / "j"
    p = subprocess.Popen([sys.executable, "-m", "ninfer_kv.tools.cli", "simulate", "--offload",
                          "--limit", "100000", "--journal", str(j), "--json"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "NINFER_KV_LOG": "debug"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(j.glob("seg-*.log")):
        time.sleep(0.1)  # the store is open: journal.segment (debug) was logged
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-300:])
    assert b"journal.segment" in err, err[-300:]
