"""Every CLI command on a small journal, with --json parsed back; replay/inspect/diff
semantics; the plot's data (not its pixels)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import JournalError
from ninfer_kv.journal.events import CODEC, CommitFrontiers, Event, pack, unpack
from ninfer_kv.journal.export import OPAQUE_FIELDS, PACKED_FIELDS, metadata_jsonable
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import diff, replay
from ninfer_kv.tools.cli import main
from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, make_store, simulate


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("cli")
    journal = str(d / "journal")
    opts = SimOptions(max_concurrency=6, max_context=8192, kv_tokens=24576, layers=1,
                      kv_heads=1, head_dim=64, mtp=True, offload=True, host_bytes=16 << 20,
                      journal_dir=journal, allocate_planes=True, scale=8, seed=3)
    store = make_store(opts)
    captured: dict[int, str] = {}
    close = store.close_boundary

    def close_and_capture() -> int:
        seq = close()
        if len(captured) < 40:
            captured[seq] = store.digest()
        return seq

    store.close_boundary = close_and_capture  # type: ignore[method-assign]
    store, res = simulate(load_trace(DEFAULT_TRACE, 60), opts, store=store)
    live = store.digest()
    store.close()
    return {"dir": d, "journal": journal, "live": live, "res": res, "captured": captured}


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_json_matches_live(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = cli_json(capsys, "replay", run["journal"], "--verify", "--every", "7")
    assert {"records", "events", "digest", "violations"} <= set(out)
    assert out["digest"] == run["live"] and out["violations"] == []
    assert out["records"] == JournalReader(run["journal"]).last_seq


def test_replay_json_says_where_a_torn_journal_ends(run: dict, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Review finding: a torn tail replayed with exit 0 and a --json that did not say the
    history was cut. It lists the cut (the copy keeps its bytes: replay only reads)."""
    torn = tmp_path / "journal"
    shutil.copytree(run["journal"], torn)
    seg = sorted(torn.glob("seg-*.log"))[-1]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 5)  # the last record loses its end
    out = cli_json(capsys, "replay", str(torn))
    assert out["records"] == JournalReader(run["journal"]).last_seq - 1
    assert len(out["cuts"]) == 1 and "torn tail" in out["cuts"][0], out["cuts"]
    assert cli_json(capsys, "inspect", str(torn))["cuts"] == out["cuts"]  # inspect says so too
    assert seg.stat().st_size == size - 5
    assert cli_json(capsys, "replay", run["journal"])["cuts"] == []
    assert cli_json(capsys, "inspect", run["journal"])["cuts"] == []


