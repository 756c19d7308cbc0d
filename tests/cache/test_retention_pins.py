"""Findings of an outside review of retention (2026-12-04): ``make_room`` counted a page a
queued copy pins (a COW tail's source, an offload's page) as freed by a release, though it
frees only at the boundary that runs the copy — an admission loop calling it until it
answered None released every retained checkpoint and still did not fit, where one release
(or none, after the boundary) would have done. And ``make_host_room(keep=...)`` took any
value for ``keep`` (``True`` kept checkpoint 1, ``"1"`` kept none)."""

from __future__ import annotations

from typing import Any

import pytest

from ninfer_kv import KVStore
from ninfer_kv.cache import LruRetention
from ninfer_kv.errors import CapacityExhausted, InvalidArgument
from tests.engine.conftest import small_config


def step(s: KVStore) -> None:
    with s.boundary():
        pass


def retained(s: KVStore, pol: LruRetention, n: int, tokens: int) -> list[int]:
    """``n`` retained checkpoints of ``tokens`` committed tokens each, indexed by ``pol``."""
    out = []
    for i in range(n):
        b = s.activate(tokens, 0)
        s.ensure_mapped(b, "main", tokens)
        step(s)
        s.commit(b, "main", tokens)
        ck = s.finish(b, retain=True)
        pol.retain(ck, tuple((i, k) for k in range(-(-tokens // 64))))
        out.append(ck)
    step(s)
    return out


def admit(s: KVStore, pol: LruRetention, tokens: int, out: int) -> tuple[int | None, list[Any]]:
    """The admission loop of ``tools/simulate.py``: ``make_room`` until it fits or answers
    None. Returns (the sequence or None, the answers)."""
    answers: list[Any] = []
    for _ in range(20):
        try:
            return s.activate(tokens, out), answers
        except CapacityExhausted as exc:
            answers.append(pol.make_room(s, exc.short))
            if answers[-1] is None:
                return None, answers
    raise AssertionError(answers)


def test_a_release_that_frees_only_at_the_boundary_is_not_made() -> None:
    """Four one-page checkpoints, three continued mid-page this step (their page is the COW
    source a queued copy reads): the one that frees a page at once goes first, though it is
    the most recently used, and the other three stay."""
    s = KVStore.open(small_config(None, pages=8, context=512, journal=False,
                                  allocate_planes=False))
    pol = LruRetention()
    cks = retained(s, pol, 4, 40)
    for ck in cks[:3]:
        s.activate_from(ck, 30, 40, 24)
    assert s.sole_device_pages(cks[0]) == 1 and s.sole_device_pages(cks[0], now=True) == 0
    info = s.checkpoint_info(cks[0]).pools["main"]
    assert (info.sole_device_pages, info.sole_device_pages_now) == (1, 0)
    assert s.reclaimable(cks, now=True) == {cks[0]: 0, cks[1]: 0, cks[2]: 0, cks[3]: 1}
    got, answers = admit(s, pol, 100, 20)
    assert got is not None and answers == ["release"]
    assert s.checkpoints() == cks[:3]


def test_nothing_is_released_while_every_victim_waits_on_a_copy() -> None:
    """Every retained checkpoint's pages are being offloaded (pinned until the boundary):
    ``make_room`` answers None and keeps them all — before the fix it trimmed and released
    all four, freeing nothing. After the boundary the offloads are published, and one
    demotion (their device pages go, their host replicas stay) admits the request."""
    s = KVStore.open(small_config(None, pages=16, context=512, journal=False,
                                  allocate_planes=False, host_bytes=1 << 20))
    pol = LruRetention(block_tokens=64)
    cks = retained(s, pol, 4, 256)
    for ck in cks:
        s.offload(ck)
    got, answers = admit(s, pol, 100, 28)
    assert got is None and answers == [None] and s.checkpoints() == cks
    step(s)
    got, answers = admit(s, pol, 100, 28)
    assert got is not None and answers == ["demote"] and s.checkpoints() == cks


def test_an_extent_a_queued_restore_reads_frees_only_at_the_boundary() -> None:
    """A host-only checkpoint of two pages continued at token 70: its first page is shared
    with the new sequence, its second is the COW tail's source, restored to the device and
    pinned until the boundary copies it. That page is the checkpoint's alone and holds a host
    extent, which a release would free only at the boundary (``make_host_room`` releases a
    checkpoint only for extents it frees now)."""
    s = KVStore.open(small_config(None, pages=16, context=512, journal=False,
                                  allocate_planes=False, host_bytes=1 << 20))
    ck = retained(s, LruRetention(), 1, 100)[0]
    s.offload(ck)
    step(s)
    s.drop_device(ck)
    step(s)
    s.activate_from(ck, 70, 100, 20)
    info = s.checkpoint_info(ck).pools["main"]
    assert (info.sole_host_pages, info.sole_host_pages_now) == (1, 0)
    assert (info.sole_device_pages, info.sole_device_pages_now) == (1, 0)
    step(s)
    info = s.checkpoint_info(ck).pools["main"]
    assert (info.sole_host_pages, info.sole_host_pages_now) == (1, 1)


@pytest.mark.parametrize("keep", [True, 1.0, "1", [1]])
def test_make_host_room_refuses_a_keep_that_is_no_id(keep: object) -> None:
    s = KVStore.open(small_config(None, pages=16, context=512, journal=False,
                                  allocate_planes=False, host_bytes=1 << 20))
    pol = LruRetention()
    cks = retained(s, pol, 2, 100)
    for ck in cks:
        s.offload(ck)
    step(s)
    before = s.digest()
    with pytest.raises(InvalidArgument, match="keep"):
        pol.make_host_room(s, keep=keep)
    assert s.digest() == before and s.checkpoints() == cks


@pytest.mark.parametrize("now", [1, 0, None, "yes"])
def test_now_must_be_a_bool(now: object) -> None:
    s = KVStore.open(small_config(None, pages=8, context=512, journal=False,
                                  allocate_planes=False))
    ck = retained(s, LruRetention(), 1, 40)[0]
    with pytest.raises(InvalidArgument, match="now"):
        s.sole_device_pages(ck, now=now)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="now"):
        s.reclaimable([ck], now=now)  # type: ignore[arg-type]


def test_a_tail_trim_keeps_the_prefix_findable_after_a_restart(tmp_path: Any) -> None:
    """The checkpoint a tail trim leaves holds the prefix's token ids, cut to its pages: an
    index rebuilt from the store after a restart finds it (before, it had no metadata: it
    survived, holding host extents, but no rebuilt index or policy knew it)."""
    from ninfer_kv.cache import PrefixIndex
    cfg = small_config(None, pages=8, context=512, journal=False, allocate_planes=False,
                       host_bytes=1 << 20, persist_dir=str(tmp_path / "p"))
    s = KVStore.open(cfg)
    idx, pol = PrefixIndex(), LruRetention(block_tokens=64)
    tokens = list(range(448))
    b = s.activate(448, 0)
    s.ensure_mapped(b, "main", 448)
    step(s)
    s.commit(b, "main", 448)
    s.set_metadata(b, {"tokens": tokens, "model": "m"})
    ck = s.finish(b, retain=True)
    idx.add(ck, tokens)
    pol.retain(ck, idx.block_hashes(tokens))
    step(s)
    with pytest.raises(CapacityExhausted) as exc:
        s.activate(64, 64)
    assert pol.make_room(s, exc.value.short) == "trim"
    new = pol.renamed[ck]
    kept = s.checkpoint_info(new).frontier
    assert 0 < kept < 448
    assert s.checkpoint_info(new).metadata == {"tokens": tokens[:kept], "model": "m"}
    s.offload(new)
    step(s)
    s.close()
    s = KVStore.open(cfg)
    assert s.checkpoints() == [new]
    m = PrefixIndex.from_store(s).lookup(tokens)
    assert m is not None and m.checkpoint == new and m.tokens == kept
    s.close()


def _indexed_prefix(s: KVStore, pol: LruRetention) -> int:
    from ninfer_kv.cache import PrefixIndex
    idx, tokens = PrefixIndex(), list(range(448))
    b = s.activate(448, 0)
    s.ensure_mapped(b, "main", 448)
    step(s)
    s.commit(b, "main", 448)
    s.set_metadata(b, {"tokens": tokens})
    ck = s.finish(b, retain=True)
    pol.retain(ck, idx.block_hashes(tokens))
    step(s)
    return ck


def test_a_trim_without_an_id_left_in_the_step_releases(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Review finding: the ids one step may hand out spent (``state.ID_GAP``, 8 here),
    ``release_tail`` is refused (it needs an id) and ``make_room`` raised IdsExhausted; it
    releases the victim instead."""
    from ninfer_kv.engine import state as state_mod
    monkeypatch.setattr(state_mod, "ID_GAP", 8)
    s = KVStore.open(small_config(None, pages=8, context=512, journal=False,
                                  allocate_planes=False))
    pol = LruRetention(block_tokens=64)
    ck = _indexed_prefix(s, pol)
    with pytest.raises(Exception, match="run a boundary first"):  # noqa: PT011
        for _ in range(9):
            s.finish(s.activate(1, 1))
    assert pol.make_room(s, 1) == "release" and ck not in s.checkpoints()
    assert pol._trimming is None


def test_a_trim_whose_metadata_finds_no_room_stands_without_it() -> None:
    """Review finding: the record's metadata budget spent (``METADATA_PER_RECORD``), the
    trim's ``set_metadata`` was refused after ``release_tail`` ran, and the InvalidArgument
    escaped ``make_room`` with the policy's plan left pending. The trim stands (logged), the
    policy follows it."""
    from ninfer_kv.journal.events import METADATA_MAX, METADATA_PER_RECORD
    s = KVStore.open(small_config(None, pages=8, context=512, journal=False,
                                  allocate_planes=False))
    pol = LruRetention(block_tokens=64)
    ck = _indexed_prefix(s, pol)
    other = s.activate(1, 0)
    left = METADATA_PER_RECORD - 200
    while left > 0:
        n = min(METADATA_MAX, left) - 5
        s.set_metadata(other, b"x" * n)
        left -= n + 5
    s.finish(other)
    with pytest.raises(CapacityExhausted) as exc:
        s.activate(64, 64)
    assert pol.make_room(s, exc.value.short) == "trim"
    new = pol.renamed[ck]
    assert s.checkpoints() == [new] and s.checkpoint_info(new).metadata is None
    assert pol._trimming is None and new in pol.entries
