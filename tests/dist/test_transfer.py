"""Checkpoint transfer between two gloo processes: prefill on A, decode on B (§5.3: B publishes
only verified bytes); a peer that dies or a byte that flips leaves B as it was."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.dist import workers as w


def load(tmp: Path, name: str) -> dict:
    return json.loads((tmp / name).read_text())


def test_prefill_on_a_decode_on_b_equals_a_and_corruption_is_refused(tmp_path: Path) -> None:
    assert w.launch(w.xfer_worker, str(tmp_path)) == [0, 0]
    a, b = load(tmp_path, "x0.json"), load(tmp_path, "x1.json")
    pages = -(-w.PROMPT // 64)
    page_bytes = w.LAYERS * 2 * w.HKV * 64 * w.D * 2
    assert b["import"][:3] == [pages, pages * page_bytes, pages] == a["export"][:3]
    assert a["export"][3] == b["import"][3]  # the sender learns the receiver's checkpoint id
    assert b["info"] == [w.PROMPT, {"prompt": w.PROMPT, "seed": 7}, False, "stop"]
    assert b["after"]["checkpoints"] == [b["import"][3]] and b["before"]["checkpoints"] == []
    assert b["after"]["violations"] == []

    # decoding the transferred checkpoint on B gives A's outputs
    assert len(a["outs"]) == len(b["outs"]) == w.DECODE * w.LAYERS
    diff = max((torch.tensor(x) - torch.tensor(y)).abs().max().item()
               for x, y in zip(a["outs"], b["outs"], strict=True))
    assert diff <= 1e-6, diff
    assert max(abs(v) for o in a["outs"] for v in o) > 0.1

    # (e) a byte flipped on arrival: CRC mismatch, nothing published, nothing leaked
    assert b["second"].startswith("TransferCorrupt") and "CRC-32C" in b["second"], b["second"]
    assert "block 1" in b["second"]
    assert a["second"].startswith("TransferCorrupt"), a
    assert b["after2"] == b["before2"]
    assert b["after2"]["violations"] == []


def test_sender_killed_mid_transfer_leaves_receiver_clean(tmp_path: Path) -> None:
    codes = w.launch(w.kill_worker, str(tmp_path))
    assert codes == [7, 0], codes
    b = load(tmp_path, "k1.json")
    assert b["error"].startswith("TransferAborted"), b
    assert b["after"] == b["before"]  # no new checkpoint, occupancy as before, no active
    assert b["before"]["checkpoints"] == [b["keep"]] and b["after"]["active"] == []
    assert b["after"]["violations"] == []
    assert b["reopened"]["checkpoints"] == [] and b["reopened"]["violations"] == []
    assert b["reopened"]["occupancy"]["main"]["allocated"] == 0


def test_a_side_failing_by_itself_mid_transfer_tells_the_other(tmp_path: Path) -> None:
    """Regression: a receiver whose own code raised mid-transfer stopped posting receives, so
    the sender blocked in its sends until the group's timeout (30 minutes by default) and
    then reported a timeout; a sender failing the same way left the receiver blocked."""
    assert w.launch(w.abort_worker, str(tmp_path)) == [0, 0]
    a, b = load(tmp_path, "a0.json"), load(tmp_path, "a1.json")
    # (1) the receiver's hook raised: both abort, the sender with the receiver's reason
    assert b["errors"][0].startswith("TransferAborted") and "hook failed on rank 1" in \
        b["errors"][0], b["errors"]
    assert a["errors"][0].startswith("TransferAborted") and "rank 1" in a["errors"][0] \
        and "hook failed on rank 1" in a["errors"][0], a["errors"]
    # (2) the sender's hook raised: both abort, the receiver hears that the sender aborted
    assert "hook failed on rank 0" in a["errors"][1], a["errors"]
    assert b["errors"][1].startswith("TransferAborted") and "sender aborted" in \
        b["errors"][1], b["errors"]
    # (3)/(4) the receiver could not place a chunk (review: a failure inside the receive
    # posting, even a RuntimeError such as out of memory, is its own, not the wire's): it
    # drains, both abort with its reason, promptly
    for i, why in ((2, "ValueError"), (3, "OutOfMemoryError")):
        assert why in b["errors"][i] and "staging failed on rank 1" in b["errors"][i]
        assert "staging failed on rank 1" in a["errors"][i], a["errors"]
    for side in (a, b):  # nothing published, nothing leaked
        assert all(st == side["before"] for st in side["states"]), side["states"]
        assert side["before"]["violations"] == []
    # (3) the wire stayed in step: the next transfer goes through
    pages = -(-w.PROMPT // 64)
    assert a["third"] == b["third"] == pages and b["third_info"] == w.PROMPT


def test_a_transfer_between_fragmented_stores_goes_through_staging(tmp_path: Path) -> None:
    codes = w.launch(w.frag_worker, str(tmp_path))
    assert codes == [0, 0], codes
    a, b = load(tmp_path, "f0.json"), load(tmp_path, "f1.json")
    for side in (a, b):  # scattered page groups on both sides: no zero-copy chunk
        ids = side["ids"]
        assert len(ids) >= 3 and all(y != x + 1 for x, y in zip(ids, ids[1:], strict=False))
    assert a["chunks"] >= 3  # two scattered pages per chunk: both staging slots reused
    assert b["crcs"] == a["crcs"] and b["violations"] == []


def boundary_failure_worker(rank: int, port: int, out: str) -> None:
    """Rank 1's journal fails at the boundary that publishes the import's reserved pages:
    after its "ready", before the first chunk. Each side records what it raised."""
    from ninfer_kv import KVStore
    from ninfer_kv.dist import export, import_
    from ninfer_kv.errors import JournalError

    w.init(rank, port)
    store = KVStore.open(w.config(journal_dir=f"{out}/journal{rank}"))
    res = {}
    ck = 0
    if rank == 0:
        ck = w.prefill(store, 128, seed=1)
        with store.boundary():
            pass
    else:
        def eio(*_: object, **__: object) -> int:
            raise JournalError("write of record: [Errno 5] Input/output error")
        store.journal.append = eio  # type: ignore[union-attr, method-assign]
    try:
        export(store, ck, 1) if rank == 0 else import_(store, 0)
        res["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        res["error"] = f"{type(exc).__name__}: {exc}"
    store.close()
    w.dump(Path(out) / f"f{rank}.json", res)


def test_a_receiver_failing_before_the_first_chunk_drains_and_answers(tmp_path: Path) -> None:
    """Review repro: the receiver's boundary failed after it answered "ready", so nothing
    received the sender's chunks and its "aborted" answer blocked too: both sides waited for
    the group's timeout (30 s here, 30 minutes by default). It drains the chunks now and
    answers; both abort promptly, the sender with the receiver's reason."""
    assert w.launch(boundary_failure_worker, str(tmp_path)) == [0, 0]
    a, b = load(tmp_path, "f0.json"), load(tmp_path, "f1.json")
    assert b["error"].startswith("TransferAborted") and "StoreFailed" in b["error"], b
    assert "every reserved page freed" not in b["error"], b  # the store stopped: none was
    assert a["error"].startswith("TransferAborted") and "StoreFailed" in a["error"], a
    assert "Timed out" not in a["error"] + b["error"], (a, b)  # answered, not timed out
