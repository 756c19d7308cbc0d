"""Checkpoint transfer between stores over torch.distributed (prefill/decode disaggregation).

``export(store, ck, dst)`` on the sending rank and ``import_(store, src)`` on the receiving
rank move one inactive checkpoint: its metadata, frontier per pool, and the bytes of its pages
in logical order — every plane of every layer, as the host tier lays a page out (§5.3,
"HostKVPageLayout": no device ids, no holes). A chunk of whole pages travels as one tensor per
plane, then the CRC-32C of each page: zero-copy views of the planes when the pages are
consecutive page groups (dist/packing.py), staging copies otherwise. Zero-copy chunks are
all posted at once (they need no buffer; the sender checksums each while the next are on the
wire, the receiver posts every receive up front when all its chunks land in place); staged
chunks go two at a time.

The receiver follows the §5.3 publication order across machines::

    header -> geometry check -> activate + map (reserve destination) -> "ready"
    -> recv every chunk, verify each page's CRC, write it into its page group (copy, verify)
    -> commit + finish(retain=True)  (publish)  -> "done" with the new checkpoint id

Until ``finish(retain=True)`` the pages belong to an *active* sequence, which a restart never
keeps: a crash of either side mid-transfer leaves the receiver without the checkpoint. A failed
recv (the peer dropped) or a CRC mismatch aborts: the sequence finishes without retain and every
page and row it held goes back to the pools; nothing is published. Not while a receive posted
into those pages may still write: the abort waits on each first (``receive._unended``), and
one still pending stops the receiving store rather than hand its page groups on.

A side that fails by itself mid-transfer (an exception that is not the wire's) keeps the wire
in step instead of leaving its peer blocked until the group's timeout: the receiver drains the
chunks still coming, then answers "aborted" with its reason; the sender sends the chunks it
still owes as zeros with the CRC ``-1`` (no CRC-32C is negative), which the receiver reads as
"the sender aborted". Both raise ``TransferAborted`` naming the side that failed and why, and
the next transfer on the same group starts clean.

Gloo moves CPU tensors (pages are packed to the CPU); on an NCCL group the chunks stay on the
CUDA device (the CRC is then computed on a host copy).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist

from ninfer_kv.dist.errors import TransferAborted, TransferCorrupt, TransferRefused
from ninfer_kv.dist.packing import crcs, direct, gather, stage
from ninfer_kv.dist.stream import seal, unseal
from ninfer_kv.dist.wire import recv_bytes, send_bytes, wire_device
from ninfer_kv.engine import host
from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError, StoreClosed

log = structlog.get_logger(__name__)

MAGIC, VERSION = "NKVT", 3  # 1: header and status messages without a CRC; 2: a refusal
# and a damaged header went unanswered (now every header gets exactly one answer)
ABORTED = -1
"""The CRC a sender sends for each page of a chunk it could not produce (it failed mid-transfer)."""
DEFAULT_CHUNK = 16 << 20
"""Bytes per chunk (rounded down to whole pages, at least one page)."""
ChunkHook = Callable[[str, int, list[torch.Tensor]], None]
"""Called as (pool, chunk index, the chunk's per-plane ``[pages, H, row bytes]`` tensors) — on
the sender after gathering, on the receiver after arrival and before verification."""


@dataclass(frozen=True, slots=True)
class TransferReport:
    checkpoint: int      # the checkpoint id on this side (sender: exported; receiver: new)
    remote: int          # the checkpoint id on the other side
    pages: int
    bytes: int           # page payload bytes moved
    chunks: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def layout_of(store: KVStore) -> dict[str, Any]:
    """What the packed bytes of a page depend on: page size, profile, model geometry and, per
    pool, page bytes, plane order, layers and planes (§4.3, §4.4). Capacity (M, C, S) may
    differ between the two stores."""
    d = store.plan.to_dict()
    pools = {n: {k: v for k, v in p.items() if k in ("page_bytes", "order", "layers", "planes")}
             for n, p in d["pools"].items()}  # type: ignore[union-attr]
    return {"P": d["P"], "profile": d["profile"], "model": d["model"], "pools": pools}


def _pages_of(store: KVStore, ck: int) -> list[tuple[str, int, list[LogicalKVPage]]]:
    st = store.state
    if store._effects:
        # a queued COW tail copy or H2D restore may be what gives these pages their bytes
        # (§9.3, §5.3): the planes hold them only after the boundary runs it
        raise TransferRefused(f"export of {ck}: {len(store._effects)} device copies are queued "
                              "for the next boundary; publish it (close a boundary) first")
    b = st.bundles.get(ck)
    if b is None or b.active:
        raise TransferRefused(f"export: {ck} is not an inactive checkpoint (active sequences "
                              "are not transferred: finish(retain=True) first, §8.3)")
    out = []
    for name in b.pools:
        p = st.pools[name]
        sp = p.spaces[ck]
        pages = [p.pages[s] for s in sp.members]
        if not store.device.pools[name].planes:
            raise TransferRefused(f"export: pool {name} has no planes (allocate_planes=False)")
        for i, pg in enumerate(pages):
            assert pg is not None
            if pg.device == NO_PAGE and not (store.arena is not None
                                             and host.replica_valid(pg, pg.committed)):
                raise TransferRefused(f"export: checkpoint {ck} pool {name} block {i} has "
                                      "neither a device nor a valid host replica (§5.1)")
        out.append((name, sp.committed, pages))  # type: ignore[arg-type]
    return out


def send_control(fields: dict[str, Any], peer: int, group: Any) -> None:
    """A header or status message: msgpack, sealed with its CRC-32C (as the TP stream's
    messages, dist/stream.py) — a flipped bit in a frontier or the metadata is damage, never
    a value the receiver publishes (§5.3: verify before publish)."""
    send_bytes(seal(msgspec.msgpack.encode(fields)), peer, group)


def recv_control(peer: int, group: Any, what: str) -> dict[str, Any]:
    """The next control message from ``peer``: ``TransferCorrupt`` when its CRC fails,
    ``TransferRefused`` when it is not a msgpack map."""
    data = recv_bytes(peer, group)
    body = unseal(data)
    if body is None:
        raise TransferCorrupt(f"the {what} from rank {peer} ({len(data)} bytes) fails its "
                              "CRC-32C: damaged in transit")
    try:
        out = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:  # a RuntimeError, not the wire's
        raise TransferRefused(f"the {what} from rank {peer} does not decode ({exc})") from None
    if not isinstance(out, dict):
        raise TransferRefused(f"the {what} from rank {peer} is a {type(out).__name__}, not a map")
    return out


def _status(peer: int, group: Any, **fields: Any) -> None:
    send_control(fields, peer, group)


def _recv_status(peer: int, group: Any, what: str) -> dict[str, Any]:
    s = recv_control(peer, group, f"answer to the {what}")
    if not s.get("ok"):
        kind = {"corrupt": TransferCorrupt, "aborted": TransferAborted}.get(
            s.get("kind", ""), TransferRefused)
        raise kind(f"rank {peer} refused the {what}: {s.get('error', '?')}")
    return s  # type: ignore[no-any-return]


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()
    works.clear()


# --- sender -----------------------------------------------------------------------------------
def export(store: KVStore, checkpoint: int, dst: int, *, group: Any = None,
           chunk_bytes: int = DEFAULT_CHUNK, on_chunk: ChunkHook | None = None
           ) -> TransferReport:
    """Send inactive ``checkpoint`` to rank ``dst`` (which runs ``import_``); returns once the
    receiver published it. The sending store is only read."""
    ck, dst = as_int("checkpoint", checkpoint), as_int("dst", dst, lo=0)
    chunk_bytes = as_int("chunk_bytes", chunk_bytes, lo=1)
    if store.closed:
        raise StoreClosed("export refused: the store is closed")
    t0 = time.perf_counter()
    try:
        pools = _pages_of(store, ck)
    except TransferRefused as exc:  # tell the receiver, which is waiting for a header
        with contextlib.suppress(KVStoreError, RuntimeError):
            send_control({"magic": MAGIC, "version": VERSION, "refused": str(exc)}, dst,
                         group)
            # every header gets one answer, a refusal too: the receiver cannot tell a damaged
            # refusal from a damaged header, which the sender of a header waits on
            _recv_status(dst, group, "refusal")
        raise
    b = store.state.bundles[ck]
    pbs = {s.name: s.page_bytes for s in store.state.pool_specs}
    per = {n: max(1, chunk_bytes // pbs[n]) for n, _, _ in pools}
    header = {"magic": MAGIC, "version": VERSION, "checkpoint": ck, "layout": layout_of(store),
              "reason": b.finish_reason, "meta": bytes(b.meta),
              "pools": [[n, f, len(pages), pbs[n], per[n]] for n, f, pages in pools]}
    try:
        send_control(header, dst, group)
        _recv_status(dst, group, "header")
        dev = wire_device(group)
        chunks = moved = 0
        failed: BaseException | None = None
        for name, _, pages in pools:
            pb, step = pbs[name], per[name]
            inflight: list[list[Any]] = [[], []]
            for ci, a in enumerate(range(0, len(pages), step)):
                k = min(step, len(pages) - a)
                slot = ci % 2
                chunk: list[torch.Tensor] | None = None
                if failed is None:
                    try:  # views of the planes need no buffer; a staged chunk reuses `slot`
                        chunk = direct(store, name, pages[a:a + k], dev)
                        if chunk is None:
                            _wait(inflight[slot])  # which may hold the chunk before last
                            chunk = gather(store, name, pages[a:a + k], slot, dev)
                        if on_chunk is not None:
                            on_chunk(name, ci, chunk)
                    except Exception as exc:  # ours, not the wire's: owe the rest, "aborted"
                        failed, chunk = exc, None
                if chunk is None:
                    _wait(inflight[slot])
                    chunk = [t.zero_() for t in stage(store, name, k, slot, dev)]
                # the bytes go first; their CRCs are computed while they are on the wire
                works = [dist.isend(c, dst, group=group) for c in chunk]
                sums = torch.tensor(crcs(chunk) if failed is None else [ABORTED] * k,
                                    dtype=torch.int64, device=dev)
                inflight[slot] += [*works, dist.isend(sums, dst, group=group)]
                chunks += 1
                moved += k * pb
            for ws in inflight:
                for w in ws:
                    w.wait()
        if failed is not None:
            with contextlib.suppress(KVStoreError):
                _recv_status(dst, group, "checkpoint")  # the receiver's "aborted"
            if isinstance(failed, TransferCorrupt):  # a rotted host replica: said as such
                raise TransferCorrupt(f"export of checkpoint {ck} to rank {dst}, nothing "
                                      f"published: {failed}") from failed
            raise TransferAborted(f"export of checkpoint {ck} to rank {dst} failed on this "
                                  f"side mid-transfer, nothing published: "
                                  f"{type(failed).__name__}: {failed}") from failed
        done = _recv_status(dst, group, "checkpoint")
    except RuntimeError as exc:  # torch.distributed: the peer dropped, a timeout
        raise TransferAborted(f"export of checkpoint {ck} to rank {dst} failed mid-transfer: "
                              f"{' '.join(str(exc).split())[:300]}") from exc
    dt = time.perf_counter() - t0
    n = sum(len(p) for _, _, p in pools)
    log.info("transfer.exported", checkpoint=ck, dst=dst, pages=n, bytes=moved, seconds=dt)
    return TransferReport(ck, int(done["checkpoint"]), n, moved, chunks, dt)
