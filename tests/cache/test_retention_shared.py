"""Review findings on the retention policy: a demotion dropped the device pages a victim
shares with checkpoints that rank after it (its parent, a system prompt of higher priority);
``make_room`` could evict the checkpoint the admission asking for room was about to continue;
some arguments raised a plain ``TypeError``."""

from __future__ import annotations

import pytest

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.cache.retention import LruRetention
from ninfer_kv.errors import InvalidArgument, UnknownHandle


def open_store(host: bool = True) -> KVStore:
    return KVStore.open(StoreConfig(
        model=ModelGeometry(layers=1, kv_heads=1, head_dim=64, mtp_layers=0),
        serving=ServingConfig(max_context=512, max_concurrency=4), kv_tokens=16 * 64,
        host_bytes=1 << 22 if host else 0))


def boundary(store: KVStore) -> None:
    with store.boundary():
        pass


def retained(store: KVStore, tokens: int, source: int | None = None, at: int = 0) -> int:
    """A checkpoint of ``tokens`` committed tokens: new, or continuing ``source`` at ``at``."""
    s = store.activate(tokens, 1) if source is None else store.activate_from(source, at,
                                                                               tokens, 1)
    store.ensure_mapped(s, "main", tokens)
    boundary(store)
    store.commit(s, "main", tokens)
    ck = store.finish(s, retain=True)
    boundary(store)
    assert ck is not None
    return ck


def device_pages(store: KVStore, ck: int) -> int:
    return store.checkpoint_info(ck, metadata=False).pools["main"].device_pages


def system_prompt_and_leaf() -> tuple[KVStore, LruRetention, int, int]:
    """A 4-page system prompt ``s`` (priority 1) and a low-priority leaf continuing it by one
    page, offloaded whole (``s``'s pages get their host replicas with it)."""
    store = open_store()
    s = retained(store, 256)
    pol = LruRetention(priority=lambda ck: 1 if ck == s else 0)
    pol.retain(s, [("s", i) for i in range(4)])
    leaf = retained(store, 320, source=s, at=256)
    pol.retain(leaf, [("s", i) for i in range(4)] + [("l", 0)], parent=s)
    store.offload(leaf)
    boundary(store)
    return store, pol, s, leaf


def test_demoting_a_leaf_leaves_the_prefix_it_shares_on_the_device() -> None:
    store, pol, s, leaf = system_prompt_and_leaf()
    free = store.occupancy()["main"]["available"]
    assert list(pol.victims()) == [leaf, s]
    assert pol.make_room(store) == "demote"
    boundary(store)
    assert device_pages(store, s) == 4                    # it dropped 5 before the fix
    assert device_pages(store, leaf) == 4 and pol.entries[leaf].demoted
    assert store.occupancy()["main"]["available"] == free + 1
    # the system prompt's own turn: it goes with the pages the demoted leaf shares
    assert pol.make_room(store) == "demote"
    boundary(store)
    assert device_pages(store, s) == device_pages(store, leaf) == 0
    assert store.occupancy()["main"]["available"] == free + 5
    store.check_invariants()
    store.close()


def test_drop_device_shared_with() -> None:
    """The store's rule: ``shared_with`` names the checkpoints that may lose shared pages
    along (empty: the checkpoint's own pages only); names are checked first."""
    store, _, s, leaf = system_prompt_and_leaf()
    digest = store.digest()
    with pytest.raises(UnknownHandle, match="shared_with names 999"):
        store.drop_device(leaf, shared_with=[999])
    with pytest.raises(InvalidArgument, match="shared_with"):
        store.drop_device(leaf, shared_with=["s"])  # type: ignore[list-item]
    assert store.digest() == digest
    assert store.drop_device(leaf, shared_with=[]) == 1
    boundary(store)
    assert store.drop_device(leaf, shared_with=[s]) == 4
    boundary(store)
    assert device_pages(store, s) == device_pages(store, leaf) == 0
    store.check_invariants()
    store.close()


