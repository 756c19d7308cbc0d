"""Length-prefixed byte messages over torch.distributed point-to-point (send/recv).

Gloo moves CPU tensors; NCCL moves CUDA tensors, so on an NCCL group the same bytes travel
through a buffer on the current CUDA device. Control messages are small; page payloads use
the tensor calls of ``transfer.py`` and ``receive.py`` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ninfer_kv.dist.errors import DistError, SendFailed
from ninfer_kv.engine.args import as_int

MAX_MESSAGE = 1 << 31
"""A length prefix above this is refused as damage (a record is at most 256 MiB)."""


def wire_device(group: Any = None) -> torch.device:
    """Where tensors must live to travel on ``group``: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_bytes(data: bytes | bytearray | memoryview, dst: int, group: Any = None) -> None:
    dst = as_int("dst", dst, lo=0)
    n = len(data)
    if n > MAX_MESSAGE:  # refused before a byte moves: the receiver would refuse the length
        raise DistError(f"a message of {n} bytes to rank {dst} exceeds {MAX_MESSAGE}")
    dev = wire_device(group)
    dist.send(torch.tensor([n], dtype=torch.int64, device=dev), dst, group=group)
    if n:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.send(t.to(dev) if dev.type != "cpu" else t, dst, group=group)


def recv_bytes(src: int, group: Any = None) -> bytes:
    src = as_int("src", src, lo=0)
    dev = wire_device(group)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(n, src, group=group)
    size = int(n.item())
    if not 0 <= size <= MAX_MESSAGE:
        raise DistError(f"message from rank {src} announces {size} bytes, outside "
                        f"[0, {MAX_MESSAGE}]: not a ninfer-kv peer or a damaged stream")
    if not size:
        return b""
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.recv(buf, src, group=group)
    return buf.cpu().numpy().tobytes()


def sender(peers: Sequence[int], group: Any = None) -> Callable[[bytes], None]:
    """A ``send(message)`` that delivers to every rank of ``peers``, in order. A rank whose
    send fails does not keep the message from the ranks after it (a review found a dead rank
    early in the list hiding the leader's FAILED message from every later one, which then
    waited for the group's timeout): every rank is tried, then the failure is raised."""
    ranks = [as_int("peer", p, lo=0) for p in peers]

    def send(message: bytes) -> None:
        failed: list[tuple[int, Exception]] = []
        for r in ranks:
            try:
                send_bytes(message, r, group)
            except Exception as exc:  # noqa: BLE001 - the link: the next rank still gets it
                failed.append((r, exc))
        if failed:
            r, exc = failed[0]
            bad = [x for x, _ in failed]
            raise SendFailed(f"send to ranks {bad} failed (rank {r}: {type(exc).__name__}: "
                             f"{exc})", bad) from exc
    return send


class Receiver:
    """``receive()`` of the next message from rank ``src`` (which a Leader reads acks by: a
    rank its send failed to has no ack to read)."""

    __slots__ = ("src", "group")

    def __init__(self, src: int, group: Any = None) -> None:
        self.src, self.group = as_int("src", src, lo=0), group

    def __call__(self) -> bytes:
        return recv_bytes(self.src, self.group)


def receiver(src: int, group: Any = None) -> Receiver:
    return Receiver(src, group)
