"""The test of record: a hypothesis state machine over every public command of the store, with
a shadow model of which write round wrote each committed token.

Each step runs one command (refusals must be typed and leave the digest unchanged); after
every step the §14 invariants are checked; the payload of every committed token of every
sequence and checkpoint is compared with the model after boundaries (every few), after every
reopen and at the end. Between any two steps the machine may close and reopen the store, or
*crash* it (``kill -9``: file descriptors closed, nothing pending published) and reopen: then
every checkpoint the store had reported durable (published host replicas at a completed
boundary) and that was not being removed must come back, with the model's bytes. At the end
the journal replays to the live digest, with no violation.

Knobs: ``NINFER_KV_MACHINE_EXAMPLES=k`` runs k times the CI budget of examples with fresh
random seeds (the CI run, k=1, is derandomized so that it is reproducible and its coverage
assertion never flakes); ``NINFER_KV_MACHINE_STEPS`` sets the steps per example (60).

    NINFER_KV_MACHINE_EXAMPLES=20 .venv/bin/python -m pytest tests/engine/test_state_machine.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.continuation import unrecoverable_reason
from ninfer_kv.engine.host import replica_valid
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError
from ninfer_kv.replay import replay
from tests.engine import shadow
from tests.engine.conftest import crash, small_config

SCALE = max(1, int(os.environ.get("NINFER_KV_MACHINE_EXAMPLES", "1")))
STEPS = int(os.environ.get("NINFER_KV_MACHINE_STEPS", "60"))


class StoreMachine(RuleBasedStateMachine):
    backend = Backend.OFF
    total_steps = 0
    done: dict[str, int] = {}
    reopened = 0

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ninfer-kv-sm-"))
        self.config = small_config(None, pages=48, concurrency=5, context=1024,
                                   backend=self.backend, host_bytes=3 << 20,
                                   persist_dir=str(self.dir / "persist"), checked=True,
                                   segment_bytes=16 << 10)
        self.store = KVStore.open(self.config)
        self.content: dict[tuple[int, str], list[int]] = {}  # (seq, pool) -> tag per token
        self.tag = 0
        self.acked: set[int] = set()     # checkpoints the store reported durable
        self.doomed: set[int] = set()    # a removal was asked: may or may not survive a crash
        self.offloaded: set[int] = set()  # offload asked since the last boundary
        self.boundaries = 0
        self.steps = 0
        self.last_reopen = self.last_snapshot = 0

    def teardown(self) -> None:
        self.boundary_now()  # queued copies run at a boundary; then every byte is in place
        self.check_contents()
        self.store.close()
        live = self.store.digest()
        r = replay(str(self.dir / "persist" / "journal"), verify_every=1)
        assert r.digest == live, "replay digest differs from live"
        assert not r.violations, r.violations[:2]
        plain = replay(str(self.dir / "persist" / "journal"))  # runs in compiled calls
        assert plain.digest == live and plain.events == r.events, "plain replay differs"
        shutil.rmtree(self.dir, ignore_errors=True)
        StoreMachine.total_steps += self.steps

    # --- helpers ---------------------------------------------------------------------------------
    def attempt(self, name: str, fn, *args, **kw):  # noqa: ANN001, ANN202
        """Run a command; a refusal must be typed and leave the digest unchanged."""
        before = self.store.digest()
        try:
            out = fn(*args, **kw)
        except KVStoreError:
            assert self.store.digest() == before, f"{name} changed state, then refused"
            return None
        StoreMachine.done[name] = StoreMachine.done.get(name, 0) + 1
        return True if out is None else out

    @property
    def pools(self) -> tuple[str, ...]:
        return self.store.pools

    @property
    def actives(self) -> list[int]:
        return sorted(self.store.active())

    @property
    def checkpoints(self) -> list[int]:
        return sorted(self.store.checkpoints())

    def boundary_now(self) -> None:
        with self.store.boundary():
            pass
        self.boundaries += 1
        for ck in self.offloaded:
            if ck in self.store.state.bundles and not self.store.state.bundles[ck].active \
                    and unrecoverable_reason(self.store.state, ck) is None:
                self.acked.add(ck)
        self.offloaded.clear()
        if self.boundaries % 7 == 0:
            self.check_contents()

    def check_contents(self) -> None:
        bad: list[str] = []
        for b in self.store.state.bundles:
            for pool in self.store.state.bundles[b].pools:
                bad.extend(shadow.mismatches(self.store, b, pool, self.content[(b, pool)]))
        assert not bad, bad[:5]

    def write_and_commit(self, seqs: list[int], tokens: int) -> None:
        """One GPU unit over ``seqs``: map, boundary, write a new round's payload, commit."""
        want: dict[str, dict[int, int]] = {}
        for pool in self.pools:
            plan = {}
            for b in seqs:
                sp = self.store.space(b, pool)
                room = min(sp.entitlement, sp.committed // P + 64) * P
                n = min(tokens, max(0, min(room, self.store.plan.L * P) - sp.committed))
                plan[b] = sp.committed + n
            if self.attempt("ensure_mapped_many", self.store.ensure_mapped_many, pool,
                            list(plan), list(plan.values())) is None:
                return
            want[pool] = plan
        self.boundary_now()
        self.tag += 1
        for pool, plan in want.items():
            for b, f in plan.items():
                old = self.store.space(b, pool).committed
                shadow.write(self.store, b, pool, old, [self.tag] * (f - old))
            if self.attempt("commit_many", self.store.commit_many, pool, list(plan),
                            list(plan.values())) is not None:
                for b, f in plan.items():
                    c = self.content[(b, pool)]
                    c.extend([self.tag] * (f - len(c)))

    def reopened_store(self, crashed: bool) -> None:
        must_survive = self.acked - self.doomed
        if crashed:
            crash(self.store)
        else:
            self.store.close()
        self.store = KVStore.open(self.config)
        StoreMachine.reopened += 1
        st_ = self.store.state
        lost = sorted(ck for ck in must_survive if ck not in st_.bundles)
        assert not lost, (lost, self.store.recovery.dropped)
        assert not self.store.active()
        for key in [k for k in self.content if k[0] not in st_.bundles]:
            del self.content[key]  # aborted, released, or never journaled (its id is reused)
        self.acked &= set(st_.bundles)
        self.doomed &= set(st_.bundles)
        self.offloaded.clear()
        self.check_contents()

    # --- rules -----------------------------------------------------------------------------------
    @rule(prompt=st.integers(1, 500), out=st.integers(0, 300))
    def activate(self, prompt: int, out: int) -> None:
        b = self.attempt("activate", self.store.activate, prompt, out)
        if b is not None:
            for pool in self.pools:
                self.content[(b, pool)] = []

    @precondition(lambda self: self.store.active())
    @rule(tokens=st.sampled_from([1, 1, 3, 17, 64, 130]))
    def decode_round(self, tokens: int) -> None:
        self.write_and_commit(self.actives, tokens)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), tokens=st.integers(1, 200))
    def prefill_one(self, data, tokens: int) -> None:  # noqa: ANN001
        self.write_and_commit([data.draw(st.sampled_from(self.actives))], tokens)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), ahead=st.integers(0, 150))
    def map_ahead(self, data, ahead: int) -> None:  # noqa: ANN001
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.pools:
            self.attempt("ensure_mapped", self.store.ensure_mapped, b, pool,
                         self.store.space(b, pool).committed + ahead)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), lead=st.integers(0, 70))
    def speculate_then_trim(self, data, lead: int) -> None:  # noqa: ANN001
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.pools:
            sp = self.store.space(b, pool)
            self.attempt("set_provisional", self.store.set_provisional, b, pool,
                         min(sp.committed + lead, len(sp.members) * P))
            self.attempt("trim", self.store.trim, b, pool)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), back=st.integers(0, 100))
    def truncate(self, data, back: int) -> None:  # noqa: ANN001
        b = data.draw(st.sampled_from(self.actives))
        for pool in self.pools:
            f = max(0, self.store.space(b, pool).committed - back)
            if self.attempt("truncate", self.store.truncate, b, pool, f) is not None:
                del self.content[(b, pool)][f:]

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), retain=st.booleans())
    def finish(self, data, retain: bool) -> None:  # noqa: ANN001
        self.attempt("finish", self.store.finish, data.draw(st.sampled_from(self.actives)),
                     retain=retain)

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data())
    def release(self, data) -> None:  # noqa: ANN001
        ck = data.draw(st.sampled_from(self.checkpoints))
        if self.attempt("release", self.store.release, ck) is not None:
            self.doomed.add(ck)

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data(), frac=st.floats(0, 1), extra=st.integers(0, 200),
          keep=st.booleans(), mode=st.sampled_from(["auto", "auto", "fork", "move"]),
          per_pool=st.booleans())
    def activate_from(self, data, frac: float, extra: int, keep: bool, mode: str,  # noqa: ANN001
                      per_pool: bool) -> None:
        ck = data.draw(st.sampled_from(self.checkpoints))
        committed = {p: self.store.space(ck, p).committed for p in self.pools}
        if per_pool:
            fr: int | dict[str, int] = {p: int(c * frac) for p, c in committed.items()}
        else:
            fr = int(min(committed.values()) * frac)
        top = max(fr.values()) if isinstance(fr, dict) else fr
        dst = self.attempt("activate_from", self.store.activate_from, ck, fr, top + extra, 60,
                           keep_source=keep, mode=mode)
        if dst is None:
            return
        for p in self.pools:
            f = fr[p] if isinstance(fr, dict) else fr
            self.content[(dst, p)] = self.content[(ck, p)][:f]
        if not keep:
            self.doomed.add(ck)

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), frac=st.floats(0, 1), keep=st.booleans(), host_only=st.booleans(),
          mode=st.sampled_from(["auto", "move"]))
    def next_turn(self, data, frac: float, keep: bool, host_only: bool,  # noqa: ANN001
                  mode: str) -> None:
        """The multi-turn pattern: finish retained, (demote to host), continue at a frontier."""
        ck = self.attempt("finish", self.store.finish, data.draw(st.sampled_from(self.actives)),
                          retain=True)
        if ck is None:
            return
        if host_only and self.attempt("offload", self.store.offload, ck,
                                      drop_device=True) is not None:
            self.offloaded.add(ck)
            self.boundary_now()
        f = int(min(self.store.space(ck, p).committed for p in self.pools) * frac)
        dst = self.attempt("activate_from", self.store.activate_from, ck, f, f + 32, 60,
                           keep_source=keep, mode=mode if not keep else "auto")
        if dst is not None:
            for p in self.pools:
                self.content[(dst, p)] = self.content[(ck, p)][:f]
            if not keep:
                self.doomed.add(ck)
            if host_only and any(type(e).__name__ == "DeviceRestore" for e in self.store._effects):
                kind = "continue_host_only_" + ("move" if ck not in self.store.state.bundles
                                                else "fork")
                StoreMachine.done[kind] = StoreMachine.done.get(kind, 0) + 1

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data(), drop=st.booleans())
    def offload(self, data, drop: bool) -> None:  # noqa: ANN001
        ck = data.draw(st.sampled_from(self.checkpoints))
        if self.attempt("offload", self.store.offload, ck, drop_device=drop) is not None:
            self.offloaded.add(ck)

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data())
    def drop_device(self, data) -> None:  # noqa: ANN001
        self.attempt("drop_device", self.store.drop_device,
                     data.draw(st.sampled_from(self.checkpoints)))

    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data())
    def drop_host(self, data) -> None:  # noqa: ANN001
        ck = data.draw(st.sampled_from(self.checkpoints))
        survivors = self.survivors()
        if self.attempt("drop_host", self.store.drop_host, ck) is not None:
            self.doomed.add(ck)
            lost = sorted(survivors - self.survivors() - {ck})
            assert not lost, f"drop_host({ck}) took restart survival from {lost}"

    def survivors(self) -> set[int]:
        """The checkpoints a reopen now would keep."""
        return {c for c in self.checkpoints if self.store.checkpoint_info(c).survives_restart}

    @precondition(lambda self: self.store.active())
    @rule(step_tokens=st.integers(1, 8))
    def grow(self, step_tokens: int) -> None:
        self.attempt("grow", self.store.grow, step_tokens)

    @rule()
    def boundary(self) -> None:
        self.boundary_now()
        StoreMachine.done["boundary"] = StoreMachine.done.get("boundary", 0) + 1

    @precondition(lambda self: self.steps - self.last_snapshot >= 6)
    @rule(compact=st.booleans())
    def snapshot(self, compact: bool) -> None:
        self.last_snapshot = self.steps
        self.attempt("snapshot", self.store.snapshot)
        if compact:
            self.attempt("compact", self.store.compact)

    @precondition(lambda self: self.steps - self.last_reopen >= 15)
    @rule(crashed=st.booleans())
    def reopen(self, crashed: bool) -> None:
        self.last_reopen = self.steps
        self.reopened_store(crashed)
        StoreMachine.done["crash" if crashed else "reopen"] = \
            StoreMachine.done.get("crash" if crashed else "reopen", 0) + 1

    @invariant()
    def invariants_hold(self) -> None:
        self.steps += 1
        self.store.check_invariants()
        self.residency_is_the_pages()

    def residency_is_the_pages(self) -> None:
        """checkpoint_info's array counts (a retention policy's input) equal a count over the
        page views with the §5.1 rule, and survives_restart is restart's rule."""
        st = self.store.state
        for b, bundle in st.bundles.items():
            info = self.store.checkpoint_info(b)
            for pool, r in info.pools.items():
                pages = [st.pools[pool].pages[s] for s in st.pools[pool].spaces[b].members]
                dev = sum(pg.device != NO_PAGE for pg in pages)
                hst = sum(replica_valid(pg, pg.committed) for pg in pages)
                sole = sum(pg.device != NO_PAGE and pg.refs == 1 for pg in pages)
                idle = sum(pg.device != NO_PAGE and pg.active_refs == 0 for pg in pages)
                sole_host = sum(pg.host is not None and pg.refs == 1 for pg in pages)
                assert (r.pages, r.device_pages, r.host_pages, r.sole_device_pages,
                        r.idle_device_pages, r.sole_host_pages) == (
                            len(pages), dev, hst, sole, idle, sole_host), (b, pool)
            survives = (self.store._journaled and not bundle.active
                        and unrecoverable_reason(st, b) is None
                        and (st.host_persistent == 1
                             or all(r.pages == 0 for r in info.pools.values())))
            if self.store._pending or self.store._unjournaled:  # what made it survive may not be
                assert survives or not info.survives_restart, b  # journaled: no more than the rule
            else:  # the state is the journal's: restart's rule, exactly
                assert info.survives_restart == survives, b
        cks = self.checkpoints   # what releasing every checkpoint together frees, per checkpoint
        got = self.store.reclaimable(cks) if cks else {}
        for ck in cks:
            want = 0
            for pool in st.bundles[ck].pools:
                p = st.pools[pool]
                held = [s for c in cks if pool in st.bundles[c].pools
                        for s in p.spaces[c].members]
                want += sum(p.pages[s].device != NO_PAGE and held.count(s) == p.pages[s].refs
                            for s in p.spaces[ck].members)
            assert got[ck] == want, (ck, got[ck], want)


