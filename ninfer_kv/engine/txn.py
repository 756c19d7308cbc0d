"""``Txn``: the narrow surface of the store that a command module works through.

A command (engine/continuation.py, growth.py, host.py, restart.py, checked.py, opening.py)
reads ``state`` and the fixed configuration, validates everything, plans, and only then calls
``_emit`` — which applies each event (``apply`` stays the only mutator) and queues it for the
next boundary's journal record — and ``_touch``, which marks a table row to publish. Device
work for the boundary goes to ``_effects`` (copies, restores) and ``_transfers`` (D2H).

The modules type against this Protocol, never against ``KVStore``, so nothing inside
``ninfer_kv.engine`` imports the store back: the import graph is acyclic (tested in
tests/engine/test_import_graph.py). ``StoreCore``/``KVStore`` satisfy it structurally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ninfer_kv.engine.capacity import CapacityPlan
from ninfer_kv.engine.config import RecoveryReport, StoreConfig
from ninfer_kv.engine.device import DeviceState
from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal.log import Journal


class Txn(Protocol):
    state: StoreState
    plan: CapacityPlan
    config: StoreConfig
    device: DeviceState
    arena: HostArenaBuffer | None
    journal: Journal | None
    recovery: RecoveryReport
    stats: dict[str, int]
    fault_hook: Callable[[str, str], None] | None
    _pending: list[Any]
    _ids_base: int             # where new_ids counts the id window from (durability.py)
    _ids_durable: int          # the next seq id as of the last durable record
    _ids_acked: int | None     # a Leader's: the next seq id its standbys acknowledged
    _unjournaled: list[Any]    # applied, but no record holds them for sure (a failure's)
    _journaled: bool           # opened with a journal (still true after close)
    _effects: list[Any]        # ev.CopyTail | ev.DeviceRestore, run in emission order
    _transfers: list[Any]      # host.Transfer, run after the table writes
    _unpin_drops: dict[tuple[str, int], Any]  # (pool, slot) to drop when unpinned: its along
    _touched: dict[str, dict[int, int]]  # pool -> seq -> first block to publish
    _unwritten: dict[str, dict[int, int]]  # the same since the last unit ran
    _freed_rows: dict[str, set[int]]     # pool -> rows a finish left: unmapped at the boundary
    _written: dict[tuple[str, int, int], set[int]]  # checked mode: (pool, seq, layer) -> tokens
    _frozen: bool                         # a GPU unit is in flight (§8.4)

    @property
    def pools(self) -> tuple[str, ...]: ...

    def entitlement_pages(self, pool: str, frontier: int, budget: int) -> int: ...

    def _emit(self, *events: Any) -> None: ...

    def _touch(self, pool: str, bundle: int, block: int) -> None: ...

    def _touch_many(self, pool: str, bundles: list[int], blocks: list[int]) -> None: ...

    def _free_row(self, pool: str, row: int) -> None: ...

    def _publish_record(self) -> int: ...

    def _recover_cleanup(self) -> None: ...
