"""The receiving side of a checkpoint transfer: ``import_`` (see ``dist/transfer.py`` for the
protocol, the §5.3 publication order across machines and how a failing side aborts both)."""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist

from ninfer_kv.dist.errors import (
    DistError,
    TransferAborted,
    TransferCorrupt,
    TransferError,
    TransferRefused,
)
from ninfer_kv.dist.packing import (
    crcs,
    in_place_views,
    retire_staging,
    scatter,
    stage,
    targets,
)
from ninfer_kv.dist.transfer import (
    MAGIC,
    VERSION,
    ChunkHook,
    TransferReport,
    _status,
    layout_of,
    recv_control,
)
from ninfer_kv.dist.wire import wire_device
from ninfer_kv.engine.args import as_int, finish_reason
from ninfer_kv.engine.layout import P, ceil_div
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import InvalidArgument, KVStoreError, StoreClosed
from ninfer_kv.journal import events as ev

log = structlog.get_logger(__name__)

Pools = list[tuple[str, int, int, int, int]]
"""(pool, frontier, pages, page bytes, pages per chunk) as the header announces them."""
MAX_CHUNK = 1 << 30
SETTLE_S = 2.0
"""After the wire failed, how long in all the receives still posted get to end
(``_unended``) before the store stops rather than free pages they may write into."""


def _check_header(store: KVStore, h: dict[str, Any]) -> Pools:
    if (h.get("magic"), h.get("version")) != (MAGIC, VERSION):
        raise TransferRefused(f"header magic/version {h.get('magic')!r}/{h.get('version')} != "
                              f"{MAGIC!r}/{VERSION}")
    # every field is checked before anything is reserved: none may fail after publication
    if type(h.get("checkpoint")) is not int or not isinstance(h.get("meta", b""), bytes) \
            or not isinstance(h.get("reason"), str | None):
        raise TransferRefused(f"header fields checkpoint={h.get('checkpoint')!r}, "
                              f"reason={h.get('reason')!r}, meta of type "
                              f"{type(h.get('meta')).__name__}: an int, a str or nil, bytes")
    if h.get("meta"):
        try:  # as _publish's set_metadata will encode it again (and as its refusals)
            size = len(msgspec.msgpack.encode(msgspec.msgpack.decode(h["meta"])))
        except (msgspec.MsgspecError, RecursionError, TypeError, ValueError,
                OverflowError) as exc:  # RecursionError: nested past msgspec's depth
            raise TransferRefused(f"header metadata does not decode, or encode again "
                                  f"({type(exc).__name__}: {exc})") from None
        if size > ev.METADATA_MAX:
            raise TransferRefused(f"header metadata of {size} bytes > METADATA_MAX="
                                  f"{ev.METADATA_MAX}")
    if h.get("reason") is not None:  # as _publish's finish will journal it
        try:
            finish_reason(h["reason"])
        except InvalidArgument as exc:
            raise TransferRefused(f"header reason refused: {exc}") from None
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
        if not store.device.pools[n].planes:  # nothing to receive the bytes into (§5.3)
            raise TransferRefused(f"import: pool {n} has no planes (allocate_planes=False)")
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


