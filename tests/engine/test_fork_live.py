"""``KVStore.fork_live``: a running sequence forked at a token frontier (n>1 sampling, beam
search) — whole pages shared, the partial tail COW-copied from the owner's live page at the
boundary; each side then writes only its own columns; refusals change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    CapacityExhausted,
    FrontierError,
    InactiveSpace,
    InvalidArgument,
    StoreClosed,
    WritePermissionError,
)
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import running, step, write_tokens


def tokens(s: KVStore, seq: int, n: int) -> dict[str, list[torch.Tensor]]:
    """The KV bytes of ``seq``'s first ``n`` tokens, per pool: one tensor per token (every
    layer and plane), read through its block table."""
    out: dict[str, list[torch.Tensor]] = {}
    for pool in s.pools:
        pd = s.device.pools[pool]
        table = pd.block_tables[s.space(seq, pool).row]
        hm = pd.geometry.order.value == "head-major"
        out[pool] = [torch.cat([(t[:, int(table[i // P]), i % P] if hm else
                                 t[int(table[i // P]), :, i % P]).flatten()
                                for layer in pd.planes for t in layer.values()])
                     for i in range(n)]
    return out


def same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[p]) == len(b[p]) and all(torch.equal(x, y) for x, y in zip(a[p], b[p], strict=True))
        for p in a)


@pytest.mark.parametrize("frontier", [1000, 640, 40])
def test_the_fork_reads_the_owners_bytes_and_each_writes_its_own(tmp_path: Path,
                                                                 frontier: int) -> None:
    s = KVStore.open(small_config(tmp_path, pages=80, backend=Backend.MTP, checked=True))
    owner = running(s, 1000, 300)
    mine = tokens(s, owner, 1000)
    copies = s.stats["cow_copies"]
    child = s.fork_live(owner, 200, frontier)
    full = frontier // P
    assert s.stats["cow_copies"] - copies == (len(s.pools) if frontier % P else 0)
    for pool in s.pools:
        assert s.space(child, pool).members[:full] == s.space(owner, pool).members[:full]
        assert s.space(child, pool).committed == frontier
    assert s.checkpoints() == []          # the transient checkpoint is gone
    step(s)
    prefix = {p: v[:frontier] for p, v in mine.items()}
    assert same(tokens(s, child, frontier), prefix)
    for pool in s.pools:                  # both append: the owner above 1000, the child above f
        s.ensure_mapped(owner, pool, 1010)
        s.ensure_mapped(child, pool, frontier + 10)
    step(s)
    for pool in s.pools:                  # through the write guard (checked mode)
        write_tokens(s, owner, pool, 1000, 1010)
        s.commit(owner, pool, 1010)
        write_tokens(s, child, pool, frontier, frontier + 10)
        s.commit(child, pool, frontier + 10)
    step(s)
    assert same(tokens(s, child, frontier), prefix)
    assert same(tokens(s, owner, 1000), mine)
    ours, theirs = tokens(s, child, frontier + 10), tokens(s, owner, frontier + 10)
    assert all(not torch.equal(a, b) for p in s.pools   # the child's own columns
               for a, b in zip(ours[p][frontier:], theirs[p][frontier:], strict=True))
    digest = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal")).digest == digest


def test_the_tail_copy_sees_the_owners_bytes_even_if_it_finishes_first(tmp_path: Path) -> None:
    """The owner's tail page is pinned until the boundary ran the copy: released in the same
    boundary, its bytes still reach the fork."""
    s = KVStore.open(small_config(tmp_path, pages=40))
    owner = running(s, 700, 100)
    want = tokens(s, owner, 700)
    main = s.state.pools["main"]
    tail = main.pages[s.space(owner).members[-1]].device
    child = s.fork_live(owner, 50)
    s.finish(owner)                       # releases everything the fork does not share
    b = s.activate(P * 26, 1)             # takes the free page groups before the boundary
    s.ensure_mapped(b, "main", P * 26)
    groups = [main.pages[x].device for x in s.space(b).members]
    assert tail not in groups             # what the copy reads is pinned, not reused
    step(s)
    assert same(tokens(s, child, 700), want)
    s.finish(b)
    step(s)


def test_the_owner_cannot_truncate_below_the_shared_pages(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=40))
    owner = running(s, 700, 100)
    s.fork_live(owner, 50)
    step(s)
    digest = s.digest()
    with pytest.raises((FrontierError, WritePermissionError)):
        s.truncate(owner, "main", 600)
    assert s.digest() == digest
    s.truncate(owner, "main", 650)        # the partial tail page is the owner's alone
    step(s)


def test_refusals_change_nothing(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=32, concurrency=2))
    owner = running(s, 700, 100)
    ck = s.finish(running(s, 64, 1), retain=True)
    step(s)
    digest = s.digest()
    for args, err in (((owner, 10, 701), FrontierError), ((owner, 2048, 700), FrontierError),
                      ((owner, -1), InvalidArgument), ((ck, 10), InactiveSpace),
                      ((999, 10), InactiveSpace), ((owner, 1400, 600), CapacityExhausted)):
        with pytest.raises(err):
            s.fork_live(*args)
        assert s.digest() == digest, args
    s.fork_live(owner, 10)                 # the second row
    with pytest.raises(CapacityExhausted, match="rows"):
        s.fork_live(owner, 10)
    s.check_invariants()


def test_a_dflash_sequence_forks_at_each_pools_own_frontier(tmp_path: Path) -> None:
    """The pools of a DFlash sequence commit different frontiers (the draft pool lags): a
    per-pool frontier forks each at its own — before, only at the lowest, so the child had to
    recompute the main pool's lead. Whole pages shared, tails copied, per pool; bytes equal
    the owner's; replay equals the live store. A bad mapping is refused, changing nothing."""
    s = KVStore.open(small_config(tmp_path, pages=80, backend=Backend.DFLASH, checked=True))
    owner = s.activate(700, 300)
    for pool in s.pools:
        s.ensure_mapped(owner, pool, 700)
    step(s)
    lead = {pool: 700 if pool == "main" else 650 for pool in s.pools}   # the draft lags
    for pool, f in lead.items():
        write_tokens(s, owner, pool, 0, f)
        s.commit(owner, pool, f)
    assert len(set(lead.values())) == 2
    mine = tokens(s, owner, 700)
    digest = s.digest()
    for seq, bad, err in ((owner, {"main": 700}, InvalidArgument),
                          (owner, {**lead, "nope": 1}, InvalidArgument),
                          (owner, {**lead, "main": 701}, FrontierError),
                          (999, lead, InactiveSpace)):
        with pytest.raises(err):
            s.fork_live(seq, 100, bad)
        assert s.digest() == digest
    child = s.fork_live(owner, 100, lead)
    for pool, f in lead.items():
        assert s.space(child, pool).committed == f
        assert s.space(child, pool).members[:f // P] == s.space(owner, pool).members[:f // P]
    step(s)
    got = tokens(s, child, 700)
    for pool, f in lead.items():
        assert all(torch.equal(a, b) for a, b in zip(got[pool][:f], mine[pool][:f],
                                                     strict=True)), pool
    s.check_invariants()
    digest = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal"), verify_every=1).digest == digest


@pytest.mark.parametrize("frontier", [640, 650])
def test_a_truncate_of_the_pinned_tail_says_the_boundary_frees_it(tmp_path: Path,
                                                                   frontier: int) -> None:
    """Until the boundary runs the child's tail copy, the owner's tail page is pinned: a
    truncate that would rewrite it is refused, saying why and when that ends (a typed
    refusal naming only §9.4's writer rule sent engine authors looking for a sharing bug);
    after the boundary the same truncate goes through."""
    s = KVStore.open(small_config(tmp_path, pages=40))
    owner = running(s, 700, 100)
    s.fork_live(owner, 50)                 # at 700: the tail page (block 10) is copied
    digest = s.digest()
    with pytest.raises(WritePermissionError, match="pinned by a copy.*next boundary"):
        s.truncate(owner, "main", frontier)
    assert s.digest() == digest
    step(s)
    s.truncate(owner, "main", frontier)
    step(s)
    s.check_invariants()


def test_forks_of_forks_in_one_interval_copy_in_order(tmp_path: Path) -> None:
    """A boundary runs its tail copies in batches (engine/effects.py). A fork of a fork made
    before that boundary copies from the first fork's tail page, which the first copy fills
    in the same boundary: it must run after it (a batch holding both would copy the page
    before it holds the bytes). Independent forks share a batch; each sees its own prefix."""
    s = KVStore.open(small_config(tmp_path, pages=80, concurrency=8))
    owner = running(s, 700, 100)
    want = tokens(s, owner, 700)
    child = s.fork_live(owner, 50, 690)            # COW from the owner's tail page
    grandchild = s.fork_live(child, 50, 680)       # COW from the child's, not yet copied
    siblings = [s.fork_live(owner, 50, f) for f in (650, 660, 675)]  # independent
    step(s)
    assert same(tokens(s, child, 690), {p: v[:690] for p, v in want.items()})
    assert same(tokens(s, grandchild, 680), {p: v[:680] for p, v in want.items()})
    for b, f in zip(siblings, (650, 660, 675), strict=True):
        assert same(tokens(s, b, f), {p: v[:f] for p, v in want.items()})
    digest = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal")).digest == digest


def test_truncate_many_truncates_every_sequence_or_none(tmp_path: Path) -> None:
    """``truncate_many`` checks every sequence with truncate's own rules before any event:
    here the second's page above its new frontier is pinned by a queued fork copy
    (``check_private``), so neither moves; duplicates and unequal lengths are refused too;
    once the copy ran, both go back together."""
    s = KVStore.open(small_config(tmp_path, pages=40))
    a, b = running(s, 129, 100), running(s, 129, 100)
    s.fork_live(b, 50)                     # at 129: b's tail page (block 2) is copied
    digest = s.digest()
    with pytest.raises(WritePermissionError, match="pinned by a copy"):
        s.truncate_many("main", [a, b], [128, 128])
    with pytest.raises(InvalidArgument, match="more than once"):
        s.truncate_many("main", [a, a], [128, 128])
    with pytest.raises(InvalidArgument, match="differ in length"):
        s.truncate_many("main", [a, b], [128])
    assert s.digest() == digest and s.space(a).committed == 129
    step(s)
    s.truncate_many("main", [a, b], [128, 128])
    assert [s.space(x).committed for x in (a, b)] == [128, 128]
    step(s)
    s.check_invariants()
    s.close()  # the store's state before the arguments (review: as every command)
    with pytest.raises(StoreClosed):
        s.truncate(a, "main", 1.5)  # type: ignore[arg-type]
