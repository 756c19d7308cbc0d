"""``ninfer-kv simulate --tp 2`` and ``--disagg`` on local gloo processes, with --json."""

from __future__ import annotations

import json

import pytest

from ninfer_kv.tools.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_simulate_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--tp", "2", "--limit", "5")
    assert d["mode"] == "tp=2" and d["ranks"] == 2 and d["requests"] == 5
    assert d["digests_equal"] is True and len(d["digests"]) == 2
    assert d["digests"][0] == d["digests"][1]
    assert d["bytes_moved"] > 0 and d["records"] >= d["boundaries"] > 0
    assert d["invariants_ok"] is True
    # every finished request went to each rank's own arena and came back for its continuation
    assert min(d["d2h_pages"]) > 0 and d["d2h_pages"][0] == d["d2h_pages"][1]
    assert min(d["h2d_pages"]) > 0 and d["h2d_pages"][0] == d["h2d_pages"][1]
    assert d["host_replicas_ok"] is True


def test_simulate_disagg(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--disagg", "--limit", "3")
    assert d["mode"] == "disagg" and d["checkpoints"] == 3
    page = 2 * 2 * 4 * 64 * 64 * 2  # layers x (K, V) x heads x P x head_dim x bf16
    assert d["pages"] > 0 and d["bytes_moved"] == d["pages"] * page
    assert d["transfer_gbps"] > 0 and d["invariants_ok"] is True
    assert len(d["digests"]) == 2


def test_simulate_refuses_both_topologies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--tp", "2", "--disagg", "--json"]) == 2
    assert "choose one topology" in capsys.readouterr().err


def test_simulate_tp2_with_a_standby(capsys: pytest.CaptureFixture[str]) -> None:
    """The standby, promoted after the stream, keeps exactly the checkpoints a reopen of the
    leader keeps (every other request's stays offloaded, durable). 150 requests fill the
    8 MiB arena with kept checkpoints: one that no longer fits is released, not a crash."""
    d = run_json(capsys, "--tp", "2", "--standby", "--limit", "150")
    assert d["acked"] > 0 and d["digests_equal"] is True
    assert d["leader_reopen_kept"] and d["standby_promoted_kept"] == d["leader_reopen_kept"]
    assert d["standby_ok"] is True and d["invariants_ok"] is True


def test_simulate_standby_needs_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--disagg", "--standby", "--json"]) == 2
    assert "--standby needs --tp" in capsys.readouterr().err