def _unended(works: list[Any], timeout: float | None) -> list[Any]:
    """Of ``works`` (receives posted and not waited for), those still pending after each
    was waited on. ``timeout`` (the wire failed): for what is left of that many seconds in
    all — gloo reports a receive on a failed connection as ended only once waited on, and
    that wait raises at once; a wait that times out closes the connection, so no byte lands
    after it (both measured with torch 2.13). ``None`` (the wire is sound, this side
    failed): each until it ends, as the sender is still sending (the group's timeout bounds
    a wait); from a wait that fails on, as for a failed wire."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for w in works:
        if w.is_completed():
            continue
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
        try:
            if deadline is None:
                w.wait()
            else:  # a timeout of 0 would mean none: at least 10 ms
                w.wait(datetime.timedelta(seconds=max(0.01, left)))
        except RuntimeError:
            if deadline is None:
                deadline = time.monotonic() + SETTLE_S
    return [w for w in works if not w.is_completed()]


def _abort_when_safe(store: KVStore, seq: int, outstanding: list[tuple[Any, bool]],
                     wire_failed: bool) -> str:
    """``_abort`` once no receive the failed import posted can still write: ``outstanding``
    holds those it had not waited for, each with whether it writes into the sequence's
    pages (else into staging). One still pending into a page after ``_unended`` stops the
    store instead (fail-stop: freed, the page group would go to another request while a
    late byte may still land in it; a reopen gets new planes, and the pending receive keeps
    the old ones alive). One still pending into staging only retires the staging buffers.
    An interrupt while waiting stops the store too: whether they end is then unknown.
    Returns what happened, for the error message."""
    try:
        left = set(map(id, _unended([w for w, _ in outstanding],
                                    SETTLE_S if wire_failed else None)))
    except BaseException as exc:
        store._fail("import_", exc)  # noqa: SLF001 - fail-stop, as ``command`` does
        raise
    into_pages = sum(1 for w, in_place in outstanding if in_place and id(w) in left)
    if left:
        retire_staging()  # a late byte may land in the old buffers: fresh ones next
    if into_pages:
        why = (f"{into_pages} receives posted into seq {seq}'s pages were still pending "
               f"{SETTLE_S} s after the wire failed: freed, its page groups would go to "
               "another request while a late byte may still land in them")
        store._fail("import_", TransferAborted(why))  # noqa: SLF001 - see the docstring
        log.error("transfer.store_stopped", seq=seq, pending_receives=into_pages)
        return f"the store stopped (a reopen recovers it): {why}"
    _abort(store, seq)
    return ("every reserved page freed" if store.failed is None else
            "the store stopped (its reopen drops the reservation)")


def _abort(store: KVStore, seq: int) -> None:
    """Finish without retain and publish: every page and row the sequence held is free."""
    try:
        store.finish(seq, retain=False, reason="transfer aborted")
        with store.boundary():
            pass
    except KVStoreError as exc:  # a failed store frees nothing more; reopen recovers
        log.error("transfer.abort_failed", seq=seq, error=str(exc))


def _receive(store: KVStore, seq: int, pools: Pools, src: int, group: Any,
             on_chunk: ChunkHook | None, outstanding: list[tuple[Any, bool]],
             failed: BaseException | None = None) -> tuple[int, int, str | None]:
    """Receive every chunk (double buffered) into the sequence's pages (in place when they are
    consecutive, else through staging), verify each page's CRC. Returns (bytes, chunks, the
    first CRC mismatch or None); after a mismatch the rest is drained and nothing published
    (the pages belong to the unpublished sequence, which the caller then frees). ``failed``:
    this side failed before the first chunk — drain them all, then raise it. Whatever it
    raises, the receives it posted and did not wait for are added to ``outstanding``, each
    with whether it writes into the sequence's pages (else into staging)."""
    dev = wire_device(group)
    plan = []
    for n, _, k, pb, per in pools:
        ids = [store.state.pools[n].pages[s].device  # type: ignore[union-attr]
               for s in store.space(seq, n).members]
        plan += [(n, a, ids[a:a + min(per, k - a)], pb) for a in range(0, k, per)]
    posted: dict[int, tuple[torch.Tensor, list[torch.Tensor], bool, list[Any]]] = {}
    # ``failed``: ours, not the wire's: drain, then raise it

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
        works: list[Any] = []
        posted[ci] = (sums, chunk, in_place, works)  # each receive listed once it is posted
        try:
            for c in (*chunk, sums):
                works.append(dist.irecv(c, src, group=group))
        except RuntimeError as exc:
            raise _WireError(str(exc)) from exc

    def verify(name: str, ci: int, a: int, ids: list[int], sums: torch.Tensor,
               chunk: list[torch.Tensor], in_place: bool) -> str | None:
        """Check chunk ``ci``'s pages against the sender's CRCs; write them from staging.
        Returns why it is refused, or None."""
        if on_chunk is not None:
            on_chunk(name, ci - next(i for i, c in enumerate(plan) if c[0] == name), chunk)
        want = sums.cpu().tolist()
        if min(want) < 0:
            return f"the sender aborted at pool {name} block {a}"
        for i, (g, w) in enumerate(zip(crcs(chunk), want, strict=True)):
            if g != w & 0xFFFFFFFF:
                return (f"pool {name} block {a + i}: CRC-32C {g:#010x} of the received bytes "
                        f"!= sender's {w & 0xFFFFFFFF:#010x}")
        if not in_place:
            scatter(store, name, ids, chunk)
        return None

    bad: str | None = None
    moved = 0
    # every chunk lands in its pages: post every receive now; else two at a time (staging)
    ahead = len(plan) if failed is None and all(in_place_views(store, n, ids, dev) is not None
                                                for n, _, ids, _ in plan) else 2
    try:
        for ci in range(min(ahead, len(plan))):
            post(ci)
        for ci, (name, a, ids, pb) in enumerate(plan):
            sums, chunk, in_place, works = posted[ci]
            try:
                for w in works:
                    w.wait()
            except RuntimeError as exc:  # the wire: nothing more will arrive
                raise _WireError(str(exc)) from exc
            del posted[ci]
            moved += len(ids) * pb
            if bad is None and failed is None:
                try:
                    bad = verify(name, ci, a, ids, sums, chunk, in_place)
                except Exception as exc:
                    failed = exc
            if ahead == 2 and ci + 2 < len(plan):  # staging slot ci % 2 is free again
                post(ci + 2)
    except BaseException:  # what the caller may not free before these receives end
        outstanding.extend((w, in_place) for _, _, in_place, works in posted.values()
                           for w in works)
        raise
    if failed is not None:
        raise failed
    return moved, len(plan), bad


