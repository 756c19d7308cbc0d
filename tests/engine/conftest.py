from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import Profile
from ninfer_kv.engine.store import KVStore, StoreConfig

MakeStore = Callable[..., KVStore]


def small_config(tmp: Path | None, *, pages: int = 64, concurrency: int = 4, context: int = 2048,
                 backend: Backend = Backend.OFF, profile: Profile = Profile.BF16,
                 journal: bool = True, **kw) -> StoreConfig:
    model = ModelGeometry(layers=2, kv_heads=2, head_dim=64, profile=profile, mtp_layers=1,
                          draft_layers=1 if backend is Backend.DFLASH else 0, draft_kv_heads=1,
                          draft_head_dim=64)
    serving = ServingConfig(max_context=context, max_concurrency=concurrency, backend=backend,
                            draft_window=kw.pop("draft_window", 4))
    kw.setdefault("journal_dir", str(tmp / "journal") if (journal and tmp) else None)
    return StoreConfig(model=model, serving=serving, kv_tokens=pages * 64, **kw)


@pytest.fixture
def make_store(tmp_path: Path) -> MakeStore:
    opened: list[KVStore] = []

    def make(**kw) -> KVStore:
        s = KVStore.open(small_config(tmp_path, **kw))
        opened.append(s)
        return s

    yield make
    for s in opened:
        if s.journal is not None:
            s.close()


def assert_refusals_change_nothing(s: KVStore, cases: list) -> None:  # noqa: ANN001
    """Each (exception type, message pattern, call) is refused with that typed error, and
    the digest, the pending events and the occupancy are as they were (commands plan fully,
    then emit)."""
    for exc, pattern, call in cases:
        before = (s.digest(), len(s._pending), s.occupancy())
        with pytest.raises(exc, match=pattern):
            call()
        assert (s.digest(), len(s._pending), s.occupancy()) == before, pattern
    s.check_invariants()


def crash(s: KVStore) -> None:
    """What ``kill -9`` does to a store: its file descriptors close with no flush and no fsync
    (written bytes stay in the OS page cache, as they would), its locks go, nothing pending is
    published. The object is dead afterwards."""
    if s.journal is not None:
        if s.journal._file is not None:
            s.journal._file.close()
        s.journal._file = None
        s.journal = None
    if s.arena is not None:
        s.arena.close()
        s.arena = None
    for lk in getattr(s, "_locks", []):
        lk.release()
    s._locks = []
    s._closed = True
