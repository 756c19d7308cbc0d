"""Two small files in a journal directory that keep seq ids from coming back after a reopen
(docs/journal-format.md; engine/restart.py uses them):

* ``NEXT_ID`` — a floor: every id handed out before the last reopen, and every id of the
  segments a compaction removed, is below it, whatever a later recovery cuts from the log (a
  cut can take the reopen record that moved the next id on, or the only segment left after a
  compaction).
* ``CUT`` — the bytes recoveries cut that no reopened store has accounted for yet: written
  durably before a cut, removed by the store once its reopen record is durable. Each id a
  cut record handed out took at least one of its bytes.

Both hold one decimal integer. One that is not (or is negative) is ``JournalCorrupt``: the
store does not guess how many ids to skip; an operator removes or fixes the file.
"""

from __future__ import annotations

import os

import structlog

from ninfer_kv.errors import JournalCorrupt, JournalError
from ninfer_kv.journal.fs import OS_FS, FileSystem, cannot_read, replace_durably

log = structlog.get_logger(__name__)

CUT_NOTE = "CUT"
NEXT_ID = "NEXT_ID"


def read_count(directory: str, name: str, fs: FileSystem = OS_FS) -> int:
    """The integer file ``name`` holds (0 when there is none)."""
    path = os.path.join(directory, name)
    try:
        if name not in fs.listdir(directory):
            return 0
        text = fs.read(path, 64)
    except OSError as exc:  # not a regular file (a symlink, a directory), or unreadable
        raise JournalError(cannot_read(path, exc)) from None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0 or len(text) > 32:
        raise JournalCorrupt(0, 0, f"{path} holds {bytes(text)[:32]!r}, not a count: it says "
                             "how many seq ids a reopen must skip; fix or remove it")
    return n


def write_count(directory: str, name: str, n: int, fs: FileSystem = OS_FS) -> None:
    """``name`` holds ``n``, durably (``JournalError`` when it cannot be written)."""
    try:
        replace_durably(fs, os.path.join(directory, name), f"{n}\n".encode())
    except OSError as exc:
        raise JournalError(f"cannot write {os.path.join(directory, name)}: "
                           f"{exc.strerror or exc}") from None


def add_cut_note(directory: str, cut: int, fs: FileSystem = OS_FS) -> None:
    """Before ``cut`` bytes are cut from the log: add them to ``CUT``, durably."""
    if cut > 0:
        write_count(directory, CUT_NOTE, read_count(directory, CUT_NOTE, fs) + cut, fs)


def clear_cut_note(directory: str, fs: FileSystem = OS_FS) -> None:
    """Remove ``CUT``. A failure is logged, not raised: a note left behind only makes the
    next reopen skip more ids than it must."""
    try:
        if CUT_NOTE in fs.listdir(directory):
            fs.remove(os.path.join(directory, CUT_NOTE))
            fs.fsync_dir(directory)
    except OSError as exc:
        log.warning("journal.cut_note_left", directory=directory, error=str(exc))


def raise_floor(directory: str, n: int, fs: FileSystem = OS_FS) -> None:
    """``NEXT_ID`` at least ``n``, durably (before a compaction removes segments)."""
    if read_count(directory, NEXT_ID, fs) < n:
        write_count(directory, NEXT_ID, n, fs)
