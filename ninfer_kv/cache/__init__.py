"""Policies above the store (the store never selects, spec §1): a token-exact prefix index an
engine can use to find which retained checkpoint to continue, a retention policy that decides
which checkpoints to demote or release, and preemption (swap an active sequence out to the
host tier and back) — each one an engine can use or replace."""

from ninfer_kv.cache.index import Match, PrefixIndex
from ninfer_kv.cache.preemption import Swapped, swap_in, swap_out
from ninfer_kv.cache.retention import LruRetention

__all__ = ["LruRetention", "Match", "PrefixIndex", "Swapped", "swap_in", "swap_out"]
