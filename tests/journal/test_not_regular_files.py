"""A journal file that is not a regular file is a typed refusal, never a hang.

From an outside review (2026-12-03): a FIFO named like a segment made ``ninfer-kv replay``,
``Journal.open`` and ``KVStore.open`` block in ``open(2)`` until some writer appeared. Every
store file is opened through ``fs.open_private``, which now opens without blocking and refuses
anything but a regular file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.format import snapshot_name
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import step

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")

NAMES = {"segment": "seg-00000009.log", "snapshot": snapshot_name(1)}


def journal_with_a_fifo(tmp_path: Path, name: str) -> Path:
    s = KVStore.open(small_config(tmp_path))
    s.activate(10, 10)
    step(s)
    s.close()
    d = tmp_path / "journal"
    os.mkfifo(d / name)
    return d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(NAMES))
def test_the_cli_answers_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    d = journal_with_a_fifo(tmp_path, NAMES[kind])
    for argv in (["replay", str(d), "--json"], ["inspect", str(d)]):
        try:
            p = subprocess.run([sys.executable, "-m", "ninfer_kv.tools.cli", *argv],
                               capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:  # old code: blocked in open(2) for good
            raise AssertionError(f"{argv[0]} hung on a FIFO named {NAMES[kind]}") from None
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (argv, p.returncode, p.stderr)
        assert lines[0].startswith("error:") and "not a regular file" in lines[0], lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(NAMES))
@pytest.mark.parametrize("opener", ["store", "journal", "replay"])
def test_opening_refuses_typed(tmp_path: Path, kind: str, opener: str) -> None:
    d = journal_with_a_fifo(tmp_path, NAMES[kind])
    calls: dict[str, Callable[[], object]] = {
        "store": lambda: KVStore.open(small_config(tmp_path)),
        "journal": lambda: Journal.open(str(d), ev.CODEC, JournalOptions()),
        "replay": lambda: replay(str(d)),
    }
    with pytest.raises(KVStoreError, match="not a regular file"):
        calls[opener]()


@pytest.mark.timeout(60)
def test_a_host_arena_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"),
                       journal_dir=None)
    KVStore.open(cfg).close()
    arena = next(p for p in (tmp_path / "p").iterdir() if p.is_file() and p.suffix != ".id"
                 and p.name != "LOCK")
    arena.unlink()
    os.mkfifo(arena)
    with pytest.raises(KVStoreError, match="not a regular file"):
        KVStore.open(cfg)


@pytest.mark.timeout(60)
def test_a_regular_file_under_a_lease_is_waited_for_not_refused(tmp_path: Path) -> None:
    """Review of dc10b53: a non-blocking open of a regular file another process holds a read
    lease on (F_SETLEASE: Samba oplocks, indexing agents) fails with EWOULDBLOCK at once;
    the blocking open waits for the holder to release it, as before."""
    import subprocess
    import textwrap

    cfg = small_config(tmp_path, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"),
                       journal_dir=None)
    KVStore.open(cfg).close()
    arena = next(p for p in (tmp_path / "p").iterdir() if p.is_file() and p.suffix != ".id"
                 and p.name != "LOCK")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, signal, time
        fd = os.open({str(arena)!r}, os.O_RDONLY)
        def release(*a):  # a cooperative holder: it lets go when the kernel breaks the lease
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        signal.signal(signal.SIGIO, release)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            print("no lease:", exc, flush=True)
            raise SystemExit(0)
        print("leased", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line != b"leased\n":  # this file system or kernel gives no leases: nothing to test
            pytest.skip(f"no file lease here: {line!r}")
        KVStore.open(cfg).close()  # old code: refused at once, [Errno 11]
    finally:
        holder.kill()
        holder.wait()
