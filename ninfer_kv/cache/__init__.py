"""Policies above the store (the store never selects, spec §1): a token-exact prefix index an
engine can use to find which retained checkpoint to continue, or replace with its own."""

from ninfer_kv.cache.index import Match, PrefixIndex

__all__ = ["Match", "PrefixIndex"]
