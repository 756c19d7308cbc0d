"""Digests pinned across code versions (issue #12): a redesign of the control plane must give
the same events for the same commands and the same state for the same events — or the journal
schema bumps, with the reason in the commit.

The constants were produced by the code before the decode round's fused kernels (commit
6ab635a) with ``ninfer-kv simulate --scale 16 --limit 300 --kv-tokens 32768 --max-context
8192 --max-concurrency 16 [flags]``: 300 Mooncake requests under memory pressure, so the
journals hold Forks with COW tails, pins, releases, trims, shares, offloads and device drops.
``data/golden/sim-mtp-share`` is the journal of the ``--mtp --share`` run, written by that
code. A change that moves one of these digests changes what a journal means: bump
``journal.events.SCHEMA`` and regenerate them, saying why.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest

from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay
from ninfer_kv.tools.sim_data import DEFAULT_TRACE, SimOptions, load_trace
from ninfer_kv.tools.simulate import simulate

DATA = Path(__file__).resolve().parent.parent / "data" / "golden"

CASES = {
    "plain": ({}, "2e54163dee868b6322aa699a0bbd072c"),
    # 482d21dd... before a demotion kept the prefix a victim shares with checkpoints not
    # demoted (the retention policy's commands changed: prefix hits 6,816 -> 7,712 tokens)
    "offload": ({"offload": True, "host_bytes": 8 << 20}, "c870bed4ca3a9bf62f0de50cff472538"),
    "mtp-share": ({"mtp": True, "share": True}, "61ea1665d582150f01bba11e9d9b7348"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_same_commands_give_the_pinned_digest(name: str) -> None:
    extra, want = CASES[name]
    opts = SimOptions(max_concurrency=16, max_context=8192, kv_tokens=32768, scale=16, **extra)
    store, _ = simulate(load_trace(DEFAULT_TRACE, 300), opts)
    try:
        assert store.digest() == want
    finally:
        store.close()


def test_the_pinned_journal_replays_to_its_digest(tmp_path: Path) -> None:
    """An old journal, replayed by today's apply: the same state, every §14 rule holding."""
    journal = tmp_path / "journal"
    shutil.copytree(DATA / "sim-mtp-share", journal)
    kinds = collections.Counter(type(e).__name__ for _, events in
                                JournalReader(str(journal)).records(1) for e in events)
    # what the fixture exercises (a regenerated one must still hold these)
    assert {"Fork", "CopyTail", "Pin", "Unpin", "Release", "Share", "Trim"} <= set(kinds)
    res = replay(str(journal), verify_every=1)
    assert res.digest == CASES["mtp-share"][1]
    assert replay(str(journal)).digest == res.digest  # plain: runs in compiled calls
    assert res.events == sum(kinds.values()) == 6177
    assert not res.violations
