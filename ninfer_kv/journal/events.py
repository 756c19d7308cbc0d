"""Engine events: one msgspec tagged union, array-valued on the hot path.

Every event carries every choice a command made (page ids, slots, rows), so ``apply`` never
chooses and replay needs no allocator policy. Hot-path events hold int arrays packed as
little-endian int32 ``bytes`` (see :func:`pack` / :func:`unpack`): a decode round over 256
sequences is one ``CommitFrontiers`` event, not 256 objects on the wire.

Schema evolution (also in docs/journal-format.md): ``SCHEMA = (major, minor)`` is written into
every segment header. Within a major version only new optional trailing fields (with defaults)
and new tags may be added (bump minor). Anything else is a new major version, which older
readers refuse with ``SchemaVersionError``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

SCHEMA: tuple[int, int] = (1, 8)
"""1.1 added the host-tier and Recovered tags and Activate.budget/prompt (minor: compatible);
1.2 added the Pin/Unpin tags (transaction pins of queued device copies); 1.3 added
Activate.held (0, the old meaning, when absent); 1.4 added HostConfigure.persistent; 1.5 added
the SetMetadata tag (engine metadata of a sequence or checkpoint); 1.6 added the Share tag
(a running sequence's full-page prefix published as an inactive checkpoint); 1.7 added the
Prefix tag (an inactive checkpoint's full-page prefix as a new one: ``release_tail``); 1.8
added Recovered.next_id (a reopen skips the ids a lost record may have handed out)."""

METADATA_MAX = 1 << 20
"""Largest engine metadata blob (encoded msgpack bytes) a bundle may carry."""
METADATA_PER_RECORD = 64 << 20
"""Most metadata bytes one boundary's record may carry (a record is at most 256 MiB)."""
REASON_MAX = 256
"""Longest finish reason, in UTF-8 bytes (vLLM's are words: "stop", "length", "abort")."""

I32 = np.dtype("<i4")


def pack(values: Any) -> bytes:
    """int sequence / array -> little-endian int32 bytes."""
    return np.asarray(values, dtype=I32).tobytes()


def pack_u32(values: Any) -> bytes:
    """uint32 values (checksums) -> the same 4 little-endian bytes each."""
    return np.asarray(values, dtype=np.uint32).astype("<u4").tobytes()


def pack_i64(values: Any) -> bytes:
    """int64 values (host byte offsets) -> little-endian bytes."""
    return np.asarray(values, dtype="<i8").tobytes()


def unpack_i64(b: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(b, dtype="<i8")


def unpack_u32(b: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(b, dtype="<u4")


def unpack(b: bytes | memoryview) -> np.ndarray:
    """little-endian int32 bytes -> read-only int32 array (zero-copy)."""
    return np.frombuffer(b, dtype=I32)


class _Event(msgspec.Struct, array_like=True, frozen=True, gc=False, tag_field="t"):
    pass


# --- configuration ---------------------------------------------------------------------------
class PoolSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    name: str
    capacity: int
    rows: int
    logical_pages: int
    page_bytes: int


class Configure(_Event, tag="cfg"):
    """First event of a journal: the pool set fixed at startup (spec §3.3) and the plan it came
    from (``plan`` is ``CapacityPlan.to_dict()``, kept for tools)."""

    pools: list[PoolSpec]
    plan: dict[str, Any]


# --- activation / termination ------------------------------------------------------------------
class Activate(_Event, tag="act"):
    """Create the active address space of ``bundle`` in ``pool``: reserve ``entitlement``
    pages (spec §6.2) and lease execution row ``row`` (spec §7.2)."""

    bundle: int
    pool: str
    entitlement: int
    row: int
    budget: int = 0
    """prompt + output budget in tokens (bounds kv_lease_growth); 0 = unknown."""
    prompt: int = 0
    """prompt tokens (for tools: prefix-hit ratios); 0 = unknown."""
    held: int = 0
    """Pages of ``entitlement`` that a Move/Fork later in the same record hands over from the
    source: already allocated, so not reserved (the reservation is ``entitlement - held``, and
    ``allocated + reserved <= capacity`` holds after every event, not only per record)."""


class Recovered(_Event, tag="recov"):
    """First event of the record written when a store reopens an existing journal: device
    contents are gone; ``kept``/``dropped`` list the inactive checkpoints by id. ``next_id``:
    the first seq id the reopened store hands out, ``engine.state.ID_GAP`` past the journal's
    next one, so that no id handed out in a record a failure lost is handed out again (-1,
    a journal before schema 1.8: the journal's next id)."""

    records: int
    kept: bytes
    dropped: bytes
    next_id: int = -1


class PublishActive(_Event, tag="pub"):
    """The bundle's spaces in every enabled pool are complete: publish Active (spec §7.3)."""

    bundle: int


class Finish(_Event, tag="fin"):
    """Leave execution (spec §8.3): release the row, drop the writer and active references,
    release the unmaterialized entitlement; then retain as an immutable inactive checkpoint
    (protected frontier = committed frontier) or release every membership."""

    bundle: int
    pool: str
    retain: bool
    reason: str = "stop"


class SetMetadata(_Event, tag="meta"):
    """Attach the engine's metadata to a bundle (an active sequence or a checkpoint): msgpack
    bytes of at most ``METADATA_MAX``; empty clears it. It lives and survives with the bundle."""

    bundle: int
    meta: bytes


class Release(_Event, tag="rel"):
    """Drop an inactive checkpoint's references; leases free with their last reference."""

    bundle: int
    pool: str


# --- mapping and frontiers (hot path) ------------------------------------------------------------
class Materialize(_Event, tag="mat"):
    """For each i: a new private LogicalKVPage at ``slots[i]`` with device lease ``pages[i]``,
    appended to the membership of ``bundles[i]``; one reserved page becomes a lease (§5.2)."""

    pool: str
    bundles: bytes
    slots: bytes
    pages: bytes


class CommitFrontiers(_Event, tag="commit"):
    """Advance the committed frontier of each ``bundles[i]`` to ``frontiers[i]`` (§8.1)."""

    pool: str
    bundles: bytes
    frontiers: bytes


class ProvisionalFrontiers(_Event, tag="prov"):
    """Set the provisional (speculative) frontier; it never counts as committed (§10)."""

    pool: str
    bundles: bytes
    frontiers: bytes


class Trim(_Event, tag="trim"):
    """Unmap trailing pages beyond ``keep`` pages; leases go back to the same reservation."""

    bundle: int
    pool: str
    keep: int


class Truncate(_Event, tag="trunc"):
    """Move the committed frontier back to ``frontier`` (>= protected); the provisional frontier
    follows; the tail page's committed columns shrink and its content epoch advances."""

    bundle: int
    pool: str
    frontier: int


class Grow(_Event, tag="grow"):
    """kv_lease_growth: add ``pages[i]`` to the entitlement of ``bundles[i]`` (§6.2)."""

    pool: str
    bundles: bytes
    pages: bytes


# --- continuation (Move / Fork / COW, spec §7.3, §9) ---------------------------------------------
class Move(_Event, tag="move"):
    """Move the membership of inactive ``src`` into active ``dst`` (no copy, same pages)."""

    src: int
    dst: int
    pool: str
    frontier: int


class Share(_Event, tag="share"):
    """Inactive checkpoint ``dst`` gains an immutable reference to the first ``full_pages``
    (fully committed) pages of active ``src``, which keeps running above them: the pages lose
    their writer and become protected, and ``src`` may not truncate below them."""

    src: int
    dst: int
    pool: str
    full_pages: int


class Prefix(_Event, tag="pfx"):
    """New inactive checkpoint ``dst`` holds the first ``full_pages`` (fully committed) pages
    of inactive checkpoint ``src``: an immutable prefix of an immutable checkpoint (§8.3,
    §9.2). With ``Release(src)`` in the same record it gives up ``src``'s tail pages
    (``KVStore.release_tail``), as a retention policy evicts a cached request tail first.
    One per pool of ``src``; with a frontier per pool their counts differ, and a pool may
    keep 0 pages (an empty space) while another keeps some."""

    src: int
    dst: int
    pool: str
    full_pages: int


class Fork(_Event, tag="fork"):
    """``dst`` gains an immutable reference to the first ``full_pages`` pages of ``src``."""

    src: int
    dst: int
    pool: str
    full_pages: int
    frontier: int


class CopyTail(_Event, tag="cow"):
    """Private COW tail: new page ``slot``/``page`` in ``dst`` whose first ``columns`` columns
    are copied from ``src_page`` (device effect at the boundary, before table publication)."""

    dst: int
    pool: str
    slot: int
    page: int
    src_slot: int
    src_page: int
    columns: int


# --- host tier (spec §5.3): reserve destination -> copy -> verify -> publish -> release --------
class HostConfigure(_Event, tag="hcfg"):
    """The host arena's capacity in bytes (fixed at startup, spec §3.3)."""

    capacity: int
    persistent: int = -1
    """1: a file-backed arena (persist_dir), whose published replicas outlive the process;
    0: in memory; -1: not recorded (schema < 1.4). A reopen must match a recorded value."""


class HostReserve(_Event, tag="hres"):
    """Reserve destination extents (int64 byte ``offsets``, one packed host page each) for the
    pages ``slots`` (logical order); the source pages are pinned while the copy runs. The
    transfer is named by its first offset."""

    pool: str
    slots: bytes
    offsets: bytes


class HostPublish(_Event, tag="hpub"):
    """The copy of transfer ``offset`` completed and was verified: publish host replicas
    (epoch, committed coverage, CRC-32C of the committed columns) and unpin."""

    pool: str
    offset: int
    slots: bytes
    epochs: bytes
    coverage: bytes
    checksums: bytes


class HostAbort(_Event, tag="habort"):
    """Abandon an unpublished destination extent (never entered any address space)."""

    pool: str
    offset: int


class HostDrop(_Event, tag="hdrop"):
    """Drop the host replicas of ``slots``; an extent frees when its last page leaves."""

    pool: str
    slots: bytes


class DeviceDrop(_Event, tag="ddrop"):
    """Drop the device replicas of ``slots`` (each has a valid host replica): their page
    groups return to the pool."""

    pool: str
    slots: bytes


class DeviceRestore(_Event, tag="drest"):
    """H2D: host-only pages ``slots`` get device page groups ``pages`` (copied at the boundary
    before any table publication)."""

    pool: str
    slots: bytes
    pages: bytes


# --- transaction pins (spec §5.1, §5.3) -----------------------------------------------------------
class Pin(_Event, tag="pin"):
    """A queued device copy (H2D restore, COW tail) reads these pages at the next boundary: pin
    them so no command can free, drop or replace what the copy reads (§5.3: "the only valid
    source must not be released" while the copy runs). One pin per listed slot."""

    pool: str
    slots: bytes


class Unpin(_Event, tag="unpin"):
    """The boundary ran the copies: drop the pins of ``Pin`` (a page that lost its last
    reference meanwhile is freed now)."""

    pool: str
    slots: bytes


Event = (Configure | Recovered | Activate | PublishActive | Finish | Release | Materialize | CommitFrontiers
         | ProvisionalFrontiers | Trim | Truncate | Grow | Move | Fork | Share | Prefix | CopyTail
         | HostConfigure
         | HostReserve | HostPublish | HostAbort | HostDrop | DeviceDrop | DeviceRestore | Pin
         | Unpin | SetMetadata)


class EventCodec:
    """msgpack list-of-events payload codec for :class:`~ninfer_kv.journal.log.Journal`."""

    schema = SCHEMA

    def __init__(self, event_type: Any = Event) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(list[event_type])

    def encode(self, events: list[Any]) -> bytes:
        return self._enc.encode(events)

    def decode(self, payload: bytes | memoryview) -> list[Any]:
        return self._dec.decode(payload)


CODEC = EventCodec()
