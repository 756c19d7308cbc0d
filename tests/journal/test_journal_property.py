"""Property: random batches, snapshots and crash points -> recovered state equals a reference
model's state at the recovered record, and nothing durable is lost."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.journal.events import CODEC, CommitFrontiers, pack, unpack
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy
from ninfer_kv.journal.restore import recover_state
from tests.journal.crashfs import CrashFS

D = "/p"


class Model(msgspec.Struct):
    frontiers: dict[int, int] = {}
    records: int = 0


def apply_events(m: Model, events: list) -> None:
    for ev in events:
        for b, f in zip(unpack(ev.bundles).tolist(), unpack(ev.frontiers).tolist(), strict=True):
            m.frontiers[b] = m.frontiers.get(b, 0) + f
    m.records += 1


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(st.lists(st.tuples(st.integers(0, 20),
                                                             st.integers(0, 1000)),
                                                   max_size=8), min_size=1, max_size=3)),
    st.tuples(st.just("snapshot"), st.none()),
    st.tuples(st.just("sync"), st.none())), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(list(SyncPolicy)), st.integers(0, 2**32), st.sampled_from([300, 4096]))
def test_recovered_state_matches_model(script, policy, seed, seg_bytes) -> None:
    fs = CrashFS()
    j = Journal.open(D, CODEC, JournalOptions(sync=policy, interval_ms=0.5, segment_bytes=seg_bytes),
                     fs=fs)
    history = [Model()]  # history[k] = model state after record k
    for kind, arg in ops_iter(script):
        if kind == "append":
            events = [CommitFrontiers("main", pack([b for b, _ in pairs]), pack([f for _, f in pairs]))
                      for pairs in arg]
            j.append(events)
            m = msgspec.convert(msgspec.to_builtins(history[-1]), Model)
            apply_events(m, events)
            history.append(m)
        elif kind == "snapshot":
            j.write_snapshot(msgspec.msgpack.encode(history[-1]))
        else:
            j.sync()
    durable = j.durable_seq
    img = fs.crash(random.Random(seed))

    def apply_record(state: Model, seq: int, payload) -> None:
        apply_events(state, CODEC.decode(payload))

    state, last, _ = recover_state(D, schema_major=1, initial=Model,
                                   load_snapshot=lambda b: msgspec.msgpack.decode(b, type=Model),
                                   apply_record=apply_record, fs=img)
    assert durable <= last < len(history)
    assert state == history[last]


def ops_iter(script):
    yield from script
