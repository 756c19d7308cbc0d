"""Metadata: set_metadata refuses what cannot be decoded again; apply refuses only bytes that
are not one msgpack value; readers type what an older journal holds and cannot decode.

Review of c1a1237 (2026-12-03): apply decoded every SetMetadata fully, so values msgspec
encodes but cannot decode back (a map keyed by a frozen dataclass, an invalid timestamp Ext)
stopped the store when set_metadata emitted them, and made journals holding them unopenable;
the decode's recursion limit also depended on the caller's stack depth."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ninfer_kv.cache.index import PrefixIndex
from ninfer_kv.cache.retention import residency
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import InvalidArgument, StateError
from ninfer_kv.journal import events as ev
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


@dataclasses.dataclass(frozen=True)
class Key:
    model: str
    version: int


UNDECODABLE = {"struct-keyed map": {Key("llama", 3): [1, 2]},
               "invalid timestamp": msgspec.msgpack.Ext(-1, b"abc")}


@pytest.mark.parametrize("name", sorted(UNDECODABLE))
def test_set_metadata_refuses_what_does_not_decode_again(tmp_path: Path, name: str) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = s.finish(s.activate(10, 10), retain=True)
    step(s)
    assert ck is not None
    before = s.digest()
    with pytest.raises(InvalidArgument, match="decodable again"):
        s.set_metadata(ck, UNDECODABLE[name])  # the first fix: StoreFailed from apply
    assert s.digest() == before and s.failed is None
    s.set_metadata(ck, {"tokens": [1, 2, 3]})
    step(s)
    s.close()


def nested(depth: int) -> Any:  # noqa: ANN401
    x: Any = []
    for _ in range(depth):
        x = [x]
    return x


def at_depth(frames: int, call: Any) -> Any:  # noqa: ANN401
    return call() if frames == 0 else at_depth(frames - 1, call)


def test_deep_metadata_is_refused_or_kept_never_a_failed_store(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = s.finish(s.activate(10, 10), retain=True)
    step(s)
    assert ck is not None
    kept = []
    for depth in (100, 900, 990, 5000):
        try:
            s.set_metadata(ck, nested(depth))
            kept.append(depth)
        except InvalidArgument:
            pass
        assert s.failed is None, depth
        step(s)
    s.close()
    assert 100 in kept
    # whatever was kept reopens from a deep stack too: apply only skips over the value
    again = at_depth(60, lambda: KVStore.open(small_config(tmp_path)))
    assert ck in again.checkpoints()
    again.close()


def test_a_journal_holding_undecodable_metadata_opens_and_reads_typed(tmp_path: Path) -> None:
    """What an older set_metadata wrote: one well-formed value msgspec cannot build."""
    cfg = small_config(tmp_path, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"),
                       journal_dir=None)
    s = KVStore.open(cfg)
    ck = s.finish(s.activate(10, 10), retain=True)
    other = checkpoint_at(s, 64)
    assert s.journal is not None and ck is not None
    s.set_metadata(other, {"tokens": list(range(64))})
    s.offload(other)  # its pages survive a restart through the host tier
    step(s)
    s.journal.append([ev.SetMetadata(ck, msgspec.msgpack.encode(UNDECODABLE["struct-keyed "
                                                                            "map"]))])
    s.close()
    assert replay(str(tmp_path / "p" / "journal")).violations == []  # first fix: refused
    s = KVStore.open(cfg)
    with pytest.raises(StateError, match=f"metadata of seq {ck} .* does not decode"):
        s.checkpoint_info(ck)  # before: a raw msgspec.DecodeError
    with pytest.raises(InvalidArgument, match="metadata='no' must be a bool"):
        s.checkpoint_info(ck, metadata="no")  # type: ignore[arg-type]
    assert s.checkpoint_info(ck, metadata=False).metadata is None  # the rest still reads:
    assert residency(s, ck) == (0, 0, 0)  # a retention policy can still evict it (a review)
    assert s.checkpoint_info(other).metadata == {"tokens": list(range(64))}
    idx = PrefixIndex.from_store(s)  # skips the one it cannot read, keeps the other
    hit = idx.lookup(list(range(64)))
    assert hit is not None and hit.checkpoint == other
    s.close()
