"""Regression tests for the isolation and liveness defects of the trust issue (#11, items 1-8).

Each test reproduces the outside report on the old code (where it failed) and checks the
rule that fixes the whole class, not only the reported path.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import InvalidArgument, KVStoreError, WritePermissionError
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, page_bytes, step
from tests.engine.test_host_tier import host_store


def devices(s: KVStore, seq: int, pool: str = "main") -> list[int]:
    p = s.state.pools[pool]
    return [p.pages[x].device for x in s.space(seq, pool).members]  # type: ignore[union-attr]


def offloaded(s: KVStore, tokens: int) -> tuple[int, list[list[torch.Tensor]]]:
    """A retained checkpoint whose pages live on the host only, and its pages' bytes."""
    ck = checkpoint_at(s, tokens)
    data = [page_bytes(s, "main", d) for d in devices(s, ck)]
    s.offload(ck)
    step(s)
    assert s.drop_device(ck) > 0
    step(s)
    assert all(d == -1 for d in devices(s, ck))
    return ck, data


def same_columns(got: list[torch.Tensor], want: list[torch.Tensor], cols: int) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[:, :cols], w[:, :cols])


# --- 1. one request reads another's KV ------------------------------------------------------
@pytest.mark.parametrize("how", ["offload-flag", "drop-device-after-offload"])
def test_device_drop_never_frees_a_page_an_active_fork_maps(tmp_path: Path, how: str) -> None:
    s = host_store(tmp_path)
    c = checkpoint_at(s, 64)
    y = s.activate_from(c, 64, 64, 64)  # shares c's full page 0
    step(s)
    shared = devices(s, y)[0]
    assert shared == devices(s, c)[0]
    if how == "offload-flag":
        s.offload(c, drop_device=True)
    else:
        s.offload(c)
        s.drop_device(c)  # queued copy: the drop is decided when it publishes
    step(s)
    s.check_invariants()
    assert devices(s, y)[0] == shared  # still mapped by the fork
    z = s.activate(64, 200)
    s.ensure_mapped(z, "main", 256)
    step(s)
    assert shared not in devices(s, z)  # never handed to another request
    s.check_invariants()
    s.close()


def test_drop_device_after_offload_before_the_boundary_frees_pages(tmp_path: Path) -> None:
    """The README engine example: offload then drop_device, one boundary, pages freed."""
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    before = s.occupancy()["main"]["available"]
    s.offload(ck)
    assert s.drop_device(ck) == 5  # all scheduled: the copy has not run yet
    step(s)
    assert s.occupancy()["main"]["available"] == before + 5
    assert all(d == -1 for d in devices(s, ck))
    s.close()


# --- 2. a queued restore reads a replica that a later command frees ---------------------------
@pytest.mark.parametrize("then", ["release", "drop_host", "move"])
def test_queued_restore_source_stays_until_the_boundary(tmp_path: Path, then: str) -> None:
    s = host_store(tmp_path)
    ck, data = offloaded(s, 100)  # 2 host-only pages, the tail holds 36 columns
    x = s.activate_from(ck, 100, 100, 20)  # Fork: restore page 0, COW the restored tail
    if then == "release":
        s.release(ck)
    elif then == "drop_host":
        assert s.drop_host(ck) == 0  # restore-pinned pages are not dropped
    else:
        s.activate_from(ck, 100, 100, 20, keep_source=False)  # Fork + Release of ck
    step(s)  # old code: AssertionError inside the boundary, and every later one too
    s.check_invariants()
    step(s)
    same_columns(page_bytes(s, "main", devices(s, x)[0]), data[0], 64)
    same_columns(page_bytes(s, "main", devices(s, x)[1]), data[1], 36)
    s.close()


# --- 3. Move from a host-only checkpoint at a mid-page frontier --------------------------------
@pytest.mark.parametrize("frontier", [100, 70, 64, 1])
def test_move_from_host_only_checkpoint_at_any_frontier(tmp_path: Path, frontier: int) -> None:
    s = host_store(tmp_path)
    ck, data = offloaded(s, 100)
    x = s.activate_from(ck, frontier, frontier, 50, keep_source=False, mode="move")
    step(s)
    assert s.space(x).committed == frontier and ck not in s.state.bundles
    s.check_invariants()
    for i, dev in enumerate(devices(s, x)):
        same_columns(page_bytes(s, "main", dev), data[i], min(P, frontier - i * P))
    s.close()


