"""Hypothesis state machine over the public API: invariants after every step; at the end of
every run the replay of the journal reaches the live digest. Refused commands must leave the
digest unchanged."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config


class StoreMachine(RuleBasedStateMachine):
    backend = Backend.OFF

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp())
        self.store = KVStore.open(small_config(self.dir, pages=48, concurrency=5, context=1024,
                                               backend=self.backend))
        self.steps = 0

    def teardown(self) -> None:
        self.store.close()  # publishes what is pending (and releases copy pins)
        live = self.store.digest()
        r = replay(str(self.dir / "journal"))
        assert r.digest == live, "replay digest differs from live"
        assert not r.violations
        shutil.rmtree(self.dir, ignore_errors=True)
        StoreMachine.total_steps += self.steps

    total_steps = 0
    done: dict[str, int] = {}

    def attempt(self, fn, *args, **kw):
        """Run a command; a refusal must be typed and leave the digest unchanged."""
        before = self.store.digest()
        try:
            out = fn(*args, **kw)
            StoreMachine.done[fn.__name__] = StoreMachine.done.get(fn.__name__, 0) + 1
            return True if out is None else out
        except KVStoreError:
            assert self.store.digest() == before, f"{fn.__name__} changed state, then refused"
            return None

    @property
    def actives(self) -> list[int]:
        return sorted(self.store.active())

    @property
    def checkpoints(self) -> list[int]:
        return sorted(self.store.checkpoints())

    @rule(prompt=st.integers(1, 600), out=st.integers(0, 400))
    def activate(self, prompt: int, out: int) -> None:
        self.attempt(self.store.activate, prompt, out)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), grow=st.integers(-10, 200))
    def ensure_mapped(self, data, grow: int) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.actives), min_size=1, max_size=4,
                                  unique=True))
        for pool in self.store.pools:
            tokens = [max(0, self.store.space(b, pool).committed + grow) for b in seqs]
            n = self.attempt(self.store.ensure_mapped_many, pool, seqs, tokens)
            if n is not None:
                for b, t in zip(seqs, tokens, strict=True):
                    assert len(self.store.space(b, pool).members) * P >= t

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), adv=st.integers(-3, 130))
    def commit(self, data, adv: int) -> None:
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.store.pools:
            sp = self.store.space(b, pool)
            f = min(sp.committed + adv, len(sp.members) * P) if adv >= 0 else sp.committed + adv
            if self.attempt(self.store.commit, b, pool, f) is not None or adv < 0:
                continue
            assert self.store.space(b, pool).committed == f

    @precondition(lambda self: self.store.active())
    @rule(tokens=st.integers(1, 70))
    def decode_round(self, tokens: int) -> None:
        """The hot path: map, publish, commit every active sequence in every pool."""
        seqs = self.actives
        for pool in self.store.pools:
            want = [self.store.space(b, pool).committed + tokens for b in seqs]
            self.attempt(self.store.ensure_mapped_many, pool, seqs, want)
        with self.store.boundary():
            pass
        for pool in self.store.pools:
            sps = [self.store.space(b, pool) for b in seqs]
            ok = [(b, min(sp.committed + tokens, len(sp.members) * P)) for b, sp in zip(
                seqs, sps, strict=True)]
            self.attempt(self.store.commit_many, pool, [b for b, _ in ok], [f for _, f in ok])

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), lead=st.integers(0, 70))
    def provisional_then_trim(self, data, lead: int) -> None:
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.store.pools:
            sp = self.store.space(b, pool)
            self.attempt(self.store.set_provisional, b, pool, min(sp.committed + lead,
                                                                   len(sp.members) * P))
            self.attempt(self.store.trim, b, pool)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), back=st.integers(0, 100))
    def truncate(self, data, back: int) -> None:
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.store.pools:
            sp = self.store.space(b, pool)
            self.attempt(self.store.truncate, b, pool, max(0, sp.committed - back))

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), retain=st.booleans())
    def finish(self, data, retain: bool) -> None:
        b = data.draw(st.sampled_from(self.actives))
        self.attempt(self.store.finish, b, retain=retain)

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data())
    def release(self, data) -> None:
        self.attempt(self.store.release, data.draw(st.sampled_from(self.checkpoints)))

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data(), frac=st.floats(0, 1), extra=st.integers(0, 300),
          keep=st.booleans(), mode=st.sampled_from(["auto", "auto", "fork", "move"]))
    def activate_from(self, data, frac: float, extra: int, keep: bool, mode: str) -> None:
        ck = data.draw(st.sampled_from(self.checkpoints))
        frontiers = {p: int(self.store.space(ck, p).committed * frac) for p in self.store.pools}
        prompt = max(frontiers.values()) + extra
        self.attempt(self.store.activate_from, ck, frontiers, prompt, 50, keep_source=keep,
                     mode=mode)

    @rule()
    def boundary(self) -> None:
        with self.store.boundary():
            pass

    @invariant()
    def invariants_hold(self) -> None:
        self.steps += 1
        self.store.check_invariants()


class MtpMachine(StoreMachine):
    backend = Backend.MTP


class DflashMachine(StoreMachine):
    backend = Backend.DFLASH


@pytest.mark.parametrize("machine,examples", [(StoreMachine, 100), (MtpMachine, 40),
                                              (DflashMachine, 40)])
def test_store_machine(machine: type[StoreMachine], examples: int) -> None:
    """At least 2,000 steps per machine, and every command kind really executed."""
    StoreMachine.total_steps = 0
    StoreMachine.done = {}
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=50, deadline=None))
    assert StoreMachine.total_steps >= 1500, StoreMachine.total_steps
    every = ("activate", "ensure_mapped_many", "commit", "commit_many", "set_provisional",
             "trim", "truncate", "finish", "release", "activate_from")
    # the shorter backend runs must at least drive the multi-pool hot path
    for cmd in every if machine is StoreMachine else every[:5]:
        assert StoreMachine.done.get(cmd, 0) >= 1, (cmd, StoreMachine.done)

if __name__ == "__main__":
    test_store_machine(StoreMachine, 100)
    print(StoreMachine.total_steps, StoreMachine.done)
