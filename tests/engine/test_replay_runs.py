"""Runs of CommitFrontiers across records, the decode rounds of a journal: plain replay
(``apply_record``) and verified replay (event by event, with the checkers) reach the same
state, and a refused commit is named by record and event. Written for a replay that applied
a run as one combined event (measured: ~10% of plain replay, not kept); they hold any such
batching to these rules: a run is one pool's, and each event's fields are checked on their
own — a concatenation can pair off two wrong lengths into a valid-looking event."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import UnappliableRecord
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import running, step


def commit(seq: int, f: int, pool: str = "main") -> ev.CommitFrontiers:
    return ev.CommitFrontiers(pool, pack([seq]), pack([f]))


def journal_with(tmp_path: Path, records: list[list[object]]) -> tuple[str, list[int]]:
    """A store with running sequences 1 (100 tokens committed, 2 pages) and 2 (30 tokens,
    1 page), then ``records`` appended raw; returns the directory and the records' seqs."""
    s = KVStore.open(small_config(tmp_path, backend=Backend.MTP))  # pools main and mtp
    a, b = running(s, 100), running(s, 30)
    step(s)  # the commits are journaled at the boundary: before the raw records
    assert (a, b) == (1, 2) and s.journal is not None
    seqs = [s.journal.append(r, durable=True) for r in records]
    s.close()
    return str(tmp_path / "journal"), seqs


def test_runs_give_the_state_of_event_by_event(tmp_path: Path) -> None:
    """Commits of the same seq in consecutive records, and two in one record, then a
    commits of another pool between them (a run is one pool's): plain replay (runs) and
    verified replay (each event on its own) agree."""
    d, _ = journal_with(tmp_path, [[commit(1, 110)], [commit(2, 40), commit(1, 120)],
                                   [commit(1, 125), commit(1, 128)], [commit(2, 45)],
                                   [commit(2, 50)], [commit(2, 60, "mtp")],
                                   [commit(2, 64, "mtp")]])
    plain, checked = replay(d), replay(d, verify_every=1)
    assert plain.digest == checked.digest and not checked.violations
    assert plain.events == checked.events
    main, mtp = plain.state.pools["main"], plain.state.pools["mtp"]
    assert (main.spaces[1].committed, main.spaces[2].committed) == (128, 50)
    assert mtp.spaces[2].committed == 64


def test_a_refusal_in_a_run_names_its_record(tmp_path: Path) -> None:
    """The third commit of a run moves a frontier backwards: the combined event is refused
    whole and the run replayed event by event names record and event."""
    d, seqs = journal_with(tmp_path, [[commit(1, 110)], [commit(2, 40)],
                                      [commit(2, 50), commit(1, 105)], [commit(1, 120)]])
    with pytest.raises(UnappliableRecord, match="CommitFrontiers") as got:
        replay(d)
    assert (got.value.seq, got.value.index) == (seqs[2], 1)


PAIR_OFF = {
    "counts": [ev.CommitFrontiers("main", pack([1, 2]), pack([110])),
               ev.CommitFrontiers("main", pack([2]), pack([40, 50]))],
    "halves": [ev.CommitFrontiers("main", pack([1]) + b"\x02\x00", pack([110]) + b"\x28\x00"),
               ev.CommitFrontiers("main", b"\x00\x00", b"\x00\x00")],
}


@pytest.mark.parametrize("case", sorted(PAIR_OFF))
def test_lengths_that_pair_off_are_refused(tmp_path: Path, case: str) -> None:
    """Fields of different int32 counts, or of a length no int32 count has, that pair off
    when concatenated: the run would apply (seq 1 to 110, seq 2 to 40 [then 50]). Each
    event is refused on its own, and so is the run."""
    d, seqs = journal_with(tmp_path, [[e] for e in PAIR_OFF[case]])
    with pytest.raises(UnappliableRecord, match="bytes of seqs") as got:
        replay(d)
    assert (got.value.seq, got.value.index) == (seqs[0], 0)
