"""Checkpoint transfer between stores over torch.distributed (prefill/decode disaggregation).

``export(store, ck, dst)`` on the sending rank and ``import_(store, src)`` on the receiving
rank move one inactive checkpoint: its metadata, frontier per pool, and the bytes of its pages
in logical order — every plane of every layer, as the host tier lays a page out (§5.3,
"HostKVPageLayout": no device ids, no holes). A chunk of whole pages travels as one tensor per
plane, then the CRC-32C of each page: zero-copy views of the planes when the pages are
consecutive page groups (dist/packing.py), staging copies otherwise; two chunks are in flight.

The receiver follows the §5.3 publication order across machines::

    header -> geometry check -> activate + map (reserve destination) -> "ready"
    -> recv every chunk, verify each page's CRC, write it into its page group (copy, verify)
    -> commit + finish(retain=True)  (publish)  -> "done" with the new checkpoint id

Until ``finish(retain=True)`` the pages belong to an *active* sequence, which a restart never
keeps: a crash of either side mid-transfer leaves the receiver without the checkpoint. A failed
recv (the peer dropped) or a CRC mismatch aborts: the sequence finishes without retain and every
page and row it held goes back to the pools; nothing is published.

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
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist

from ninfer_kv.dist.errors import TransferAborted, TransferCorrupt, TransferError, TransferRefused
from ninfer_kv.dist.packing import crcs, gather, scatter, stage, targets
from ninfer_kv.dist.wire import recv_bytes, send_bytes, wire_device
from ninfer_kv.engine import host
from ninfer_kv.engine.layout import P, ceil_div
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError, StoreClosed

log = structlog.get_logger(__name__)

MAGIC, VERSION = "NKVT", 1
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


def _status(peer: int, group: Any, **fields: Any) -> None:
    send_bytes(msgspec.msgpack.encode(fields), peer, group)


def _recv_status(peer: int, group: Any, what: str) -> dict[str, Any]:
    s = msgspec.msgpack.decode(recv_bytes(peer, group))
    if not s.get("ok"):
        kind = {"corrupt": TransferCorrupt, "aborted": TransferAborted}.get(
            s.get("kind", ""), TransferRefused)
        raise kind(f"rank {peer} refused the {what}: {s.get('error', '?')}")
    return s  # type: ignore[no-any-return]


# --- sender -----------------------------------------------------------------------------------
def export(store: KVStore, checkpoint: int, dst: int, *, group: Any = None,
           chunk_bytes: int = DEFAULT_CHUNK, on_chunk: ChunkHook | None = None
           ) -> TransferReport:
    """Send inactive ``checkpoint`` to rank ``dst`` (which runs ``import_``); returns once the
    receiver published it. The sending store is only read."""
    ck, dst = operator.index(checkpoint), operator.index(dst)
    chunk_bytes = operator.index(chunk_bytes)
    if store.closed:
        raise StoreClosed("export refused: the store is closed")
    t0 = time.perf_counter()
    try:
        pools = _pages_of(store, ck)
    except TransferRefused as exc:  # tell the receiver, which is waiting for a header
        with contextlib.suppress(RuntimeError):
            send_bytes(msgspec.msgpack.encode({"magic": MAGIC, "version": VERSION,
                                               "refused": str(exc)}), dst, group)
        raise
    b = store.state.bundles[ck]
    pbs = {s.name: s.page_bytes for s in store.state.pool_specs}
    per = {n: max(1, chunk_bytes // pbs[n]) for n, _, _ in pools}
    header = {"magic": MAGIC, "version": VERSION, "checkpoint": ck, "layout": layout_of(store),
              "reason": b.finish_reason, "meta": bytes(b.meta),
              "pools": [[n, f, len(pages), pbs[n], per[n]] for n, f, pages in pools]}
    try:
        send_bytes(msgspec.msgpack.encode(header), dst, group)
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
                for w in inflight[slot]:  # staging `slot` may hold the chunk before last
                    w.wait()
                chunk: list[torch.Tensor] | None = None
                if failed is None:
                    try:
                        chunk = gather(store, name, pages[a:a + k], slot, dev)
                        if on_chunk is not None:
                            on_chunk(name, ci, chunk)
                    except Exception as exc:  # ours, not the wire's: owe the rest, "aborted"
                        failed, chunk = exc, None
                if chunk is None:
                    chunk = [t.zero_() for t in stage(store, name, k, slot, dev)]
                # the bytes go first; their CRCs are computed while they are on the wire
                works = [dist.isend(c, dst, group=group) for c in chunk]
                sums = torch.tensor(crcs(chunk) if failed is None else [ABORTED] * k,
                                    dtype=torch.int64, device=dev)
                inflight[slot] = [*works, dist.isend(sums, dst, group=group)]
                chunks += 1
                moved += k * pb
            for ws in inflight:
                for w in ws:
                    w.wait()
        if failed is not None:
            with contextlib.suppress(KVStoreError):
                _recv_status(dst, group, "checkpoint")  # the receiver's "aborted"
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


# --- receiver ---------------------------------------------------------------------------------
Pools = list[tuple[str, int, int, int, int]]
"""(pool, frontier, pages, page bytes, pages per chunk) as the header announces them."""
MAX_CHUNK = 1 << 30


def _check_header(store: KVStore, h: dict[str, Any]) -> Pools:
    if (h.get("magic"), h.get("version")) != (MAGIC, VERSION):
        raise TransferRefused(f"header magic/version {h.get('magic')!r}/{h.get('version')} != "
                              f"{MAGIC!r}/{VERSION}")
    mine = layout_of(store)
    differ = [f"{k}: sender {h['layout'].get(k)!r} != receiver {mine[k]!r}" for k in mine
              if h["layout"].get(k) != mine[k]]
    if differ:
        raise TransferRefused("the sender's page layout differs, its bytes would be read as "
                              "another model's KV (§4.3, §4.4): " + "; ".join(differ))
    pools = [(str(n), int(f), int(k), int(pb), int(c)) for n, f, k, pb, c in h["pools"]]
    if sorted(n for n, *_ in pools) != sorted(store.pools):
        raise TransferRefused(f"sender pools {[n for n, *_ in pools]} != receiver pools "
                              f"{list(store.pools)} (a continuation needs every pool, §8.3)")
    for n, f, k, pb, c in pools:
        if not 1 <= c * pb <= MAX_CHUNK or pb != mine["pools"][n]["page_bytes"]:
            raise TransferRefused(f"pool {n}: chunks of {c} pages x {pb} B outside "
                                  f"[1, {MAX_CHUNK}] B or page bytes not the receiver's")
        if k != ceil_div(f, P):
            raise TransferRefused(f"pool {n}: {k} pages for frontier {f}; a retained "
                                  f"checkpoint holds ceil({f}/{P}) = {ceil_div(f, P)} (§8.2)")
    return pools


def _reserve(store: KVStore, pools: Pools) -> int:
    """Activate a sequence (reserve + row lease, §7.3) and map every page it will hold."""
    top = max(f for _, f, *_ in pools)
    seq = store.activate(top, 0 if top else 1)
    try:
        for n, f, *_ in pools:
            if f:
                store.ensure_mapped(seq, n, f)
    except BaseException:
        _abort(store, seq)
        raise
    return seq


def _abort(store: KVStore, seq: int) -> None:
    """Finish without retain and publish: every page and row the sequence held is free."""
    try:
        store.finish(seq, retain=False, reason="transfer aborted")
        with store.boundary():
            pass
    except KVStoreError as exc:  # a failed store frees nothing more; reopen recovers
        log.error("transfer.abort_failed", seq=seq, error=str(exc))


def _receive(store: KVStore, seq: int, pools: Pools, src: int, group: Any,
             on_chunk: ChunkHook | None) -> tuple[int, int, str | None]:
    """Receive every chunk (double buffered) into the sequence's pages (in place when they are
    consecutive, else through staging), verify each page's CRC. Returns (bytes, chunks, the
    first CRC mismatch or None); after a mismatch the rest is drained and nothing published
    (the pages belong to the unpublished sequence, which the caller then frees)."""
    dev = wire_device(group)
    plan = []
    for n, _, k, pb, per in pools:
        ids = [store.state.pools[n].pages[s].device  # type: ignore[union-attr]
               for s in store.space(seq, n).members]
        plan += [(n, a, ids[a:a + min(per, k - a)], pb) for a in range(0, k, per)]
    posted: dict[int, tuple[torch.Tensor, list[torch.Tensor], bool, list[Any]]] = {}
    failed: BaseException | None = None  # ours, not the wire's: drain, then raise it

    def post(ci: int) -> None:
        """Post chunk ``ci``'s receives: into its pages (or staging) while all is well, into
        staging to drain it once this side failed. Only the receives are the wire's."""
        nonlocal failed
        name, _, ids, _ = plan[ci]
        if failed is None:
            try:
                sums = torch.empty(len(ids), dtype=torch.int64, device=dev)
                chunk, in_place = targets(store, name, ids, ci % 2, dev)
            except Exception as exc:  # e.g. staging could not grow: drain from here on
                failed = exc
        if failed is not None:
            try:
                sums = torch.empty(len(ids), dtype=torch.int64, device=dev)
                chunk, in_place = stage(store, name, len(ids), ci % 2, dev), False
            except Exception as exc:  # cannot even drain: the wire cannot stay in step
                raise _WireError(f"cannot drain chunk {ci}: {exc!r}") from exc
        try:
            works = [dist.irecv(c, src, group=group) for c in chunk]
            works.append(dist.irecv(sums, src, group=group))
        except RuntimeError as exc:
            raise _WireError(str(exc)) from exc
        posted[ci] = (sums, chunk, in_place, works)

    bad: str | None = None
    moved = 0
    if plan:
        post(0)
    for ci, (name, a, ids, pb) in enumerate(plan):
        sums, chunk, in_place, works = posted.pop(ci)
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:  # the wire: nothing more will arrive
            raise _WireError(str(exc)) from exc
        if ci + 1 < len(plan):
            post(ci + 1)
        moved += len(ids) * pb
        if bad is not None or failed is not None:
            continue
        try:
            idx = ci - next(i for i, c in enumerate(plan) if c[0] == name)
            if on_chunk is not None:
                on_chunk(name, idx, chunk)
            want = sums.cpu().tolist()
            if min(want) < 0:
                bad = f"the sender aborted at pool {name} block {a}"
                continue
            got = crcs(chunk)
            for i, (g, w) in enumerate(zip(got, [x & 0xFFFFFFFF for x in want], strict=True)):
                if g != w:
                    bad = (f"pool {name} block {a + i}: CRC-32C {g:#010x} of the received "
                           f"bytes != sender's {w:#010x}")
                    break
            if bad is None and not in_place:
                scatter(store, name, ids, chunk)
        except Exception as exc:
            failed = exc
    if failed is not None:
        raise failed
    return moved, len(plan), bad


