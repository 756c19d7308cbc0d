"""A store's directories are resolved once, at open, to absolute paths without a symlink or a
``..``: the lock, the journal and the host arena name one directory however the path was
spelt and wherever the process later ``chdir``s. Review findings (high): a relative
``journal_dir`` followed a ``chdir`` (later segments and snapshots went elsewhere; a reopen
lost acknowledged checkpoints), and ``link/..`` was locked lexically but written physically
(two writers on one journal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ninfer_kv.engine.config import ConfigError
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import StoreLocked
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


def test_a_relative_journal_dir_does_not_follow_chdir(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "j").mkdir(parents=True)   # another directory named j
    monkeypatch.chdir(tmp_path / "a")
    cfg = small_config(None, pages=80, sync="commit", host_bytes=8 << 20, journal_dir="j",
                       persist_dir=str(tmp_path / "a" / "persist"))
    s = KVStore.open(cfg)
    assert s.config.journal_dir == str(tmp_path / "a" / "j")
    first = checkpoint_at(s, 100)
    s.offload(first)
    step(s)
    monkeypatch.chdir(tmp_path / "b")            # a library changes the working directory
    s.snapshot()                                 # ends the segment: the next one is new
    second = checkpoint_at(s, 200)
    s.offload(second)
    step(s)
    s.close()
    assert os.listdir(tmp_path / "b" / "j") == []
    monkeypatch.chdir(tmp_path / "a")
    r = KVStore.open(cfg)
    assert r.recovery.kept == [first, second]
    r.close()


def test_a_symlink_before_dotdot_is_one_directory_and_one_writer(tmp_path: Path) -> None:
    (tmp_path / "x" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "x" / "sub", tmp_path / "link")  # link/.. is x, not tmp_path
    real = KVStore.open(small_config(None, journal_dir=str(tmp_path / "x" / "j")))
    with pytest.raises(StoreLocked):
        KVStore.open(small_config(None, journal_dir=str(tmp_path / "link" / ".." / "j")))
    real.close()
    s = KVStore.open(small_config(None, journal_dir=str(tmp_path / "link" / ".." / "j")))
    assert s.config.journal_dir == str(tmp_path / "x" / "j") and not (tmp_path / "j").exists()
    s.close()


def test_one_directory_under_two_spellings_is_locked_once(tmp_path: Path) -> None:
    """persist_dir and journal_dir naming one directory (through a symlinked parent) were
    two locks on one file: the store refused itself."""
    (tmp_path / "real" / "d").mkdir(parents=True)
    os.symlink(tmp_path / "real", tmp_path / "alias")
    s = KVStore.open(small_config(None, persist_dir=str(tmp_path / "real" / "d"),
                                  journal_dir=str(tmp_path / "alias" / "d")))
    assert len(s._locks) == 1
    s.close()


@pytest.mark.parametrize("name", ["journal_dir", "persist_dir"])
def test_a_nul_byte_in_a_path_is_a_config_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="NUL"):
        small_config(None, **{name: str(tmp_path / "a\0b")})


def test_the_arena_file_is_allocated_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Review finding (medium): the arena was a sparse file, so a full disk surfaced as SIGBUS
    in a D2H copy into the mapping — the process died, and again after every restart. Its
    blocks are allocated at open: no full disk later, a ConfigError now."""
    import errno

    cfg = small_config(None, pages=80, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"))
    s = KVStore.open(cfg)
    st = os.stat(s.arena.path)
    assert st.st_blocks * 512 >= 8 << 20  # every block allocated, not a hole
    s.close()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="No space left"):
        KVStore.open(cfg)
