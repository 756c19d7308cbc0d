"""The array-checked decode commit (engine/decode.py ``commit_many``) refuses a block the
sequence may not write (§9.4) for each clause of ``writable``: another writer, a pin, a
protected column at or above the first new column. The state is corrupted directly, as a bug
elsewhere would leave it; the refusal is typed and leaves the digest unchanged."""

from __future__ import annotations

import pytest

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.engine.state import digest
from ninfer_kv.errors import WritePermissionError


@pytest.mark.parametrize("field,value", [("pg_writer", 999), ("pg_pins", 1),
                                         ("pg_protected", 40)])
def test_decode_commit_refuses_a_block_it_may_not_write(field: str, value: int) -> None:
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
        serving=ServingConfig(max_context=256, max_concurrency=2), kv_tokens=8 * 64,
        allocate_planes=False))
    a, b = store.activate(30, 100), store.activate(30, 100)
    store.ensure_mapped_many("main", [a, b], [31, 31])
    with store.boundary():
        pass
    store.commit_many("main", [a, b], [30, 30])
    p = store.state.pools["main"]
    slot = p.spaces[b].member(0)
    getattr(p, field)[slot] = value
    before = digest(store.state)
    with pytest.raises(WritePermissionError, match=f"seq {b} pool main block 0"):
        store.commit_many("main", [a, b], [31, 31])
    assert digest(store.state) == before
    getattr(p, field)[slot] = {"pg_writer": b, "pg_pins": 0, "pg_protected": 0}[field]
    store.commit_many("main", [a, b], [31, 31])  # the same batch once the block is writable
    assert p.spaces[b].committed == 31
