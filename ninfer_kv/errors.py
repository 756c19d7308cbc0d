"""Typed error hierarchy: every refusal of the store is a ``KVStoreError``.

Messages name the offending values and the rule broken, e.g.
``EntitlementExceeded: seq=7 pool=main needs 18 pages, entitlement is 16 (spec §8.1)``.
A refused command leaves the state digest unchanged (commands plan fully, then emit).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error ninfer-kv raises on bad input or an impossible request."""


class InvalidArgument(KVStoreError, ValueError):
    """A caller-supplied value of the wrong type or outside its documented range (an int that
    is not an integer, a negative budget, batched arguments of different lengths, ...)."""


# --- store lifecycle and durability -------------------------------------------------------------
class StoreClosed(KVStoreError):
    """A call on a store after ``close()``."""


class StoreFailed(KVStoreError):
    """Fail-stop: an earlier write, fsync, msync or device effect failed, or an accepted event
    could not be applied. Every later mutating call raises this until the store is reopened
    (reopen recovers from the journal; nothing unsynced is reported durable)."""


class StoreLocked(KVStoreError):
    """Another live process holds the exclusive lock on this persistence/journal directory."""


# --- configuration / planning (spec §3, §4) ---------------------------------------------------
class ConfigError(KVStoreError):
    """A model or serving geometry that breaks a rule of the contract."""


class UnknownProfile(ConfigError):
    """A KV profile name outside the five closed profiles (spec §3.1)."""


class CapacityError(ConfigError):
    """A capacity request outside [M_min, M_max] or a device budget below B_min (spec §3.2)."""


# --- journal ------------------------------------------------------------------------------------
class JournalError(KVStoreError):
    """The journal cannot accept or return records."""


class JournalCorrupt(JournalError):
    """Damage in the middle of the log: a bad record followed by a good one."""

    def __init__(self, segment: int, offset: int, reason: str) -> None:
        super().__init__(f"journal corrupt in segment {segment} at byte {offset}: {reason}")
        self.segment = segment
        self.offset = offset
        self.reason = reason


class UnappliableRecord(JournalCorrupt):
    """A record with valid framing and CRC whose events cannot be applied to the state before
    it (a foreign or hand-made journal): replay and the tools stop with this, never a raw
    KeyError."""

    def __init__(self, seq: int, index: int, event: str, cause: BaseException) -> None:
        JournalError.__init__(self, f"record {seq} event {index} ({event}) is well-formed but "
                                    f"cannot be applied to the state before it: {cause!r}")
        self.segment, self.offset, self.reason = -1, -1, repr(cause)
        self.seq, self.index = seq, index


class JournalFailed(JournalError):
    """An earlier write or fsync failed; the log refuses every further append."""


class SchemaVersionError(JournalError):
    """A segment written by a newer major schema version than this reader understands."""


# --- engine state (spec §5-§9) ------------------------------------------------------------------
class StateError(KVStoreError):
    """A command that is not valid in the current logical state."""


class UnknownHandle(StateError):
    """A sequence, checkpoint or page handle that does not exist."""


class StaleHandle(StateError):
    """A page handle whose generation no longer matches its slot (spec §5.1)."""


class FrontierError(StateError):
    """A frontier beyond membership, behind the protected frontier, or otherwise out of range."""


class EntitlementExceeded(StateError):
    """ensure_mapped would need more pages than the address space's entitlement (spec §8.1)."""


class CapacityExhausted(StateError):
    """Not enough available page groups or execution rows in a pool to reserve (spec §5.2, §7.2).

    ``pool`` names the pool and ``short`` the page groups it lacks: a caller that frees that
    many there (evicts a cached prefix) can retry; 0 when the execution rows are the limit."""

    def __init__(self, message: str, *, pool: str = "", short: int = 0) -> None:
        super().__init__(message)
        self.pool = pool
        self.short = short


class IdsExhausted(StateError):
    """The journal has handed out the last seq id it can record: batched events pack seq ids
    as int32 (docs/journal-format.md), so ids end at 2**31 - 1. Nothing frees one (ids are
    never reused: a stale id must never name a new sequence), so retrying does not help; the
    store still serves what exists. Continue in a new journal directory."""


class FrozenUnit(StateError):
    """A mutation of tables, memberships or frontiers while a GPU unit is in flight (spec §8.4)."""


class InactiveSpace(StateError):
    """A write/commit on an address space that is not active."""


class WritePermissionError(StateError):
    """A write into a shared, protected or pinned page (spec §9.4)."""


class HostArenaError(StateError):
    """The host arena cannot place a recipe of extents (spec §5.3)."""


class InjectedFault(KVStoreError):
    """Raised by the fault-injection hook in tests; never in production paths."""


class UnsupportedOperation(KVStoreError, NotImplementedError):
    """A request outside what a component supports (e.g. beam-search row reordering in the
    transformers cache); the message says what to use instead."""


APPLY_ERRORS: tuple[type[Exception], ...] = (KeyError, IndexError, ValueError, TypeError,
                                             AssertionError, AttributeError, OverflowError)
"""What ``apply`` raises on an event that does not fit the state (a damaged or foreign
journal: the commands validate before they emit). Replay, recovery and a TP follower turn it
into their typed refusal (``UnappliableRecord``, ``JournalCorrupt``, ``ReplicaDiverged``)."""