class _WireError(RuntimeError):
    """A recv failed: the peer is gone or the group timed out."""


def import_(store: KVStore, src: int, *, group: Any = None, on_chunk: ChunkHook | None = None
            ) -> TransferReport:
    """Receive one checkpoint from rank ``src`` (running ``export``) and publish it in
    ``store`` once every page verified; returns the report with the new checkpoint id."""
    src = operator.index(src)
    if store.closed:
        raise StoreClosed("import_ refused: the store is closed")
    if store.record_hook is not None:
        raise TransferRefused("import_ refused: this store streams its records to TP followers "
                              "(a Leader), which would get the checkpoint without its bytes")
    try:
        h = msgspec.msgpack.decode(recv_bytes(src, group))
    except RuntimeError as exc:
        raise TransferAborted(f"import from rank {src}: no header ({exc})") from exc
    except msgspec.DecodeError as exc:
        raise TransferRefused(f"import from rank {src}: the header does not decode ({exc})"
                              ) from None
    if isinstance(h, dict) and h.get("refused"):  # the sender refused before any byte moved
        raise TransferRefused(f"rank {src} refused the export: {h['refused']}")
    t0 = time.perf_counter()  # from the header's arrival: waiting for a sender is not transfer
    try:
        try:
            pools = _check_header(store, h)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TransferRefused(f"import from rank {src}: malformed header ({exc!r})"
                                  ) from None
        seq = _reserve(store, pools)
    except KVStoreError as exc:
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, kind="refused", error=f"{type(exc).__name__}: {exc}")
        if isinstance(exc, TransferError):
            raise
        raise TransferRefused(f"import from rank {src}: {type(exc).__name__}: {exc}") from exc
    try:
        _status(src, group, ok=True)
        with store.boundary():  # tables published; the pages are this sequence's alone
            moved, chunks, bad = _receive(store, seq, pools, src, group, on_chunk)
    except BaseException as exc:
        _abort(store, seq)
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if not isinstance(exc, _WireError):  # every chunk arrived: the sender waits for this
            with contextlib.suppress(RuntimeError):
                _status(src, group, ok=False, kind="aborted", error=why)
        raise TransferAborted(f"import from rank {src} aborted mid-transfer, nothing published "
                              f"and every reserved page freed: {why}") from exc
    if bad is not None:
        _abort(store, seq)
        kind = "aborted" if bad.startswith("the sender aborted") else "corrupt"
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, kind=kind, error=bad)
        if kind == "aborted":
            raise TransferAborted(f"import from rank {src}: {bad}; checkpoint not published, "
                                  "its pages freed")
        raise TransferCorrupt(f"import from rank {src}: {bad}; checkpoint not published, its "
                              "pages freed (§5.3: verify before publish)")
    try:
        ck = _publish(store, seq, pools, h)
    except BaseException as exc:  # the sender waits for an answer: give it one
        b = store.state.bundles.get(seq)
        if b is not None and b.active and not store.closed:  # not retained: free it
            _abort(store, seq)
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, kind="aborted",
                    error=f"publication failed: {type(exc).__name__}: {exc}")
        raise
    with contextlib.suppress(RuntimeError):
        _status(src, group, ok=True, checkpoint=ck)
    dt = time.perf_counter() - t0
    n = sum(k for _, _, k, *_ in pools)
    log.info("transfer.imported", checkpoint=ck, src=src, pages=n, bytes=moved, seconds=dt)
    return TransferReport(ck, int(h["checkpoint"]), n, moved, chunks, dt)


def _publish(store: KVStore, seq: int, pools: Pools, h: dict[str, Any]) -> int:
    """Commit the frontiers, attach the metadata, retain: one record (publication)."""
    if store.config.checked:  # every committed position was written, in every layer
        for n, f, *_ in pools:
            for layer in range(len(store.device.pools[n].planes)):
                store._written.setdefault((n, seq, layer), set()).update(range(f))
    for n, f, *_ in pools:
        if f:
            store.commit(seq, n, f)
    if h.get("meta"):
        store.set_metadata(seq, msgspec.msgpack.decode(h["meta"]))
    reason = h.get("reason")
    store.finish(seq, retain=True, reason="imported" if reason is None else str(reason))
    with store.boundary():
        pass
    return seq