# --- 4. integers are normalized and ranges validated before anything is emitted -------------
def test_negative_budget_and_non_integers_are_refused_unchanged(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 100)
    d = s.digest()
    for call in (lambda: s.activate_from(ck, 64, 100, -500),
                 lambda: s.activate_from(ck, 64.0, 100, 5),
                 lambda: s.activate(100.5, 10),
                 lambda: s.activate("100", 10),
                 lambda: s.activate(True, 10),
                 lambda: s.ensure_mapped_many("main", [1.5], [10]),
                 lambda: s.commit_many("main", np.array([1.0]), np.array([3]))):
        with pytest.raises(InvalidArgument):
            call()
        assert s.digest() == d and not s._pending
    step(s)
    s.close()


def test_numpy_integers_are_accepted_and_journaled_as_ints(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(np.int64(100), np.int32(10))
    s.ensure_mapped(a, "main", np.int64(100))
    step(s)
    s.commit_many("main", np.array([a]), np.array([100], dtype=np.int16))
    step(s)  # old code: every boundary from here on failed (msgspec cannot encode np.int64)
    # an object array holding numpy ints is taken as a list of them is; an empty batch is
    # empty whatever its dtype (np.array([]) is float64); object arrays of bools or floats
    # are refused element by element, by name
    s.ensure_mapped_many("main", np.array([np.int64(a)], dtype=object), [np.int64(101)])
    s.commit_many("main", [], np.array([]))
    d = s.digest()
    for bad in (np.array([True], dtype=object), np.array([1.5], dtype=object)):
        with pytest.raises(InvalidArgument, match=r"seqs\[0\]="):
            s.ensure_mapped_many("main", bad, [101])
        assert s.digest() == d
    # numpy counts timedelta64 as a signed integer type: its elements became
    # datetime.timedelta objects (a raw TypeError from the array form, and the list form
    # handed them on as the ints it promises); durations and bool arrays are no integers
    for bad in (np.array([a], dtype="timedelta64[s]"), np.array([True])):
        why = re.escape(f"want a 1-D integer array, got dtype {bad.dtype}")
        with pytest.raises(InvalidArgument, match=why):
            s.ensure_mapped_many("main", bad, [101])
        with pytest.raises(InvalidArgument, match=why):
            s.table_rows("main", bad)
        assert s.digest() == d
    # a torch tensor of one element took ``operator.index`` whatever its shape, where the
    # same numpy array is refused: an integer argument is a scalar (a 0-d tensor is one)
    for bad in (torch.tensor([100]), torch.tensor([[100]])):
        with pytest.raises(InvalidArgument, match="-D array is not an integer"):
            s.activate(bad, 10)
        with pytest.raises(InvalidArgument, match="-D array is not an integer"):
            s.commit_many("main", [bad], [100])
        assert s.digest() == d
    s.activate(torch.tensor(100), np.array(10))  # 0-d: a scalar
    s.close()
    live = s.digest()
    assert replay(str(tmp_path / "journal")).digest == live
    KVStore.open(s.config).close()


# --- 5. kv_lease_growth holds the §6.2 cushion back ---------------------------------------------
def test_lease_growth_never_decodes_into_the_cushion(make_store) -> None:  # noqa: ANN001
    cushion = 64
    s = make_store(pages=40, concurrency=4, context=2048, lease_growth=True, lease_window=128,
                   lease_cushion=cushion)
    seqs = [s.activate(64, 1900) for _ in range(4)]
    frontier = dict.fromkeys(seqs, 64)
    for b in seqs:
        s.ensure_mapped(b, "main", 64)
    step(s)
    for b in seqs:
        s.commit(b, "main", 64)
    ended = 0
    while s.active():
        g = s.grow(step_tokens=1)
        for b in g.exhausted:
            s.finish(b, reason="length")
            ended += 1
        for b in s.active():  # whoever continues has the step AND the cushion covered
            sp = s.space(b)
            assert sp.entitlement * P >= frontier[b] + 1 + cushion, (b, frontier[b])
            s.ensure_mapped(b, "main", frontier[b] + 1)
        live = s.active()
        step(s)
        for b in live:
            frontier[b] += 1
            s.commit(b, "main", frontier[b])
    assert ended == 4


# --- 6. truncate into a tail page whose copy is queued ------------------------------------------
def test_truncate_refuses_a_pinned_tail_as_commit_does(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 100)
    s.offload(ck)  # D2H queued: ck's pages are pinned until the boundary publishes
    x = s.activate_from(ck, 100, 100, 50, keep_source=False)  # Move: x writes ck's tail
    d = s.digest()
    with pytest.raises(WritePermissionError, match="pins=1"):
        s.truncate(x, "main", 90)  # old code: accepted while the D2H copy was queued
    with pytest.raises(WritePermissionError, match="pins=1"):
        s.commit(x, "main", 100)
    assert s.digest() == d
    step(s)
    s.truncate(x, "main", 90)  # after the copy published and unpinned: allowed
    step(s)
    s.check_invariants()
    s.close()


# --- 7. kernel wrappers: mapped positions, plane dtypes, checked mode --------------------------
def kernel_store(tmp_path: Path, checked: bool) -> tuple[KVStore, int]:
    """A store with one active sequence whose first page is mapped and published."""
    s = KVStore.open(small_config(tmp_path, checked=checked))
    a = s.activate(64, 64)
    s.ensure_mapped(a, "main", 64)
    step(s)
    return s, a


def kv(n: int, s: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    g = s.device.pools["main"].geometry
    return (torch.randn(n, g.num_kv_heads, g.head_dim), torch.randn(n, g.num_kv_heads, g.head_dim))


def test_append_to_an_unmapped_position_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    s, a = kernel_store(tmp_path, checked=False)
    view = s.batch_view("main", 0)
    before = view.k_pages.clone()
    k, v = kv(1, s)
    with pytest.raises(InvalidArgument, match="not mapped"):
        append_kv(view, s.table_rows("main", [a]), torch.tensor([64]), k, v)
    with pytest.raises(InvalidArgument, match="outside the table"):
        append_kv(view, torch.tensor([99], dtype=torch.int32), torch.tensor([0]), k, v)
    assert torch.equal(before, view.k_pages)  # the pool's last page was not written
    s.close()


def test_a_float32_plane_for_a_bf16_profile_is_refused(tmp_path: Path) -> None:
    s, a = kernel_store(tmp_path, checked=False)
    view = s.batch_view("main", 0)
    import dataclasses

    bad = dataclasses.replace(view, k_pages=view.k_pages.float())
    k, v = kv(1, s)
    with pytest.raises(InvalidArgument, match="float32"):
        append_kv(bad, s.table_rows("main", [a]), torch.tensor([0]), k, v)
    s.close()


def test_checked_mode_refuses_writes_the_writer_does_not_own(tmp_path: Path) -> None:
    s, _ = kernel_store(tmp_path, checked=True)
    ck = checkpoint_at(s, 100)
    y = s.activate_from(ck, 100, 100, 50)  # Fork: page 0 shared (immutable), tail private COW
    s.ensure_mapped(y, "main", 120)
    step(s)
    view = s.batch_view("main", 0)
    rows = s.table_rows("main", [y])
    k, v = kv(1, s)
    with pytest.raises(WritePermissionError, match="below its committed frontier"):
        append_kv(view, rows, torch.tensor([99]), k, v)  # rewrites a committed token
    with pytest.raises(WritePermissionError, match="below its committed frontier"):
        append_kv(view, rows, torch.tensor([10]), k, v)  # the shared immutable page
    append_kv(view, rows, torch.tensor([100]), k, v)  # its own private tail: fine
    # a page pinned by a queued copy is not the writer's to write until the boundary ran it
    # (and published the row that maps it)
    s2 = host_store(tmp_path / "h", checked=True)
    c2 = checkpoint_at(s2, 100)
    s2.offload(c2)
    x = s2.activate_from(c2, 100, 100, 50, keep_source=False)  # Move: x may write the tail
    # x's row is not published until the boundary: it maps nothing yet (the finish that made
    # c2 left the row, and its boundary unmapped it), so the mapped check refuses first; with
    # a row still mapping something, the guard's "not yet published" would (test_trust_review)
    with pytest.raises(InvalidArgument, match="not mapped"):
        append_kv(s2.batch_view("main", 0), s2.table_rows("main", [x]), torch.tensor([100]),
                  k, v)
    step(s2)
    append_kv(s2.batch_view("main", 0), s2.table_rows("main", [x]), torch.tensor([100]), k, v)
    row = s2.table_rows("main", [x])
    s2.finish(x)
    with pytest.raises(WritePermissionError, match="not leased"):
        append_kv(s2.batch_view("main", 0), row, torch.tensor([100]), k, v)
    s2.close()
    s.close()


# --- 8. the default capacity is clamped into [M_min, M_max] ------------------------------------
def test_default_kv_tokens_clamps_to_the_configured_range() -> None:
    cfg = StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                      serving=ServingConfig(max_context=2048, max_concurrency=4))
    s = KVStore.open(cfg)  # old code: CapacityError (M=1024 > M_max=128)
    assert s.plan.m == 4 * 32
    s.close()
    with pytest.raises(KVStoreError):
        StoreConfig(sync="sometimes")


def test_a_commit_never_reaches_columns_no_unit_could_have_written(tmp_path: Path) -> None:
    """§8.1: a commit follows the unit that wrote its columns, and a unit writes through a
    published table. Committing into a page mapped since the last boundary (or a row leased,
    or a Fork's new tail, since then) would publish whatever that page group held before —
    another request's KV once it is recycled — as this sequence's. Refused whatever
    ``checked`` is (``checked`` stores also track writes); nothing changes, the store stays
    usable, and the same commit passes once a boundary published the table."""
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 100)                       # a checkpoint with a mid-page frontier
    a = s.activate(100, 50)
    s.ensure_mapped(a, "main", 100)
    fork = s.activate_from(ck, 70, 100, 50)          # a Fork with a COW tail (block 1)
    s.ensure_mapped(fork, "main", 100)
    d = s.digest()
    for seq, to, blk in ((a, 1, 0), (a, 100, 1), (fork, 71, 1), (fork, 100, 1)):
        with pytest.raises(WritePermissionError, match=f"commit to {to} writes block {blk}"):
            s.commit(seq, "main", to)
        assert s.digest() == d and not s.failed
    s.commit(fork, "main", 70)                       # to its frontier: writes nothing
    step(s)
    s.commit(a, "main", 100)
    s.commit(fork, "main", 100)
    s.truncate(a, "main", 70)                        # unmaps nothing still published
    s.commit(a, "main", 100)                         # block 1 was published: allowed
    s.ensure_mapped(a, "main", 130)                  # a new page (block 2), unpublished
    with pytest.raises(WritePermissionError, match="commit to 130 writes block 2"):
        s.commit_many("main", [fork, a], [100, 130])
    s.commit(a, "main", 128)                         # blocks 0-1 only
    step(s)
    s.commit(a, "main", 130)
    s.close()
    assert replay(str(tmp_path / "journal")).digest == s.digest()


