"""A standby: a TP follower that also persists what it applies, so it can be promoted after
the leader dies with every durable checkpoint intact (§5.3: durable = published host replicas
in a persistent arena).

A standby opens its own store directories (``persist_dir``: journal and host arena file),
applies the leader's records as any follower does, and appends each one to *its own* journal —
its own seqs and CRC chain, and in a HostPublish the CRC-32Cs of *its own* shard's pages (the
in-memory state keeps the leader's, so digests stay equal on every rank). A message the leader
flags ACK (a record in it changes what a reopen keeps) is fsynced, then acknowledged; the
leader's boundary returns only when every standby acknowledged. ``Follower.promote()`` closes
the standby and reopens its directories as a normal ``KVStore``: recovery keeps every
checkpoint whose host replicas verify against this rank's CRCs and aborts active sequences.

Rules: a standby starts from a leader attached to a freshly opened store (the standby's own
fresh state must have the hello's digest, so the leader needs a persistent host tier too), in
a ``persist_dir`` holding no journal or arena yet. It takes no snapshots: its in-memory state
carries the leader's CRCs, which a snapshot would persist; promotion replays its journal.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, TypeVar

import msgspec
import structlog

from ninfer_kv.dist.errors import PlanMismatch
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.durability import changes_what_survives
from ninfer_kv.engine.opening import ARENA_NAME
from ninfer_kv.engine.state import digest
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import ConfigError, KVStoreError
from ninfer_kv.journal import events as ev

S = TypeVar("S", bound=KVStore)
log = structlog.get_logger(__name__)


def is_standby(config: StoreConfig) -> bool:
    return config.journal_path is not None or config.persist_dir is not None


def open_standby(cls: type[S], config: StoreConfig, hello_digest: str) -> S:
    """Open ``cls`` (a ``FollowerStore``) in fresh standby directories and check that its
    state is the one the leader announced; a refusal leaves the directories unused."""
    if config.persist_dir is None or not config.host_bytes:
        raise ConfigError("a standby needs persist_dir and host_bytes > 0: only published host "
                          "replicas in a persistent arena survive a promotion (§5.3)")
    jdir = config.journal_path
    assert jdir is not None
    arena = os.path.join(config.persist_dir, ARENA_NAME)
    used = [p for p in ([os.path.join(jdir, n) for n in os.listdir(jdir) if n != "LOCK"]
                        if os.path.isdir(jdir) else []) + [arena] if os.path.lexists(p)]
    if used:
        raise ConfigError(f"a standby starts from the leader's first record, in directories "
                          f"holding no journal or arena yet; found {used[:3]}")
    store = cls.open(config)
    if digest(store.state) != hello_digest:
        store.close()
        for n in os.listdir(jdir):   # what this open created: the directories stay unused
            if n != "LOCK":
                os.remove(os.path.join(jdir, n))
        os.remove(arena)
        with contextlib.suppress(FileNotFoundError):
            os.remove(arena + ".id")  # its identity token (engine/opening.py) goes with it
        raise PlanMismatch("the leader's state at attach is not a freshly opened store's with "
                           "this config: attach the Leader right after opening a new store, "
                           "with the same host_bytes and a persistent host tier (persist_dir)")
    return store


def own_publish(e: ev.HostPublish, crcs: list[int]) -> ev.HostPublish:
    """The leader's HostPublish with this rank's page CRCs: what this standby journals."""
    return msgspec.structs.replace(e, checksums=ev.pack_u32(crcs))


def persist(store: KVStore, events: list[Any]) -> int:
    """Append one applied record to the standby's journal; returns its seq there."""
    assert store.journal is not None
    return store.journal.append(events, durable=changes_what_survives(events, store.state))


def promote(store: KVStore) -> KVStore:
    """Close the standby's store and reopen its directories as a normal store (recovery).
    A close that fails (its journal failed earlier) still releases the files and locks; the
    journal on disk is then the truth, as after a crash."""
    config = store.config
    if not store.closed:
        try:
            store.close()
        except KVStoreError as exc:
            log.warning("standby.close_failed", error=str(exc))
    return KVStore.open(config)
