"""Checkpoint transfer refusals the README names by type (review findings): a header field
the receiver could not publish is ``TransferRefused`` before anything is reserved or moved,
and a page whose host replica rotted on the sender is ``TransferCorrupt`` there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from ninfer_kv import KVStore
from tests.dist import workers as w


def refusal_worker(rank: int, port: int, out: str) -> None:
    """The sender exports (1) a checkpoint whose finish reason is 300 bytes (> REASON_MAX;
    a foreign sender's, patched in), (2) one whose metadata encodes past METADATA_MAX,
    (3) one offloaded to the host tier whose replica then rots one byte, (4) a sound one.
    Each side records what it raised and its state before and after each case."""
    from ninfer_kv.dist import export, import_
    from ninfer_kv.journal.events import METADATA_MAX

    w.init(rank, port)
    store = KVStore.open(w.config(host_bytes=8 << 20))
    res: dict[str, Any] = {"errors": [], "states": [], "records": []}
    cks: list[int] = []
    if rank == 0:
        cks = [w.prefill(store, w.PROMPT, seed=s) for s in range(4)]
        with store.boundary():
            pass
        store.state.bundles[cks[0]].finish_reason = "x" * 300
        store.state.bundles[cks[1]].meta = msgspec.msgpack.encode(b"m" * (METADATA_MAX + 1))
        store.offload(cks[2], drop_device=True)
        with store.boundary():
            pass
        p = store.state.pools["main"]
        pg = p.pages[p.spaces[cks[2]].members[1]]
        assert pg is not None and pg.device < 0 and pg.host is not None
        store.arena.data[pg.host[0] + 5] ^= 0xFF  # type: ignore[union-attr]
    for i in range(4):
        res["states"].append(w.state_of(store))
        res["records"].append(store.state.seq)
        try:
            if rank == 0:
                export(store, cks[i], 1)
            else:
                import_(store, 0)
            res["errors"].append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            res["errors"].append(f"{type(exc).__name__}: {exc}")
    res["states"].append(w.state_of(store))
    res["records"].append(store.state.seq)
    store.close()
    w.dump(Path(out) / f"r{rank}.json", res)


def test_unpublishable_headers_are_refused_first_and_rot_is_corrupt(tmp_path: Path) -> None:
    assert w.launch(refusal_worker, str(tmp_path), timeout=150) == [0, 0]
    a, b = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    # (1), (2): refused by the receiver's header check — nothing reserved, no record written
    for i, what in ((0, "reason"), (1, "metadata")):
        assert b["errors"][i].startswith("TransferRefused") and what in b["errors"][i], b
        assert a["errors"][i].startswith("TransferRefused"), a["errors"]
        assert b["states"][i + 1] == b["states"][i] and b["records"][i + 1] == b["records"][i]
    # (3): the sender's own check of its host replica, under its own name
    assert a["errors"][2].startswith("TransferCorrupt") and "host replica" in a["errors"][2], a
    assert b["errors"][2].startswith("TransferAborted") and b["states"][3] == b["states"][2]
    # (4): the wire stayed in step
    assert a["errors"][3] is None and b["errors"][3] is None
    assert len(b["states"][4]["checkpoints"]) == len(b["states"][3]["checkpoints"]) + 1
    assert b["states"][4]["violations"] == []
