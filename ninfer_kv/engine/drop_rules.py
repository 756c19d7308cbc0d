"""Which device replicas a drop may take along (``KVStore.drop_device``'s ``shared_with``).

A checkpoint's pages may be shared (Fork, Share, Prefix): a retention policy demoting one
victim, or a preemption freeing one request's pages, must not take the prefix another
checkpoint still wants on the device (a parent, a system prompt). ``along`` is the set of
checkpoints that may lose a shared page with the drop; a page held by an inactive checkpoint
outside it stays. The rule is judged when the drop runs: at once, or at the boundary that
publishes the queued copy the drop waits for (engine/host.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ninfer_kv.engine.state import StoreState
from ninfer_kv.errors import UnknownHandle

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


def along_with(store: Txn, checkpoint: int, shared_with: Iterable[int]) -> frozenset[int]:
    """``checkpoint`` and ``shared_with``, each an inactive checkpoint (else ``UnknownHandle``,
    before anything changes): who may lose a shared page along (``drop_device``)."""
    st = store.state
    along = frozenset({checkpoint, *shared_with})  # plain ints (KVStore.drop_device's as_ints)
    for c in along:
        b = st.bundles.get(c)
        if b is None or b.active:
            raise UnknownHandle(f"drop_device: shared_with names {c}, which is not an inactive "
                                "checkpoint")
    return along


def only_along(st: StoreState, pool: str, slot: int, along: frozenset[int] | None,
               members: dict[tuple[int, str], set[int]]) -> bool:
    """No inactive checkpoint outside ``along`` holds live page (pool, slot) (``along``
    None: true) — judged when called, so a checkpoint that came to share it since it was
    scheduled keeps it. ``members``: a cache of memberships for one pass."""
    if along is None:
        return True
    pg = st.pools[pool].pages[slot]
    assert pg is not None  # scheduled or selected pages are live (drops keep them so)
    held = 0
    for c in along:
        if (c, pool) not in members:
            b = st.bundles.get(c)
            members[c, pool] = (set(st.pools[pool].spaces[c].members) if b is not None
                                and not b.active and pool in b.pools else set())
        held += slot in members[c, pool]
    return pg.refs - pg.active_refs <= held


def merged(old: frozenset[int] | None, new: frozenset[int] | None, known: bool
           ) -> frozenset[int] | None:
    """Two schedulings of one drop: either may drop it along with its own checkpoints."""
    if not known:
        return new
    return None if old is None or new is None else old | new