def test_make_room_never_evicts_the_checkpoint_it_is_told_to_keep() -> None:
    store = open_store(host=False)
    pol = LruRetention()
    a, b = retained(store, 128), retained(store, 128)
    pol.retain(a, ("a",))
    pol.retain(b, ("b",))
    assert next(pol.victims()) == a                       # the least recently used
    assert pol.make_room(store, keep=a) == "release"
    assert store.checkpoints() == [a] and list(pol.entries) == [a]
    assert pol.make_room(store, keep=a) is None           # nothing else to evict
    with pytest.raises(InvalidArgument, match="keep"):
        pol.make_room(store, keep="a")  # type: ignore[arg-type]
    assert store.checkpoints() == [a]
    store.close()


@pytest.mark.parametrize("call", [
    lambda pol: pol.retain(5, ("x",), parent=[1]),
    lambda pol: pol.retain(5, ("x",), parent="x"),
    lambda pol: pol.forget([1]),
    lambda pol: pol.restored([1]),
])
def test_checkpoint_ids_are_refused_typed(call) -> None:  # noqa: ANN001
    pol = LruRetention()
    pol.retain(1, ("a",))
    with pytest.raises(InvalidArgument):
        call(pol)
    assert list(pol.entries) == [1] and pol.entries[1].children == 0


def test_drops_scheduled_behind_a_queued_offload_keep_shared_pages_too() -> None:
    """A page whose D2H copy is still queued drops when the copy publishes: ``shared_with``
    filters those as it filters the pages dropped at once."""
    store = open_store()
    s = retained(store, 256)
    leaf = retained(store, 320, source=s, at=256)
    store.offload(leaf)                                   # queued: published at the boundary
    assert store.drop_device(leaf, shared_with=[]) == 1  # its own page, scheduled
    boundary(store)
    assert device_pages(store, s) == 4 and device_pages(store, leaf) == 4
    store.check_invariants()
    store.close()


def test_swap_out_frees_the_sequences_own_pages_not_a_shared_prefix() -> None:
    """Review finding (a risk): preempting a request that continues a cached system prompt
    dropped the prompt's device pages with its own, so the next request continuing the
    prompt had to restore it from the host. As vLLM keeps the blocks a preempted request
    shares, only the pages the preempted one holds alone are freed."""
    from ninfer_kv.cache.preemption import swap_in, swap_out

    store = open_store()
    s = retained(store, 256)
    seq = store.activate_from(s, 256, 256, 128)
    store.ensure_mapped(seq, "main", 320)
    boundary(store)
    store.commit(seq, "main", 320)
    free = store.occupancy()["main"]["available"]
    sw = swap_out(store, seq, 384)
    boundary(store)
    assert sw.offloaded and device_pages(store, s) == 4    # 0 before the fix
    assert device_pages(store, sw.checkpoint) == 4          # the shared prefix only
    assert store.occupancy()["main"]["available"] == free + 1 + 1  # its page and reservation
    back = swap_in(store, sw)
    boundary(store)
    assert store.space(back).committed == 320
    store.check_invariants()
    store.close()


def swapped_continuation(store: KVStore, s: int) -> object:
    """A sequence continuing ``s`` by one page, swapped out: its own page left the device,
    the prefix it shares with ``s`` stayed."""
    from ninfer_kv.cache.preemption import swap_out

    seq = store.activate_from(s, 256, 256, 128)
    store.ensure_mapped(seq, "main", 320)
    boundary(store)
    store.commit(seq, "main", 320)
    sw = swap_out(store, seq, 384)
    boundary(store)
    return sw