class _WireError(RuntimeError):
    """A recv failed: the peer is gone or the group timed out."""


def import_(store: KVStore, src: int, *, group: Any = None, on_chunk: ChunkHook | None = None
            ) -> TransferReport:
    """Receive one checkpoint from rank ``src`` (running ``export``) and publish it in
    ``store`` once every page verified; returns the report with the new checkpoint id."""
    src = as_int("src", src, lo=0)
    if store.closed:
        raise StoreClosed("import_ refused: the store is closed")
    if store.record_hook is not None:
        raise TransferRefused("import_ refused: this store streams its records to TP followers "
                              "(a Leader), which would get the checkpoint without its bytes")
    try:
        h = recv_control(src, group, "header")
    except RuntimeError as exc:
        raise TransferAborted(f"import from rank {src}: no header ({exc})") from exc
    except DistError as exc:  # damaged, not a map, a bad length: answer (every header gets one)
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, error=str(exc),
                    kind="corrupt" if isinstance(exc, TransferCorrupt) else "refused")
        raise
    if h.get("refused"):  # the sender refused before any byte moved; it waits for the answer
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, kind="refused", error="the export was refused")
        raise TransferRefused(f"rank {src} refused the export: {h['refused']}")
    t0 = time.perf_counter()  # from the header's arrival: waiting for a sender is not transfer
    try:
        try:
            pools = _check_header(store, h)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError,
                RecursionError) as exc:  # RecursionError is a RuntimeError, not the wire's
            raise TransferRefused(f"import from rank {src}: malformed header ({exc!r})"
                                  ) from None
        seq = _reserve(store, pools)
    except KVStoreError as exc:
        with contextlib.suppress(RuntimeError):
            _status(src, group, ok=False, kind="refused", error=f"{type(exc).__name__}: {exc}")
        if isinstance(exc, TransferError):
            raise
        raise TransferRefused(f"import from rank {src}: {type(exc).__name__}: {exc}") from exc
    outstanding: list[tuple[Any, bool]] = []  # receives posted, not waited for: (work, in place)
    try:
        _status(src, group, ok=True)
        boundary = store.boundary()  # tables published; the pages are this sequence's alone
        try:
            boundary.__enter__()
        except BaseException as exc:  # the sender is sending already: keep the wire in step
            _receive(store, seq, pools, src, group, None, outstanding, exc)  # drains, raises
            raise
        try:
            moved, chunks, bad = _receive(store, seq, pools, src, group, on_chunk, outstanding)
        finally:
            boundary.__exit__(None, None, None)
    except BaseException as exc:
        freed = _abort_when_safe(store, seq, outstanding, isinstance(exc, _WireError))
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if not isinstance(exc, _WireError):  # every chunk arrived: the sender waits for this
            with contextlib.suppress(RuntimeError):
                _status(src, group, ok=False, kind="aborted", error=why)
        raise TransferAborted(f"import from rank {src} aborted mid-transfer, nothing published "
                              f"and {freed}: {why}") from exc
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
