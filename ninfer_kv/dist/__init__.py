"""Beyond one machine, on torch.distributed (gloo on CPU, NCCL on GPU).

* ``replica``: tensor-parallel replicas — a ``Leader`` ships each boundary's journal records to
  ``Follower`` ranks, whose stores hold their shard of the KV heads and apply the same events.
* ``standby``: a follower that persists what it applies and acknowledges durable records, so
  it can be promoted (``Follower.promote``) after the leader dies.
* ``transfer`` / ``receive``: ``export`` / ``import_`` move an inactive checkpoint (metadata,
  frontiers, page bytes) between stores, published by the receiver only after every page's
  CRC-32C matched (the protocol: ``transfer``'s docstring).

docs/multi-gpu.md describes both topologies.
"""

from __future__ import annotations

from ninfer_kv.dist.errors import (
    DistError,
    NotLeader,
    PlanMismatch,
    RecordRefused,
    ReplicaDiverged,
    ReplicaError,
    ReplicaUnsupported,
    SendFailed,
    StreamBroken,
    TransferAborted,
    TransferCorrupt,
    TransferError,
    TransferRefused,
)
from ninfer_kv.dist.follower import Follower, FollowerStore, Step
from ninfer_kv.dist.receive import import_
from ninfer_kv.dist.replica import Leader, shard_config
from ninfer_kv.dist.transfer import TransferReport, export

__all__ = [
    "DistError", "Follower", "FollowerStore", "Leader", "NotLeader", "PlanMismatch",
    "RecordRefused", "ReplicaDiverged", "ReplicaError", "ReplicaUnsupported", "SendFailed",
    "Step", "StreamBroken",
    "TransferAborted", "TransferCorrupt", "TransferError", "TransferRefused", "TransferReport",
    "export", "import_", "shard_config",
]
