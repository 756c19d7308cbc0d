"""The kernels are compiled (or loaded from the JIT cache) once here, before any rank is
spawned: two children compiling at once would each pay the full JIT time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ninfer_kv import KVStore
from ninfer_kv.dist import Follower, Leader, shard_config
from tests.dist import workers as w


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels() -> None:
    from ninfer_kv import warmup

    warmup(["bf16"])


@pytest.fixture
def pair() -> Iterator[tuple[KVStore, Leader, Follower, list[bytes]]]:
    cfg = shard_config(w.config(), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    leader = Leader(store, sent.append)
    follower = Follower.from_hello(cfg, sent.pop(0))
    assert follower.store.digest() == store.digest()
    s = store.activate(100, 10)                      # record 1: activate
    store.ensure_mapped(s, "main", 100)
    with leader.boundary():
        pass
    store.commit(s, "main", 100)                     # record 2: commit + second sequence
    store.activate(20, 5)
    with leader.boundary():
        pass
    yield store, leader, follower, sent
    store.close()
