"""TP=2 over gloo: a leader and a follower, each holding half the KV heads, decode the same
batches as one store holding all of them (§13: every rank publishes the same tables)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ninfer_kv import KVStore
from tests.dist import workers as w


@pytest.mark.parametrize("host", [False, True], ids=["device", "host-tier"])
def test_tp2_decode_equals_single_store_and_digests_match(tmp_path: Path, host: bool) -> None:
    """``host-tier``: the Fork's checkpoint is first offloaded with its device pages dropped,
    so every rank copies its own shard out (D2H) and back (H2D) before the partial-tail copy."""
    codes = w.launch(w.tp_worker, str(tmp_path), host)
    assert codes == [0, 0], codes
    r0, r1 = (json.loads((tmp_path / f"tp{r}.json").read_text()) for r in range(2))

    single = KVStore.open(w.config(host_bytes=w.HOST_BYTES if host else 0))
    ref, _ = w.drive(single, host=host)
    single.close()

    # one output per step and layer; each rank holds half the query heads of every output
    assert len(r0["outs"]) == len(r1["outs"]) == len(ref) == w.STEPS * w.LAYERS
    worst = 0.0
    for a, b, want in zip(r0["outs"], r1["outs"], ref, strict=True):
        full = torch.tensor(want).view(-1, w.HQ, w.D)
        got = torch.cat([torch.tensor(a).view(-1, w.HQ // 2, w.D),
                         torch.tensor(b).view(-1, w.HQ // 2, w.D)], dim=1)
        assert got.shape == full.shape and full.numel() > 0
        worst = max(worst, (got - full).abs().max().item())
    assert worst <= 1e-6, worst
    assert max(abs(x) for o in ref for x in o) > 0.1  # real outputs, not zeros on both sides

    # the follower reached the leader's digest at every boundary (and after the close)
    assert len(r0["digests"]) == w.STEPS + 1
    assert r0["digests"] == r1["digests"]
    assert len(set(r0["digests"])) == len(r0["digests"])  # the state moved every step
    assert r0["tables"] == r1["tables"]  # block tables equal entry for entry
    assert r1["records"] >= w.STEPS
    assert r1["cow_copies"] >= 1  # the Fork's partial-tail copy ran on the follower's shard
    if host:  # its shard went to its own arena and came back, and its replicas check out
        assert r1["d2h_pages"] >= 1 and r1["h2d_pages"] >= 1, r1
        assert r1["verify_host"] == []