def test_replay_scans_the_journal_once(run: dict, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``ninfer-kv replay`` read the whole journal twice (once for the progress bar's total,
    once to replay it), so a torn tail was reported twice and every segment CRC-checked twice.
    One scan: one ``journal.cut`` warning."""
    torn = tmp_path / "journal"
    shutil.copytree(run["journal"], torn)
    seg = sorted(torn.glob("seg-*.log"))[-1]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 5)
    with capture_logs() as logs:
        out = cli_json(capsys, "replay", str(torn))
    assert [e["event"] for e in logs].count("journal.cut") == 1, logs
    assert len(out["cuts"]) == 1


def test_replay_until_matches_state_captured_at_that_boundary(run: dict) -> None:
    assert len(run["captured"]) >= 10
    for seq, dig in list(run["captured"].items())[::4]:
        assert replay(run["journal"], until_record=seq).digest == dig


def test_diff_finds_injected_divergence(run: dict, tmp_path: Path) -> None:
    src = JournalReader(run["journal"])
    records = list(src.records())
    target = next(seq for seq, evs in records[len(records) // 2:]
                  if any(isinstance(e, CommitFrontiers) for e in evs))
    other = tmp_path / "other"
    j = Journal.open(str(other), CODEC, JournalOptions())
    for seq, evs in records:
        if seq == target:
            evs = [CommitFrontiers(e.pool, e.bundles, pack(unpack(e.frontiers) - 1))
                   if isinstance(e, CommitFrontiers) else e for e in evs]
        j.append(evs)
    j.close()
    d = diff(run["journal"], str(other))
    assert d.record == target and d.differences
    same = tmp_path / "same"
    shutil.copytree(run["journal"], same)
    assert diff(run["journal"], str(same)).record is None


def test_inspect_page_history(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = cli_json(capsys, "inspect", run["journal"], "--page", "main:0", "--at", "30")
    assert out["record"] == 30 and set(out["pools"]) == {"main", "mtp"}
    for p in out["pools"].values():
        assert p["allocated"] + p["reserved"] + p["available"] == p["capacity"]
    assert out["page_history"] and out["page_history"][0]["type"] == "mat"
    assert all(h["record"] <= 30 for h in out["page_history"])
    assert out["host_arena"]["capacity"] == 16 << 20
    spaces = cli_json(capsys, "inspect", run["journal"])["address_spaces"]
    assert spaces, "the run retains checkpoints"
    b = spaces[-1]["seq"]
    one = cli_json(capsys, "inspect", run["journal"], "--seq", str(b))
    assert {s["seq"] for s in one["address_spaces"]} == {b}
    assert main(["inspect", run["journal"], "--page", "nonsense"]) == 2


def test_dump_ndjson(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", run["journal"]]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["type"] == "cfg" and lines[0]["seq"] == 1
    assert len(lines) == replay(run["journal"]).events
    assert any(x["type"] == "hpub" and all(c >= 0 for c in x["checksums"]) for x in lines)


def test_dump_prints_metadata_as_the_value_it_encodes(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Review finding: ``dump`` read every bytes field as packed int32s, metadata included: a
    journal holding metadata of 13 encoded bytes was refused as unappliable, one of 12 bytes
    printed as meaningless integers. Metadata prints as what ``checkpoint_info`` returns; a
    clear as null; bytes that are no msgpack (a foreign record) as hex."""
    from tests.engine.conftest import small_config

    s = KVStore.open(small_config(tmp_path, allocate_planes=False))
    a, b = s.activate(10, 5), s.activate(10, 5)
    s.set_metadata(a, {"model": "llama"})                      # 13 bytes of msgpack
    s.set_metadata(b, {"tokens": [1, 2, 3]})                   # 12 bytes
    s.set_metadata(b, None)
    with s.boundary():
        pass
    s.close()
    journal = str(tmp_path / "journal")
    assert main(["dump", journal]) == 0
    metas = [json.loads(x)["meta"] for x in capsys.readouterr().out.splitlines()
             if json.loads(x)["type"] == "meta"]
    assert metas == [{"model": "llama"}, {"tokens": [1, 2, 3]}, None]
    assert metadata_jsonable(b"\xc1") == {"msgpack_hex": "c1"}  # 0xc1: never used by msgpack
    for odd in (b"\x00\x01", float("nan"), {1: "a"}):  # what JSON would not give back (review)
        raw = msgspec.msgpack.encode(odd)
        assert metadata_jsonable(raw) == {"msgpack_hex": raw.hex()}


def test_every_bytes_field_of_every_event_is_declared() -> None:
    """``to_jsonable`` reads a bytes field as a packed array of its declared type, or as
    metadata: a new bytes field must say which (else a KeyError in every dump)."""
    fields = {f.name for cls in Event.__args__ for f in msgspec.structs.fields(cls)
              if f.type is bytes}
    assert fields == set(PACKED_FIELDS) | OPAQUE_FIELDS
    assert not set(PACKED_FIELDS) & OPAQUE_FIELDS


def test_events_stream(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from ninfer_kv.tools.journal_cmds import block_hash

    assert main(["events", run["journal"], "--json"]) == 0
    items = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    kinds = {i["type"] for i in items}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert {i["medium"] for i in items if i["type"] == "BlockStored"} == {"GPU", "CPU"}
    assert all(i["reason"] for i in items if i["type"] == "BlockRemoved")
    left = balanced(items)  # a router that follows the stream ends with the live checkpoints
    st = replay(run["journal"]).state
    want = {(m, block_hash(n, pg.slot, pg.gen)) for n, p in st.pools.items() for pg in p.pages
            if pg is not None and pg.refs > pg.active_refs
            for m, on in (("GPU", pg.device != -1), ("CPU", pg.host is not None)) if on}
    assert set(left) == want
    assert main(["events", run["journal"]]) == 0 and "KV events" in capsys.readouterr().out


def test_plot_png_and_data(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    png = run["dir"] / "t.png"
    out = cli_json(capsys, "plot", run["journal"], "-o", str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 1000 and int.from_bytes(data[20:24], "big") == 600
    n = len(out["record"])
    assert n > 10 and out["record"] == sorted(out["record"])
    for series in (*[v for p in out["pools"].values() for v in p.values()], out["host_used"]):
        assert len(series) == n and all(0.0 <= x <= 1.0 for x in series)
    assert out["prefix_hit_ratio"][-1] == pytest.approx(run["res"].hit_ratio, abs=1e-9)
    assert max(out["pools"]["main"]["used"]) == pytest.approx(run["res"].peak_occupancy, abs=0.05)


def test_simulate_cli_500_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tools.benchmarks_ideal import ideal_hit_ratio

    out = cli_json(capsys, "simulate", "--trace", str(DEFAULT_TRACE), "--limit", "500",
                   "--journal", str(tmp_path / "j"))
    for key in ("requests", "prompt_tokens", "prefix_hit_tokens", "us_per_request_step",
                "journal_bytes", "digest"):
        assert key in out
    reqs = load_trace(DEFAULT_TRACE, 500)
    ideal = ideal_hit_ratio(reqs)
    assert 0.5 * ideal <= out["prefix_hit_ratio"] <= ideal + 1e-9  # in line with the trace
    # the simulator's own ideal applies the same rule to the requests it admitted (skipped
    # ones are not counted): at least what it achieved, about the trace's
    assert out["prefix_hit_ratio"] <= out["ideal_hit_ratio"] <= ideal * 1.05
    assert out["swaps"] == 0                                # no preemption yet
    assert out["journal_bytes"] > 0
    assert replay(str(tmp_path / "j")).digest == out["digest"]


def test_simulate_counts_refused_admissions() -> None:
    """An admission that nothing can make room for (running requests hold the pages) is
    counted; with room for everything, none is."""
    reqs = load_trace(DEFAULT_TRACE, 60)
    _, tight = simulate(reqs, SimOptions(max_context=8192, kv_tokens=8192, scale=4))
    _, roomy = simulate(reqs, SimOptions(max_context=8192, kv_tokens=8192 * 32, scale=4))
    assert tight.refused_admissions > 0 and roomy.refused_admissions == 0
    assert tight.requests == roomy.requests                 # refused means later, not never


def test_demo_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = cli_json(capsys, "demo", "--out", str(tmp_path / "demo"), "--requests", "25")
    assert out["replay_digest"] == out["live_digest"] and out["kernel_ok"]
    assert out["replay_violations"] == 0 and Path(out["plot"]).exists()
    assert out["d2h_pages"] > 0


def test_reopen_after_simulation(run: dict) -> None:
    """The journal a simulation leaves reopens cleanly (actives aborted, invariants hold)."""
    opts = SimOptions(max_concurrency=6, max_context=8192, kv_tokens=24576, layers=1,
                      kv_heads=1, head_dim=64, mtp=True, offload=True, host_bytes=16 << 20,
                      journal_dir=str(run["dir"] / "copy"), allocate_planes=False)
    shutil.copytree(run["journal"], run["dir"] / "copy")
    s: KVStore = make_store(opts)
    s.check_invariants()
    s.close()


def test_kv_events_follow_each_medium_of_a_host_only_checkpoint(tmp_path) -> None:  # noqa: ANN001
    """A checkpoint demoted to the host and then released was reported removed from the GPU a
    second time and never from the CPU; a dropped host replica was not reported at all. Every
    block is now removed from each medium it was stored on, once."""
    from ninfer_kv.tools.journal_cmds import kv_events
    from tests.engine.test_continuation import checkpoint_at, step, write_tokens
    from tests.engine.test_host_tier import host_store

    s = host_store(tmp_path)
    a, b, c = checkpoint_at(s, 150), checkpoint_at(s, 100), checkpoint_at(s, 100)
    s.offload(a, drop_device=True)     # a: GPU -> CPU only
    s.offload(b)                       # b: on both
    s.offload(c)
    step(s)
    s.drop_host(b)                     # b: GPU only again
    # c is continued exclusively (its pages leave the cache), its tail page is written
    # again, and it is retained and offloaded anew: the stale host replica is replaced
    c2 = s.activate_from(c, 100, 100, 50, keep_source=False)
    s.ensure_mapped(c2, "main", 120)
    step(s)
    write_tokens(s, c2, "main", 100, 120)
    s.commit(c2, "main", 120)
    c3 = s.finish(c2, retain=True)
    step(s)
    assert c3 is not None and s.offload(c3) >= 1
    step(s)
    for ck in (a, b, c3):
        s.release(ck)
    step(s)
    s.close()
    items = list(kv_events(str(tmp_path / "persist" / "journal")))
    assert balanced(items) == {}          # everything stored was removed
    reasons = {i["reason"] for i in items if i["type"] == "BlockRemoved"}
    assert {"demoted-to-host", "host-dropped", "moved-to-active", "evicted"} <= reasons
    assert {i["medium"] for i in items if i["type"] == "BlockRemoved"} == {"GPU", "CPU"}


def balanced(items: list[dict]) -> dict[tuple[str, str], int]:
    """Replay a KV-event stream as a router would; every removal must follow a store of the
    same block on the same medium, and no block is stored twice. Returns what stays stored."""
    seen: dict[tuple[str, str], int] = {}
    for item in items:
        if item["type"] == "AllBlocksCleared":
            seen = {k: v for k, v in seen.items() if k[0] != item["medium"]}
            continue
        if item["type"] not in ("BlockStored", "BlockRemoved"):
            continue
        for h in item["block_hashes"]:
            key = (item["medium"], h)
            seen[key] = seen.get(key, 0) + (1 if item["type"] == "BlockStored" else -1)
            assert seen[key] in (0, 1), f"{item['type']} of {h} on {item['medium']} twice"
            if not seen[key]:
                del seen[key]
    return seen


def test_replay_of_an_open_reader_keeps_its_salvage_setting(run: dict) -> None:
    """``replay(reader)`` replays the reader's own scan: asking it to salvage what that scan
    did not is refused, not silently ignored; the same journal by path or reader agrees."""
    reader = JournalReader(run["journal"])
    with pytest.raises(JournalError, match="salvage"):
        replay(reader, salvage=True)
    assert replay(reader).digest == replay(run["journal"]).digest == run["live"]


def test_inspect_marks_what_it_leaves_out(run: dict, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A clipped history field ends in an ellipsis, and an address-space table cut short
    says how many rows it left out (both used to be cut silently)."""
    from ninfer_kv.tools import journal_cmds
    assert journal_cmds.clip("abcdef", 6) == "abcdef" and journal_cmds.clip("abcdefg", 6) == "abcde…"
    spaces = cli_json(capsys, "inspect", run["journal"])["address_spaces"]
    monkeypatch.setattr(journal_cmds, "MAX_ROWS", len(spaces) - 1)
    monkeypatch.setattr(journal_cmds, "MAX_FIELD", 20)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", run["journal"], "--page", "main:0", "--at", "30"]) == 0
    text = capsys.readouterr().out
    assert "…" in text  # a Materialize's fields are longer than 20 characters
    assert main(["inspect", run["journal"]]) == 0
    text = capsys.readouterr().out
    assert f"the first {len(spaces) - 1} of {len(spaces)} shown" in text