def test_a_prefix_shared_only_with_holders_not_demoted_is_demoted_before_any_release() -> None:
    """Review finding on the fix: a swapped-out checkpoint holds the prompt's pages and is
    not demoted, so no demotion dropped them; make_room released the swapped checkpoint —
    freeing nothing and losing it (swap_in: UnknownHandle) — before it demoted the prompt."""
    from ninfer_kv.cache.preemption import swap_in

    store = open_store()
    s = retained(store, 256)
    pol = LruRetention()
    pol.retain(s, [("s", i) for i in range(4)])
    sw = swapped_continuation(store, s)
    pol.retain(sw.checkpoint, [("s", i) for i in range(4)] + [("l", 0)], parent=s)
    free = store.occupancy()["main"]["available"]
    assert pol.make_room(store) == "demote"
    boundary(store)
    assert store.occupancy()["main"]["available"] == free + 4
    assert set(store.checkpoints()) == {s, sw.checkpoint}
    back = swap_in(store, sw)                             # restores the prompt's pages too
    boundary(store)
    assert store.space(back).committed == 320
    store.check_invariants()
    store.close()


def test_a_swapped_out_holder_outside_the_policy_does_not_pin_the_prefix() -> None:
    """The same with the swapped checkpoint held by the engine, not the policy (the
    simulator's way): the prompt is demoted for an admission instead of it being refused."""
    store = open_store()
    s = retained(store, 256)
    pol = LruRetention()
    pol.retain(s, [("s", i) for i in range(4)])
    swapped_continuation(store, s)
    free = store.occupancy()["main"]["available"]
    assert pol.make_room(store) == "demote"
    boundary(store)
    assert store.occupancy()["main"]["available"] == free + 4 and device_pages(store, s) == 0
    store.check_invariants()
    store.close()


def test_a_continuation_restoring_a_demoted_parent_clears_its_flag() -> None:
    """Review finding on the fix: a continuation of the leaf restored the demoted parent's
    prefix, but the parent stayed flagged, so the leaf's next demotion took the prefix along
    again as a demoted holder's."""
    store, pol, s, leaf = system_prompt_and_leaf()
    assert pol.make_room(store) == pol.make_room(store) == "demote"  # the leaf, then s
    boundary(store)
    seq = store.activate_from(leaf, 320, 320, 64)
    boundary(store)
    pol.restored(leaf)
    store.finish(seq)
    boundary(store)
    assert not pol.entries[s].demoted and device_pages(store, s) == 4
    assert pol.make_room(store) == "demote"               # the leaf's own page only
    boundary(store)
    assert device_pages(store, s) == 4 and device_pages(store, leaf) == 4
    store.check_invariants()
    store.close()


def test_a_page_that_comes_to_be_shared_before_its_drop_publishes_stays() -> None:
    """Review finding: ``shared_with`` was judged when the drop was scheduled; a checkpoint
    that came to share the page before the copy published (a Fork of the swapped-out
    request, retained) lost its device residency. It is judged again at the publish."""
    from ninfer_kv.cache.preemption import swap_out

    store = open_store()
    seq = store.activate(320, 64)
    store.ensure_mapped(seq, "main", 320)
    boundary(store)
    store.commit(seq, "main", 320)
    sw = swap_out(store, seq, 384)                       # all 5 pages its own: scheduled
    fork = store.activate_from(sw.checkpoint, 256, 256, 1)  # shares 4 of them, before the copy
    kept = store.finish(fork, retain=True)
    boundary(store)
    assert device_pages(store, kept) == 4                 # 0 before the fix
    assert device_pages(store, sw.checkpoint) == 4        # its own 5th page went
    store.check_invariants()
    store.close()


def test_a_drop_scheduled_twice_counts_once() -> None:
    """Review nit: a second drop_device in the interval counted the pages the first had
    scheduled behind the queued copy again (a loop counting it as progress would spin)."""
    store = open_store()
    s = retained(store, 256)
    leaf = retained(store, 320, source=s, at=256)
    store.offload(leaf)
    assert store.drop_device(leaf, shared_with=[]) == 1  # its own page
    assert store.drop_device(leaf, shared_with=[]) == 0
    assert store.drop_device(leaf) == 4                   # the shared ones, newly scheduled
    assert store.drop_device(leaf) == 0
    boundary(store)                                       # the unfiltered call: all of them
    assert device_pages(store, leaf) == 0 and device_pages(store, s) == 0
    store.check_invariants()
    store.close()