def test_only_a_unit_makes_mapped_columns_committable(tmp_path: Path) -> None:
    """Review finding: ``snapshot()`` publishes the tables too (its record), and it used to
    clear what the rule reads: a commit right after it into a page no unit had written was
    accepted. Only a unit (a boundary's freeze, then ``unit_complete``) lifts the rule; a
    second ``unit_complete`` without a boundary lifts nothing."""
    s = KVStore.open(small_config(tmp_path, concurrency=16))
    a = s.activate(100, 10)
    s.ensure_mapped(a, "main", 100)
    s.snapshot()
    s.unit_complete()                                   # no unit ran: lifts nothing
    with pytest.raises(WritePermissionError, match="commit to 100 writes block 1"):
        s.commit(a, "main", 100)
    s.close_boundary()
    s.unit_complete()
    s.commit(a, "main", 100)
    others = [s.activate(64, 10) for _ in range(12)]    # admitted between unit and commit
    for b in others:
        s.ensure_mapped(b, "main", 64)
    s.ensure_mapped(a, "main", 101)
    with pytest.raises(WritePermissionError, match=f"seq {others[3]} pool main: commit to 1 "):
        s.commit_many("main", [a, others[3]], [100, 1])  # more than 8 changed: the dict path
    s.commit_many("main", [a], [100])
    step(s)
    s.commit_many("main", [a, *others], [101] + [64] * len(others))
    s.close()
