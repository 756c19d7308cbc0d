"""Findings of an outside review of the prefix cache and retention (2026-12-03): swap_in lost
the sequence's metadata (so its checkpoint fell out of an index rebuilt after a restart); a
refused or repeated ``LruRetention.retain`` corrupted the policy (a stale key answering
lookups for blocks the checkpoint no longer held); one checkpoint with bad token metadata
made the whole rebuild refuse; and some bad inputs escaped untyped. It found no hit that
continues another prompt's KV (forced hash collisions, byte shadows, restarts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ninfer_kv import KVStore
from ninfer_kv.cache import LruRetention, PrefixIndex, Swapped, swap_in, swap_out
from ninfer_kv.engine import args
from ninfer_kv.errors import InvalidArgument, UnknownHandle
from tests.engine.conftest import small_config


def store_with(tmp: Path | None = None) -> KVStore:
    return KVStore.open(small_config(tmp, pages=16, context=512, journal=tmp is not None,
                                     allocate_planes=False))


def prompt(s: KVStore, n: int, meta: object) -> int:
    """A sequence holding ``n`` committed tokens, ``meta`` attached."""
    seq = s.activate(n, 50)
    s.ensure_mapped(seq, "main", n)
    with s.boundary():
        pass
    s.commit(seq, "main", n)
    s.set_metadata(seq, meta)
    return seq


def test_swap_in_keeps_the_metadata_so_a_rebuilt_index_finds_the_checkpoint(
        tmp_path: Path) -> None:
    s = store_with(tmp_path)
    tokens = list(range(100))
    out = swap_out(s, prompt(s, 100, {"tokens": tokens}), 150)
    with s.boundary():
        pass
    seq = swap_in(s, out)
    assert s.checkpoint_info(seq).metadata == {"tokens": tokens}
    ck = s.finish(seq, retain=True)
    with s.boundary():
        pass
    match = PrefixIndex.from_store(s).lookup(tokens)  # the rebuild a restart runs
    assert match is not None and match.checkpoint == ck
    digest = s.digest()
    with pytest.raises(InvalidArgument, match="carry_metadata='yes' must be a bool"):
        s.activate_from(ck, 64, 100, 10, carry_metadata="yes")  # type: ignore[arg-type]
    assert s.digest() == digest
    other = s.activate_from(ck, 64, 100, 10)          # carry_metadata defaults to False
    assert s.checkpoint_info(other).metadata is None
    # review (2026-12-03): carried to a prefix, its token ids named tokens the new KV does
    # not hold, and PrefixIndex.from_store then served them as the checkpoint's
    after = s.digest()
    with pytest.raises(InvalidArgument, match="frontier 64 in pool main is below the "
                                              "checkpoint's committed 100"):
        s.activate_from(ck, 64, 100, 10, carry_metadata=True)
    with pytest.raises(InvalidArgument, match="carry_metadata=True"):
        s.activate_from(ck, {"main": 64}, 100, 10, carry_metadata=True)
    assert s.digest() == after
    whole = s.activate_from(ck, 100, 110, 10, carry_metadata=True)  # all of it: carried
    assert s.checkpoint_info(whole).metadata == {"tokens": tokens}
    bare = s.finish(whole, retain=True)  # a checkpoint without metadata carries nothing, so
    s.set_metadata(bare, None)           # any frontier will do (a review: it was refused)
    with s.boundary():
        pass
    assert bare is not None
    s.activate_from(bare, 64, 100, 10, carry_metadata=True)
    s.check_invariants()


def test_carrying_metadata_past_the_records_budget_is_refused_with_nothing_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = store_with()
    out = swap_out(s, prompt(s, 100, {"tokens": list(range(100))}), 150)
    with s.boundary():
        pass
    monkeypatch.setattr(args, "METADATA_PER_RECORD", 500)
    s.set_metadata(prompt(s, 10, None), "x" * 450)    # 452 of this record's 500 bytes
    digest = s.digest()
    with pytest.raises(InvalidArgument, match="carrying its metadata.*METADATA_PER_RECORD"):
        swap_in(s, out)
    assert s.digest() == digest
    with s.boundary():
        pass
    swap_in(s, out)                                   # a fresh record has room


def test_a_refused_or_repeated_retain_changes_nothing() -> None:
    r = LruRetention()
    with pytest.raises(InvalidArgument, match="block key 1 .* is not hashable"):
        r.retain(7, ["h1", ["not", "hashable"]])
    assert r.entries == {} and r.by_block == {}
    r.retain(1, ["a", "b"])
    with pytest.raises(InvalidArgument, match="indexed already"):
        r.retain(1, ["c"])
    assert r.entries[1].key == ("a", "b") and set(r.by_block) == {"a", "b"}
    r.forget(1)
    r.retain(1, ["c"])                                # after forget: indexed anew
    assert r.lookup(["a", "b"]) == (None, 0) and r.lookup(["c"]) == (1, 1)
    with pytest.raises(UnknownHandle, match="not indexed"):
        r.forget(3)
    for bad in (None, "abc", 5, np.zeros((1, 1))):
        with pytest.raises(InvalidArgument, match="sequence of block keys"):
            r.lookup(bad)  # type: ignore[arg-type]
    r.retain(2, np.array([5, 6]))                     # an array of hash ids: its values
    assert r.lookup((5, 6, 7)) == (2, 2) and r.lookup(np.array([5])) == (2, 1)


def test_a_checkpoint_with_bad_token_metadata_is_skipped_not_fatal() -> None:
    s = store_with()
    good = s.finish(prompt(s, 100, {"tokens": list(range(100))}), retain=True)
    for bad in (None, "a prompt text", [[1, 2]], [2 ** 40], [1.5, 2.5]):
        s.finish(prompt(s, 64, {"tokens": bad}), retain=True)
    with s.boundary():
        pass
    idx = PrefixIndex.from_store(s)
    assert len(idx) == 1 and idx.lookup(list(range(100))).checkpoint == good


def test_bad_index_inputs_are_typed() -> None:
    with pytest.raises(InvalidArgument, match="not a KVStore"):
        PrefixIndex.from_store(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a store state"):
        PrefixIndex.from_state(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timedelta64"):
        PrefixIndex().lookup(np.array([1, 2], dtype="timedelta64[s]"))
    with pytest.raises(InvalidArgument, match="hash_seed=5 must be a str"):
        PrefixIndex.vllm(hash_seed=5)  # type: ignore[arg-type]
    assert PrefixIndex.vllm(hash_seed="5").block == 16


@pytest.mark.parametrize("make", [
    lambda: PrefixIndex(seed="abc"),           # was TypeError
    lambda: PrefixIndex(seed=5),               # was five zero bytes, silently
    lambda: PrefixIndex(chain=5),              # was TypeError at the first add
    lambda: LruRetention(priority=5),          # was TypeError at the first victims()
    lambda: LruRetention().make_room(None),    # these: AttributeError
    lambda: LruRetention().make_host_room(None),
    lambda: swap_out(None, 1, 10),
    lambda: swap_in(None, Swapped(1, {"main": 64}, 100, False)),
], ids=["seed-str", "seed-int", "chain", "priority", "make_room", "make_host_room",
        "swap_out", "swap_in"])
def test_the_cache_helpers_check_their_arguments(make: Any) -> None:  # noqa: ANN401
    """An outside review (2026-12-03): the cache layer's constructors and its store argument
    were not checked."""
    with pytest.raises(InvalidArgument):
        make()
