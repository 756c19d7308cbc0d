"""Live prefix sharing (``KVStore.share_prefix``, the ``Share`` event): a running sequence's
whole committed pages become an inactive checkpoint that others Fork from while the owner
keeps decoding above them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    FrontierError,
    FrozenUnit,
    InactiveSpace,
    InvalidArgument,
    WritePermissionError,
)
from ninfer_kv.replay import replay
from tests.engine.conftest import assert_refusals_change_nothing, small_config
from tests.engine.test_continuation import running, step, write_tokens


def decode(s: KVStore, seq: int, start: int, end: int) -> None:
    for pool in s.pools:
        s.ensure_mapped(seq, pool, end)
    step(s)
    for pool in s.pools:
        write_tokens(s, seq, pool, start, end)
        s.commit(seq, pool, end)


def page_bytes(s: KVStore, pool: str, group: int) -> list[torch.Tensor]:
    pd = s.device.pools[pool]
    return [t[group].clone() if pd.geometry.order.value == "page-major" else t[:, group].clone()
            for layer in pd.planes for t in layer.values()]


def test_others_fork_the_shared_prefix_while_the_owner_decodes(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, checked=True))
    a = running(s, 150)
    ck = s.share_prefix(a)  # committed 150: two whole pages
    step(s)
    assert s.space(ck, "main").committed == 2 * P and s.space(a, "main").protected == 2 * P
    before = {pool: [page_bytes(s, pool, s.state.pools[pool].pages[x].device)
                     for x in s.space(ck, pool).members] for pool in s.pools}
    decode(s, a, 150, 200)                          # the owner goes on above the shared pages
    c = s.activate_from(ck, 2 * P, 150, 50)          # a newcomer reuses them (Fork)
    step(s)
    for pool in s.pools:
        shared = s.space(ck, pool).members
        assert s.space(c, pool).members[:2] == shared == s.space(a, pool).members[:2]
        for x, want in zip(shared, before[pool], strict=True):
            got = page_bytes(s, pool, s.state.pools[pool].pages[x].device)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    decode(s, c, 2 * P, 150)
    decode(s, a, 200, 210)
    s.close()
    r = replay(str(tmp_path / "journal"))  # the incremental §14 checker after every event
    assert r.digest == s.digest() and not r.violations


def test_the_owner_never_rewrites_a_shared_column(tmp_path: Path) -> None:
    """Shared pages are whole committed pages: truncating below them is refused, the checked
    write guard refuses positions below the frontier, and their writer is gone (§9.4)."""
    s = KVStore.open(small_config(tmp_path, checked=True))
    a = running(s, 2 * P)
    ck = s.share_prefix(a)
    step(s)
    p = s.state.pools["main"]
    for x in s.space(ck, "main").members:
        pg = p.pages[x]
        assert pg is not None and (pg.writer, pg.refs, pg.protected) == (-1, 2, P)
    row = s.space(a, "main").row
    guard = s.batch_view("main", 0).guard
    assert guard is not None
    assert_refusals_change_nothing(s, [
        (FrontierError, "outside", lambda: s.truncate(a, "main", P)),
        (WritePermissionError, "below its committed",
         lambda: guard(torch.tensor([row], dtype=torch.int32), torch.tensor([P + 3]))),
    ])
    decode(s, a, 2 * P, 2 * P + 5)  # the next page is private: the owner writes on there
    s.truncate(a, "main", 2 * P)    # down to the shared frontier, not below
    s.close()


def test_refused_shares_change_nothing(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = running(s, 100)
    done = s.finish(running(s, 70), retain=True)
    step(s)
    assert done is not None
    refusals = [
        (InactiveSpace, "not an active sequence", lambda: s.share_prefix(999)),
        (InactiveSpace, "not an active sequence", lambda: s.share_prefix(done)),
        (FrontierError, "beyond its committed", lambda: s.share_prefix(a, 101)),
        (FrontierError, "no whole page", lambda: s.share_prefix(a, P - 1)),
        (InvalidArgument, "frontier", lambda: s.share_prefix(a, -1)),
        (InvalidArgument, "frontier", lambda: s.share_prefix(a, 1.5)),  # type: ignore[arg-type]
    ]
    assert_refusals_change_nothing(s, refusals)
    s.close_boundary()
    with pytest.raises(FrozenUnit):
        s.share_prefix(a)
    s.unit_complete()
    s.close()


def test_the_checkpoint_outlives_its_owner(tmp_path: Path) -> None:
    """Owner released: the shared pages stay (the checkpoint's); private again, so a
    continuation that does not keep the source Moves them."""
    s = KVStore.open(small_config(tmp_path))
    a = running(s, 3 * P + 10)
    ck = s.share_prefix(a, 2 * P + 7)  # whole pages only: two
    step(s)
    s.finish(a)                        # released, not retained
    step(s)
    for x in s.space(ck, "main").members:
        assert s.state.pools["main"].pages[x].refs == 1
    b = s.activate_from(ck, 2 * P, 2 * P, 64, keep_source=False)
    step(s)
    assert ck not in s.state.bundles and s.space(b, "main").committed == 2 * P
    s.close()


def test_a_shared_checkpoint_on_the_device_only_does_not_survive_a_restart(
        tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = running(s, 2 * P)
    ck = s.share_prefix(a)
    step(s)
    assert s.checkpoint_info(ck).survives_restart is False
    s.close()
    s2 = KVStore.open(s.config)
    assert ck in s2.recovery.dropped and a in s2.recovery.dropped
    s2.check_invariants()
    assert not s2.state.bundles
    s2.close()


def test_occupancy_counts_the_pages_only_checkpoints_hold(tmp_path: Path) -> None:
    """``checkpoint_only``: what releasing every checkpoint could free at most — a page an
    active sequence maps (a shared prefix, a Fork) is not in it."""
    s = KVStore.open(small_config(tmp_path))
    a = running(s, 2 * P + 5)
    assert s.occupancy()["main"]["checkpoint_only"] == 0
    ck = s.share_prefix(a)
    step(s)
    assert s.occupancy()["main"]["checkpoint_only"] == 0   # the owner still maps them
    s.finish(a)
    step(s)
    assert s.occupancy()["main"]["checkpoint_only"] == 2
    s.activate_from(ck, P, P + 1, 10)                     # a Fork maps the first one again
    step(s)
    assert s.occupancy()["main"]["checkpoint_only"] == 1
    s.close()


def test_a_shared_prefix_is_announced_and_has_no_parent(tmp_path: Path) -> None:
    """Review findings: routers reading the KV-event stream must learn of a live-shared
    prefix (BlockStored, as for a retained finish), and a shared checkpoint continued
    nothing, so it names no parent (retention evicts leaves before their parents)."""
    from ninfer_kv.tools.journal_cmds import block_hash, kv_events

    s = KVStore.open(small_config(tmp_path))
    a = running(s, 2 * P + 5)
    ck = s.share_prefix(a)
    step(s)
    assert s.checkpoint_info(ck).parent is None
    p = s.state.pools["main"]
    want = [block_hash("main", x, p.gens[x]) for x in s.space(ck, "main").members]
    s.close()
    stored = [i for i in kv_events(str(tmp_path / "journal")) if i["type"] == "BlockStored"]
    assert any(i["block_hashes"] == want and i["token_count"] == 2 * P for i in stored)
