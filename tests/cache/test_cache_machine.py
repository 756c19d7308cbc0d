"""The cache layer inside the store's state machine: live sharing (share_prefix, fork_live)
plus preemption (swap_out / swap_in) and the retention policy (make_room, make_host_room), on
the multi-pool profiles (MTP, DFlash), with and without lease growth. Every step keeps the
machine's checks: byte-exact contents against a shadow, typed refusals that leave the digest
unchanged, invariants and residency counts, replay equal to the live store, and acked
checkpoints surviving a crash. On top: ``make_room`` / ``make_host_room`` terminate, and a
``make_host_room`` takes restart survival from at most the one checkpoint it dropped.

(An independent review's extended machine, which found ``drop_host`` taking survival from a
checkpoint sharing the victim's pages.)
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from ninfer_kv.cache.preemption import Swapped, swap_in, swap_out
from ninfer_kv.cache.retention import LruRetention
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.store import KVStore
from tests.engine.test_state_machine import SCALE, STEPS, SharingMachine, StoreMachine


class CacheMachine(SharingMachine):
    lease_growth = False

    def __init__(self) -> None:
        super().__init__()
        if self.lease_growth:
            self.store.close()
            self.config = dataclasses.replace(self.config, lease_growth=True, lease_window=100,
                                              lease_cushion=16)
            self.store = KVStore.open(self.config)
        self.swapped: dict[int, Swapped] = {}
        self.policy = LruRetention()

    def _sync_policy(self) -> None:
        """The policy tracks every checkpoint (oldest id first)."""
        cks = set(self.store.checkpoints())
        for ck in [c for c in self.policy.entries if c not in cks]:
            self.policy.forget(ck)
        for ck in sorted(cks - set(self.policy.entries)):
            self.policy.retain(ck, (ck,))

    @precondition(lambda self: self.store.active())
    @rule(data=st.data(), extra=st.integers(1, 100))
    def swap_out(self, data, extra: int) -> None:  # noqa: ANN001
        b = data.draw(st.sampled_from(self.actives))
        top = max(self.store.space(b, p).committed for p in self.pools)
        sw = self.attempt("swap_out", swap_out, self.store, b, top + extra)
        if sw is None:
            return
        self.swapped[sw.checkpoint] = sw
        for p in self.pools:
            self.content[(sw.checkpoint, p)] = self.content[(b, p)][:sw.frontier[p]]
        if sw.offloaded:
            self.offloaded.add(sw.checkpoint)

    @precondition(lambda self: any(ck in self.store.state.bundles for ck in self.swapped))
    @rule(data=st.data())
    def swap_in(self, data) -> None:  # noqa: ANN001
        ck = data.draw(st.sampled_from(sorted(c for c in self.swapped
                                              if c in self.store.state.bundles)))
        sw = self.swapped[ck]
        dst = self.attempt("swap_in", swap_in, self.store, sw)
        if dst is None:
            return
        del self.swapped[ck]
        for p in self.pools:
            assert self.store.space(dst, p).committed == sw.frontier[p]
            self.content[(dst, p)] = self.content[(ck, p)][:sw.frontier[p]]
        self.doomed.add(ck)

    @precondition(lambda self: self.store.active() and self.store.arena is not None)
    @rule(data=st.data())
    def drop_host_active(self, data) -> None:  # noqa: ANN001
        """An active sequence's host replicas (after swap_in) are a cache: dropping them takes
        no checkpoint's restart survival."""
        b = data.draw(st.sampled_from(self.actives))
        survivors = self.survivors()
        if self.attempt("drop_host_active", self.store.drop_host, b) is not None:
            lost = sorted(survivors - self.survivors())
            assert not lost, f"drop_host({b}) took restart survival from {lost}"

    @precondition(lambda self: self.store.checkpoints())
    @rule()
    def make_room(self) -> None:
        self._sync_policy()
        bound = 3 * len(self.policy.entries) + 3
        for _ in range(bound):
            before, digest = set(self.store.checkpoints()), self.store.digest()
            got = self.policy.make_room(self.store)
            StoreMachine.done["make_room"] = StoreMachine.done.get("make_room", 0) + 1
            if got is None:
                assert self.store.digest() == digest, "make_room found nothing, changed state"
                return
            self.doomed |= before - set(self.store.checkpoints())
        raise AssertionError(f"make_room did not terminate in {bound} calls")

    @precondition(lambda self: self.store.checkpoints() and self.store.arena is not None)
    @rule()
    def make_host_room(self) -> None:
        self._sync_policy()
        bound = 3 * len(self.policy.entries) + 3
        for _ in range(bound):
            before = set(self.store.checkpoints())
            survived = {c for c in before if self.store.checkpoint_info(c).survives_restart}
            got = self.policy.make_host_room(self.store)
            StoreMachine.done["make_host_room"] = StoreMachine.done.get("make_host_room", 0) + 1
            if got is None:
                return
            now = set(self.store.checkpoints())
            lost = {c for c in survived & now if not self.store.checkpoint_info(c).survives_restart}
            assert len(lost) <= (got == "drop_host"), (got, lost)  # only its own victim
            self.doomed |= (before - now) | lost
        raise AssertionError(f"make_host_room did not terminate in {bound} calls")

    def reopened_store(self, crashed: bool) -> None:
        super().reopened_store(crashed)
        self.swapped = {c: s for c, s in self.swapped.items() if c in self.store.state.bundles}


class MtpCacheMachine(CacheMachine):
    backend = Backend.MTP


class DflashGrowthCacheMachine(CacheMachine):
    backend = Backend.DFLASH
    lease_growth = True


class MtpGrowthCacheMachine(CacheMachine):
    backend = Backend.MTP
    lease_growth = True


CACHE_EVERY = ("share_prefix", "fork_live", "swap_out", "swap_in", "make_room",
               "make_host_room", "drop_host", "drop_host_active", "crash", "reopen")


@pytest.mark.parametrize("machine", [MtpCacheMachine, MtpGrowthCacheMachine,
                                     DflashGrowthCacheMachine])
def test_cache_machine(machine: type[CacheMachine]) -> None:
    StoreMachine.total_steps = 0
    StoreMachine.done = {}
    run_state_machine_as_test(machine, settings=settings(
        max_examples=60 * SCALE, stateful_step_count=STEPS, deadline=None,
        derandomize=SCALE == 1, database=None, suppress_health_check=list(HealthCheck)))
    assert StoreMachine.total_steps >= 600, StoreMachine.total_steps
    missing = [c for c in CACHE_EVERY if StoreMachine.done.get(c, 0) == 0]
    assert not missing, (missing, StoreMachine.done)
