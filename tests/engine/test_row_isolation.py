"""A row nobody holds maps nothing (§7.2: an inactive address space has no execution row;
README: unmapped entries are -1). Review finding (high): ``finish`` gave the row back without
unmapping it, so the row kept naming pages that were then freed and reused by another request
(or, retained, the checkpoint's immutable pages). A ``table_rows`` an engine kept for the
finished request — a padding lane of a CUDA graph — read another request's KV, and in the
default mode wrote it; the wrappers' mapped checks and the CUDA kernels' skip of -1 entries
could not see it, and ``violations()`` compared only active rows."""

from __future__ import annotations

import pytest
import torch

from ninfer_kv import append_kv, paged_decode
from ninfer_kv.dist import Follower, Leader, shard_config
from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.device import UNMAPPED
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import InvalidArgument
from tests.dist import workers as w


def store(checked: bool = False) -> KVStore:
    return KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                                    serving=ServingConfig(max_context=256, max_concurrency=4),
                                    kv_tokens=4 * 64, checked=checked))


def fill(s: KVStore, seq: int, n: int) -> torch.Tensor:
    s.ensure_mapped(seq, "main", n)
    kv = torch.randn(n, 1, 64)
    with s.boundary():
        rows = s.table_rows("main", [seq])
        append_kv(s.batch_view("main", 0), rows.repeat(n), torch.arange(n), kv, kv)
    s.commit(seq, "main", n)
    return kv


def row_of(s: KVStore, seq: int) -> int:
    return s.space(seq, "main").row


def assert_unmapped(s: KVStore, row: int) -> None:
    pd = s.device.pools["main"]
    assert pd.published[row] == 0
    assert (pd.block_tables[row] == UNMAPPED).all(), pd.block_tables[row]
    assert s.violations() == []


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_a_finished_row_is_unmapped_at_the_boundary(checked: bool, retain: bool) -> None:
    s = store(checked)
    x, a = s.activate(1, 1), s.activate(64, 0)
    fill(s, a, 64)
    kept = torch.tensor([row_of(s, a)], dtype=torch.int32)  # the engine keeps its rows
    s.finish(a, retain=retain)
    s.finish(x, retain=False)
    b = s.activate(128, 0)                      # reuses a's page when a is not retained
    kb = fill(s, b, 128)
    with s.boundary():
        assert_unmapped(s, int(kept))
        view = s.batch_view("main", 0)
        with pytest.raises(InvalidArgument, match="not a mapped page"):  # §12.4
            paged_decode(torch.randn(1, 1, 64), view, kept, torch.tensor([64], dtype=torch.int32))
        before = view.k_pages.clone()
        with pytest.raises(InvalidArgument, match="not mapped"):
            append_kv(view, kept, torch.tensor([5]), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
        assert torch.equal(view.k_pages, before)
        rb = s.table_rows("main", [b])          # b reads its own tokens, as written
        out = paged_decode(torch.zeros(1, 1, 64), view, rb, torch.tensor([128], dtype=torch.int32))
        mean = kb[:, 0].bfloat16().float().mean(0)  # q = 0: uniform weights
        assert torch.allclose(out[0, 0].float(), mean, atol=2e-2)
    s.close()


def test_a_row_leased_again_in_the_same_interval_maps_its_new_owner_only() -> None:
    s = store()
    a = s.activate(192, 0)
    fill(s, a, 192)
    row = row_of(s, a)
    s.finish(a, retain=False)
    b = s.activate(64, 0)                        # the lowest free row: a's
    s.ensure_mapped(b, "main", 64)
    assert row_of(s, b) == row
    with s.boundary():
        pd = s.device.pools["main"]
        g = s.state.pools["main"].pages[s.space(b, "main").members[0]].device
        assert pd.block_tables[row].tolist() == [g, UNMAPPED, UNMAPPED, UNMAPPED]
        assert pd.published[row] == 1 and s.violations() == []
    s.close()


def test_violations_report_a_row_nobody_holds_that_maps_a_page() -> None:
    s = store()
    a = s.activate(64, 0)
    fill(s, a, 64)
    free = next(iter(s.state.pools["main"].free_rows))
    s.device.write_table("main", free, 0, [0])   # what the old finish left behind
    assert any(f"row {free} is leased to no sequence" in v for v in s.violations())
    s.close()


def test_a_follower_unmaps_the_rows_its_leader_freed() -> None:
    leader_store = KVStore.open(shard_config(w.config(), 2))
    sent: list[bytes] = []
    leader = Leader(leader_store, sent.append, send_digest=True)
    follower = Follower.from_hello(leader_store.config, sent.pop(0))
    a = leader_store.activate(64, 1)
    leader_store.ensure_mapped(a, "main", 64)
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))
    row = row_of(leader_store, a)
    assert follower.store.device.pools["main"].published[row] == 1
    leader_store.commit(a, "main", 64)
    leader_store.finish(a, retain=True)
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))
    for s in (leader_store, follower.store):
        assert_unmapped(s, row)
    leader_store.close()
    follower.close()