class SharingMachine(StoreMachine):
    """The base machine plus live prefix sharing. (A machine of its own: a new rule changes a
    derandomized machine's whole trajectory and the coverage its budget buys.)"""

    def committed(self, b: int) -> int:
        return min(self.store.space(b, p).committed for p in self.pools)

    @precondition(lambda self: any(self.committed(b) >= P for b in self.store.active()))
    @rule(data=st.data(), frac=st.floats(0, 1))
    def share_prefix(self, data, frac: float) -> None:  # noqa: ANN001
        """Live sharing: a running sequence's whole committed pages become a checkpoint."""
        b = data.draw(st.sampled_from([b for b in self.actives if self.committed(b) >= P]))
        f = P + int((self.committed(b) - P) * frac)
        ck = self.attempt("share_prefix", self.store.share_prefix, b, f)
        if ck is not None:
            for p in self.pools:
                self.content[(ck, p)] = self.content[(b, p)][:f // P * P]

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), frac=st.floats(0, 1), extra=st.integers(0, 80))
    def fork_live(self, data, frac: float, extra: int) -> None:  # noqa: ANN001
        """n>1 sampling: a running sequence forked at a token frontier (tail COW-copied from
        the owner's live page at the boundary, while the owner may keep writing above it)."""
        b = data.draw(st.sampled_from(self.actives))
        f = int(self.committed(b) * frac)
        dst = self.attempt("fork_live", self.store.fork_live, b, extra, f)
        if dst is not None:
            for p in self.pools:
                self.content[(dst, p)] = self.content[(b, p)][:f]


    @precondition(lambda self: self.store.checkpoints())
    @rule(data=st.data(), frac=st.floats(0, 1))
    def release_tail(self, data, frac: float) -> None:  # noqa: ANN001
        """A cache gives up a checkpoint's tail: its first whole pages live on as a new one."""
        ck = data.draw(st.sampled_from(self.checkpoints))
        f = int(self.committed(ck) * frac)
        per_pool = data.draw(st.booleans())  # the same frontiers, given one per pool
        new = self.attempt("release_tail", self.store.release_tail, ck,
                           dict.fromkeys(self.pools, f) if per_pool else f)
        if new is None:
            return
        self.doomed.add(ck)
        if new is not True:
            for p in self.pools:
                self.content[(new, p)] = self.content[(ck, p)][:f // P * P]


class MtpMachine(StoreMachine):
    backend = Backend.MTP


class DflashMachine(StoreMachine):
    backend = Backend.DFLASH


EVERY = ("activate", "ensure_mapped_many", "commit_many", "ensure_mapped", "set_provisional",
         "trim", "truncate", "finish", "release", "activate_from", "offload", "drop_device",
         "drop_host", "grow", "boundary", "snapshot", "compact", "reopen", "crash",
         "continue_host_only_move", "continue_host_only_fork")
SHARING_EVERY = ("activate", "commit_many", "share_prefix", "fork_live", "release_tail",
                 "activate_from", "finish", "release", "offload", "crash", "reopen")


@pytest.mark.parametrize("machine,examples,min_steps", [
    (StoreMachine, 120, 5000), (MtpMachine, 70, 2500), (DflashMachine, 70, 2500),
    (SharingMachine, 50, 2000)])
def test_store_machine(machine: type[StoreMachine], examples: int, min_steps: int) -> None:
    """>= 10,000 steps over the three machines in each CI run; every command really ran."""
    StoreMachine.total_steps = 0
    StoreMachine.done = {}
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples * SCALE, stateful_step_count=STEPS, deadline=None,
        derandomize=SCALE == 1, database=None, suppress_health_check=list(HealthCheck)))
    assert StoreMachine.total_steps >= min_steps, StoreMachine.total_steps
    every = SHARING_EVERY if machine is SharingMachine else EVERY
    missing = [c for c in every if StoreMachine.done.get(c, 0) == 0]
    assert not missing, (missing, StoreMachine.done)
