"""Preemption of an active sequence: swap it out to free its device pages, and later resume it
exactly where it stopped — instead of refusing the request that needs the room.

``swap_out`` finishes the sequence *retained* at its committed frontier (reason "preempted";
the speculative lead above it goes with the finish's Trim, §8.2), then, with a host tier,
offloads the checkpoint and drops its device pages: they are copied to the host arena at the
next boundary and the device page groups of those it holds alone return to the pool when that
copy publishes (§5.3). A prefix another checkpoint holds too (a system prompt it continued)
stays on the device for that one, as vLLM keeps the blocks a preempted request shares.
Without a host tier, or when the arena cannot place the pages, the checkpoint stays on the
device (``Swapped.offloaded`` is False): the caller's retention policy may then release it and
recompute the request later (vLLM's recompute preemption).

``swap_in`` continues the checkpoint at the same frontiers without keeping it: a Move when no
other address space references its pages (no copy), else a Fork whose partial tail is
COW-copied; host-only pages are restored first (§9). Either way the resumed sequence reads
the bytes it had when it was swapped out.

Which sequence to preempt is the caller's choice (the store never selects, §1).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from ninfer_kv.engine.args import a_store, as_int
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import HostArenaError, InvalidArgument

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Swapped:
    """A swapped-out sequence: what ``swap_in`` needs to resume it."""

    checkpoint: int
    frontier: dict[str, int]   # committed tokens per pool when it was swapped out
    budget: int                # prompt + output tokens the resumed sequence may reach
    offloaded: bool            # its pages go to the host tier (device freed at the next boundary)


def swap_out(store: KVStore, seq: int, budget: int) -> Swapped:
    """Preempt active sequence ``seq`` whose request may reach ``budget`` tokens (prompt +
    max output). Refusals (unknown or inactive ``seq``, a budget not above its frontier or
    above S) change nothing. The checkpoint keeps the sequence's id (``finish`` retains it
    in place), so an engine interrupted before this returns loses nothing: the checkpoint
    is ``seq``, its frontiers are ``store.space(seq, pool).committed``."""
    a_store(store, "swap_out")
    seq = as_int("seq", seq)
    budget = as_int("budget", budget)
    frontier = {pool: store.space(seq, pool).committed for pool in store.pools}
    if not max(frontier.values()) < budget <= store.plan.S:
        raise InvalidArgument(f"swap_out: budget {budget} must exceed seq {seq}'s committed "
                              f"frontier {max(frontier.values())} (a resumed sequence needs "
                              f"room for at least one more token) and be at most "
                              f"S={store.plan.S} (§3.2: swap_in could never resume it)")
    ck = store.finish(seq, retain=True, reason="preempted")
    assert ck is not None
    offloaded = store.arena is not None
    if offloaded:
        try:
            store.offload(ck)
            store.drop_device(ck, shared_with=[])  # its own pages (the module docstring)
        except HostArenaError as exc:  # refused whole: the checkpoint stays on the device
            offloaded = False
            log.info("preemption.device_only", checkpoint=ck, reason=str(exc))
    log.debug("preemption.swap_out", seq=seq, checkpoint=ck, offloaded=offloaded)
    return Swapped(ck, frontier, budget, offloaded)


def swap_in(store: KVStore, swapped: Swapped) -> int:
    """Resume a swapped-out sequence, with the metadata it had (its prompt tokens: a prefix
    index rebuilt after a restart finds its checkpoint); returns its new sequence id.
    ``CapacityExhausted`` (nothing changed) when the device cannot hold its pages and budget
    yet. Its pages keep their host replicas (a later ``swap_out`` reuses the ones still valid)
    until ``store.drop_host(seq)`` after the boundary that restored them frees the extents."""
    a_store(store, "swap_in")
    if not isinstance(swapped, Swapped) or not isinstance(swapped.frontier, dict) \
            or not swapped.frontier:
        raise InvalidArgument(f"swap_in: {swapped!r} is not the Swapped that swap_out returned")
    frontier = {pool: as_int(f"frontier[{pool!r}]", f, lo=0)
                for pool, f in swapped.frontier.items()}
    prompt = max(frontier.values())
    budget = as_int("budget", swapped.budget, lo=prompt)
    seq = store.activate_from(as_int("checkpoint", swapped.checkpoint), frontier, prompt,
                              budget - prompt, keep_source=False, carry_metadata=True)
    log.debug("preemption.swap_in", checkpoint=swapped.checkpoint, seq=seq)
    return seq
