"""Typed refusals of the distributed layer; every one is a ``KVStoreError``.

Messages name the offending values and the rule, as the store's own errors do."""

from __future__ import annotations

from ninfer_kv.errors import KVStoreError


class DistError(KVStoreError):
    """Base of every refusal of ``ninfer_kv.dist``."""


# --- TP replicas (replica.py) ---------------------------------------------------------------
class SendFailed(DistError):
    """A ``wire.sender`` message that the ranks in ``ranks`` did not get; every other rank
    of the sender's list did."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class ReplicaError(DistError):
    """A follower cannot take what its leader sent."""


class RecordRefused(ReplicaError):
    """A record out of order, with a bad CRC, a foreign salt or a broken CRC chain
    (docs/journal-format.md, "Record frame"). Nothing of the message was applied."""


class PlanMismatch(ReplicaError):
    """The leader's capacity plan is not the follower's: page ids would not address the same
    page groups (§3.3: the typed capacity vector is fixed at startup, on every rank)."""


class ReplicaDiverged(ReplicaError):
    """A record that verified but did not apply, or a leader digest the follower does not
    reach: the follower stopped (fail-stop) and must be rebuilt."""


class StreamBroken(ReplicaError):
    """The record stream broke: a follower's receive failed (the leader died, the link
    dropped) or a leader's send did. Nothing can re-send what was lost, so that side stopped
    (fail-stop) and the TP group must be rebuilt."""


class NotLeader(ReplicaError):
    """A command on a follower store: followers apply the leader's records and never choose."""


class ReplicaUnsupported(ReplicaError):
    """An event whose effect a follower does not run in this version (the host tier)."""


# --- checkpoint transfer (transfer.py, receive.py) -----------------------------------------
class TransferError(DistError):
    """A checkpoint transfer that did not publish."""


class TransferRefused(TransferError):
    """The receiver refused the header (geometry, capacity) or the sender's checkpoint is not
    exportable; nothing was reserved or everything reserved was freed."""


class TransferCorrupt(TransferError):
    """Bytes arrived whose per-page CRC-32C differs from the sender's (on the receiver), or a
    page the sender reads from its host replica fails the replica's published CRC (on the
    sender): the checkpoint is not published (§5.3: verify before publish) and the
    receiver's pages are freed."""


class TransferAborted(TransferError):
    """The peer dropped or a send/recv failed mid-transfer; the receiver freed what it had
    reserved and published nothing."""
