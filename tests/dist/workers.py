"""Process bodies for the 2-rank gloo tests (importable by torch.multiprocessing's spawn), and
the toy model both topologies run: random K/V/Q per layer from a seeded generator, the whole
head set drawn on every rank, each rank keeping its slice — so a TP=2 run and a single store
compute the same numbers."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig, append_kv, paged_decode
from ninfer_kv.dist import Follower, Leader, shard_config
from ninfer_kv.dist.wire import receiver, sender

LAYERS, HKV, HQ, D = 2, 4, 8, 64


def config(**kw: Any) -> StoreConfig:
    return StoreConfig(model=ModelGeometry(layers=LAYERS, kv_heads=HKV, head_dim=D),
                       serving=ServingConfig(max_context=256, max_concurrency=4),
                       kv_tokens=16 * 64, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(rank: int, port: int, world: int = 2) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))


def launch(target: Callable[..., None], *args: Any, timeout: float = 90.0) -> list[int | None]:
    """Run ``target(rank, port, *args)`` on 2 spawned processes; their exit codes."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


# --- the TP script ----------------------------------------------------------------------------
def unit(store: KVStore, seqs: list[int], starts: list[int], ends: list[int],
         gen: torch.Generator, rank: int, tp: int) -> list[torch.Tensor]:
    """One GPU unit: append every layer's new K/V (this rank's heads) and attend."""
    hs, qs = HKV // tp, HQ // tp
    flat = [s for s, a, e in zip(seqs, starts, ends, strict=True) for _ in range(e - a)]
    pos = torch.tensor([p for a, e in zip(starts, ends, strict=True) for p in range(a, e)],
                       dtype=torch.int32)
    rows = store.table_rows("main", flat)
    q = torch.randn(len(seqs), HQ, D, generator=gen)[:, rank * qs:(rank + 1) * qs]
    outs = []
    for layer in range(LAYERS):
        view = store.batch_view("main", layer)
        k, v = torch.randn(2, len(flat), HKV, D, generator=gen)[:, :, rank * hs:(rank + 1) * hs]
        append_kv(view, rows, pos, k.contiguous(), v.contiguous())
        outs.append(paged_decode(q.contiguous(), view, store.table_rows("main", seqs),
                                 torch.tensor(ends, dtype=torch.int32)))
    return outs


ARRIVALS = {0: [(70, 6), (40, 3)], 5: [(30, 2)]}
STEPS = 7


def plan_step(store: KVStore, step: int, running: dict[int, int], kept: list[int],
              host: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The leader's scheduler: admit, continue a checkpoint mid-page (Fork + COW), release.
    ``host``: the checkpoint is first offloaded and its device pages dropped (every rank
    copies its shard to its own arena), so the continuation restores them (H2D) first."""
    fresh = [(store.activate(p, o), p, o) for p, o in ARRIVALS.get(step, [])]
    fork = 4 if host else 3
    if host and step == 3:
        assert store.offload(kept[0], drop_device=True) > 0
    if step == fork:  # continue the 40-token request's checkpoint at 36: a partial-tail copy
        ck = kept[0]
        fresh.append((store.activate_from(ck, 36, 60, 2), 60, 2))
    if step == fork + 1:
        store.release(kept.pop(0))
    seqs, starts, ends = [], [], []
    for s in running:
        f = store.checkpoint_info(s).frontier
        seqs.append(s)
        starts.append(f)
        ends.append(f + 1)
    for s, prompt, out in fresh:
        f = store.checkpoint_info(s).frontier
        seqs.append(s)
        starts.append(f)
        ends.append(prompt)
        running[s] = out
    return seqs, starts, ends


def drive(store: KVStore, rank: int = 0, tp: int = 1, leader: Leader | None = None,
          follower: Follower | None = None, host: bool = False
          ) -> tuple[list[list[float]], list[str]]:
    """Run the script; returns (flattened attention outputs per step and layer, digests at
    every boundary). A follower takes the unit from the leader's note."""
    running: dict[int, int] = {}
    kept: list[int] = []
    outs: list[list[float]] = []
    digests: list[str] = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + step)
        if follower is None:
            seqs, starts, ends = plan_step(store, step, running, kept, host)
            store.ensure_mapped_many("main", seqs, ends)
            note = msgspec.msgpack.encode([seqs, starts, ends])
            ctx = leader.boundary(note) if leader is not None else store.boundary()
        else:
            s = follower.step()
            seqs, starts, ends = msgspec.msgpack.decode(s.note)
            ctx = contextlib.nullcontext()
        with ctx:
            digests.append(store.digest())
            for o in unit(store, seqs, starts, ends, gen, rank, tp):
                outs.append(o.flatten().tolist())
        if follower is None:
            store.commit_many("main", seqs, ends)
            for s in list(running):
                running[s] -= 1
                if running[s] == 0:
                    del running[s]
                    kept.append(store.finish(s, retain=True))  # type: ignore[arg-type]
    if leader is not None:
        leader.close()
        digests.append(store.digest())
    elif follower is not None:
        follower.step()  # the END message with what the last commands published
        digests.append(store.digest())
    return outs, digests


HOST_BYTES = 1 << 22


def tp_worker(rank: int, port: int, out: str, host: bool = False) -> None:
    init(rank, port)
    cfg = shard_config(config(host_bytes=HOST_BYTES if host else 0), 2)
    stats: dict[str, Any] = {}
    if rank == 0:
        store = KVStore.open(cfg)
        leader = Leader(store, sender([1]), send_digest=True)
        outs, digests = drive(store, 0, 2, leader=leader, host=host)
    else:
        f = Follower.join(cfg, receiver(0))
        store = f.store
        outs, digests = drive(store, 1, 2, follower=f, host=host)
        stats = {**f.stats, "verify_host": f.verify_host()}
    store.check_invariants()
    tables = store.device.pools["main"].host_tables.tolist()
    dump(Path(out) / f"tp{rank}.json", {"outs": outs, "digests": digests, "tables": tables,
                                         "records": store.stats["records"], **stats})
    dist.destroy_process_group()


# --- checkpoint transfer ----------------------------------------------------------------------
PROMPT, DECODE = 200, 4


def prefill(store: KVStore, tokens: int, seed: int) -> int:
    """A prompt's K/V in every layer, committed and retained as a checkpoint with metadata."""
    gen = torch.Generator().manual_seed(seed)
    s = store.activate(tokens, DECODE)
    store.ensure_mapped(s, "main", tokens)
    with store.boundary():
        rows = store.table_rows("main", [s] * tokens)
        pos = torch.arange(tokens, dtype=torch.int32)
        for layer in range(LAYERS):
            k, v = torch.randn(2, tokens, HKV, D, generator=gen)
            append_kv(store.batch_view("main", layer), rows, pos, k, v)
    store.commit(s, "main", tokens)
    store.set_metadata(s, {"prompt": tokens, "seed": seed})
    return store.finish(s, retain=True)  # type: ignore[return-value]


def decode(store: KVStore, ck: int, seed: int) -> list[list[float]]:
    """Continue ``ck`` (Fork + tail copy at a mid-page frontier) for DECODE tokens."""
    gen = torch.Generator().manual_seed(seed)
    f = store.checkpoint_info(ck).frontier
    s = store.activate_from(ck, f, f, DECODE)
    outs = []
    for t in range(f, f + DECODE):
        store.ensure_mapped(s, "main", t + 1)
        with store.boundary():
            rows = store.table_rows("main", [s])
            q = torch.randn(1, HQ, D, generator=gen)
            for layer in range(LAYERS):
                view = store.batch_view("main", layer)
                k, v = torch.randn(2, 1, HKV, D, generator=gen)
                append_kv(view, rows, torch.tensor([t], dtype=torch.int32), k, v)
                o = paged_decode(q, view, rows, torch.tensor([t + 1], dtype=torch.int32))
                outs.append(o.flatten().tolist())
        store.commit(s, "main", t + 1)
    store.finish(s)
    return outs


def state_of(store: KVStore) -> dict[str, Any]:
    return {"checkpoints": store.checkpoints(), "active": store.active(),
            "occupancy": store.occupancy(), "violations": store.violations()}


def xfer_worker(rank: int, port: int, out: str) -> None:
    """(c) prefill on A, transfer, decode on B == decode on A; (e) a byte flipped on arrival
    is refused: nothing published, nothing leaked, and the sender hears it."""
    from ninfer_kv.dist import TransferCorrupt, export, import_

    init(rank, port)
    store = KVStore.open(config(checked=True))
    page = store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    res: dict[str, Any] = {}
    if rank == 0:
        ck = prefill(store, PROMPT, seed=7)
        rep = export(store, ck, 1, chunk_bytes=page)
        res["export"] = [rep.pages, rep.bytes, rep.chunks, rep.remote]
        res["outs"] = decode(store, ck, seed=99)
        try:
            export(store, ck, 1, chunk_bytes=page)
        except TransferCorrupt as exc:
            res["second"] = f"TransferCorrupt: {exc}"
    else:
        res["before"] = state_of(store)
        rep = import_(store, 0)
        info = store.checkpoint_info(rep.checkpoint)
        res["import"] = [rep.pages, rep.bytes, rep.chunks, rep.checkpoint]
        res["info"] = [info.frontier, info.metadata, info.active, info.finish_reason]
        res["after"] = state_of(store)
        res["outs"] = decode(store, rep.checkpoint, seed=99)
        res["before2"] = state_of(store)

        def flip(pool: str, idx: int, data: list[torch.Tensor]) -> None:
            if idx == 1:
                data[0].view(-1)[4321] ^= 0x40

        try:
            import_(store, 0, on_chunk=flip)
        except TransferCorrupt as exc:
            res["second"] = f"TransferCorrupt: {exc}"
        res["after2"] = state_of(store)
    store.close()
    dump(Path(out) / f"x{rank}.json", res)
    dist.destroy_process_group()


def kill_worker(rank: int, port: int, out: str) -> None:
    """(d) A dies (os._exit) after two of four chunks: B keeps no checkpoint, leaks nothing,
    and a reopen of B's journal finds none either."""
    from ninfer_kv.dist import TransferAborted, export, import_

    init(rank, port)
    cfg = config(journal_dir=str(Path(out) / "b-journal") if rank else None, sync="commit")
    store = KVStore.open(cfg)
    page = store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    res: dict[str, Any] = {}
    if rank == 0:
        ck = prefill(store, PROMPT, seed=7)

        def die(pool: str, idx: int, data: list[torch.Tensor]) -> None:
            if idx == 2:
                os._exit(7)

        export(store, ck, 1, chunk_bytes=page, on_chunk=die)
        return  # not reached
    keep = prefill(store, 64, seed=3)  # B's own checkpoint stays untouched
    res["before"] = state_of(store)
    try:
        import_(store, 0)
    except TransferAborted as exc:
        res["error"] = f"TransferAborted: {exc}"
    res["after"] = state_of(store)
    s = store.activate(100, 1)  # still serving: the pages came back
    store.ensure_mapped(s, "main", 100)
    store.finish(s)
    store.close()
    again = KVStore.open(cfg)
    res["reopened"] = state_of(again)
    res["keep"] = keep
    again.close()
    dump(Path(out) / f"k{rank}.json", res)
    dist.destroy_process_group()


def abort_worker(rank: int, port: int, out: str) -> None:
    """A side that fails by itself mid-transfer (its hook raises at chunk 1): (1) the receiver,
    (2) the sender. Both raise TransferAborted naming who failed and why — the peer is not
    left blocked until the group's timeout — nothing is published or leaked, and (3) the
    next transfer on the same group succeeds."""
    from ninfer_kv.dist import TransferAborted, export, import_

    init(rank, port)
    store = KVStore.open(config(checked=True))
    page = store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    res: dict[str, Any] = {"errors": []}

    def boom(pool: str, idx: int, data: list[torch.Tensor]) -> None:
        if idx == 1:
            raise ValueError(f"hook failed on rank {rank}")

    import ninfer_kv.dist.receive as receive

    real_targets = receive.targets
    calls = [0]

    def failing_targets(kind: type[Exception]) -> Any:
        def targets(*args: Any, **kw: Any) -> Any:  # the receiver's 2nd chunk cannot be placed
            calls[0] += 1
            if calls[0] == 2:
                raise kind(f"staging failed on rank {rank}")
            return real_targets(*args, **kw)
        return targets

    ck = prefill(store, PROMPT, seed=7) if rank == 0 else None
    res["before"] = state_of(store)
    # (1) receiver hook, (2) sender hook, (3)/(4) the receiver cannot place a chunk: a plain
    # error, then a RuntimeError that is not the wire's (out of memory)
    for case in ("recv-hook", "send-hook", "recv-value", "recv-oom"):
        hook = boom if (case, rank) in (("recv-hook", 1), ("send-hook", 0)) else None
        calls[0] = 0
        if rank == 1 and case.startswith("recv-") and case != "recv-hook":
            kind = ValueError if case == "recv-value" else torch.OutOfMemoryError
            receive.targets = failing_targets(kind)
        t0 = time.monotonic()
        try:
            if rank == 0:
                export(store, ck, 1, chunk_bytes=page, on_chunk=hook)  # type: ignore[arg-type]
            else:
                import_(store, 0, on_chunk=hook)
        except TransferAborted as exc:
            res["errors"].append(f"TransferAborted: {exc}")
        receive.targets = real_targets
        res.setdefault("seconds", []).append(time.monotonic() - t0)
        res.setdefault("states", []).append(state_of(store))
    if rank == 0:
        res["third"] = export(store, ck, 1, chunk_bytes=page).pages  # type: ignore[arg-type]
    else:
        rep = import_(store, 0)
        res["third"] = rep.pages
        res["third_info"] = store.checkpoint_info(rep.checkpoint).frontier
    store.close()
    dump(Path(out) / f"a{rank}.json", res)
    dist.destroy_process_group()


# --- standby promotion --------------------------------------------------------------------------
def fill_planes(store: KVStore, seed: int) -> None:
    """Every byte of every plane of the main pool: seeded random (a rank's own shard)."""
    g = torch.Generator().manual_seed(seed)
    for t in store.device.planes("main"):
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))


def page_bytes_of(store: KVStore, bundle: int) -> list[torch.Tensor]:
    """The bytes of every page of ``bundle`` in the main pool, per plane, in logical order."""
    p = store.state.pools["main"]
    ids = [p.pages[s].device for s in p.spaces[bundle].members]  # type: ignore[union-attr]
    return [t.view(torch.uint8)[ids].clone() for t in store.device.planes("main")]


def standby_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 leads with a persistent host tier, offloads a checkpoint (its boundary waits for
    the standby's ack), starts another request, then dies without a word (``os._exit``).
    Rank 1, a standby, sees the stream break and promotes itself."""
    from ninfer_kv.dist import StreamBroken

    init(rank, port)
    cfg = shard_config(config(host_bytes=HOST_BYTES, persist_dir=str(Path(out) / f"r{rank}")), 2)
    if rank == 0:
        store = KVStore.open(cfg)
        leader = Leader(store, sender([1]), send_digest=True, acks=[receiver(1)])
        s = store.activate(128, 4)
        store.ensure_mapped(s, "main", 128)
        with leader.boundary(b"fill"):
            fill_planes(store, 0)
        store.commit(s, "main", 128)
        ck = store.finish(s, retain=True)
        assert ck is not None
        store.offload(ck, drop_device=True)
        with leader.boundary():       # returns once the standby acknowledged the publish
            pass
        c = store.activate(30, 4)
        store.ensure_mapped(c, "main", 30)
        with leader.boundary():
            pass
        dump(Path(out) / "leader.json", {"checkpoint": ck, "acked": leader.stats["acked"]})
        os._exit(0)                   # no close, no END: the leader is gone
    f = Follower.join(cfg, receiver(0), ack=sender([0]))
    mine: list[torch.Tensor] = []
    broke = ""
    while True:
        try:
            step = f.step()
        except StreamBroken as exc:
            broke = str(exc)
            break
        if step.note == b"fill":
            fill_planes(f.store, 1)
            mine = page_bytes_of(f.store, next(iter(f.store.state.bundles)))
    promoted = f.promote()
    ck = next(b for b, x in promoted.state.bundles.items() if not x.active)
    s = promoted.activate_from(ck, 128, 130, 2)
    promoted.ensure_mapped(s, "main", 130)
    with promoted.boundary():
        pass
    got = page_bytes_of(promoted, s)
    same = all(torch.equal(g[:2], m) for g, m in zip(got, mine, strict=True))
    dump(Path(out) / "standby.json", {
        "broke": broke, "checkpoints": sorted(b for b, x in promoted.state.bundles.items()
                                              if not x.active and b != s),
        "dropped": sorted(promoted.recovery.dropped), "own_bytes": same,
        "violations": promoted.violations()})
    promoted.close()


# --- a transfer between fragmented stores ---------------------------------------------------------
def _interleaved(store: KVStore, tokens: int) -> tuple[int, int]:
    """Two sequences mapped a page at a time in turn: each one's page groups alternate."""
    a, b = store.activate(tokens, DECODE), store.activate(tokens, DECODE)
    for t in range(64, tokens + 64, 64):
        for s in (a, b):
            store.ensure_mapped(s, "main", min(t, tokens))
    with store.boundary():
        pass
    return a, b


def _page_crcs(store: KVStore, bundle: int) -> list[int]:
    from ninfer_kv.dist.packing import crcs, gather

    p = store.state.pools["main"]
    pages = [p.pages[s] for s in p.spaces[bundle].members]
    return crcs(gather(store, "main", pages, 0, torch.device("cpu")))  # type: ignore[arg-type]


def frag_worker(rank: int, port: int, out: str) -> None:
    """Both sides' page groups are scattered (every other one), so each chunk goes through
    staging on both sides, two at a time: the receiver's pages hold the sender's bytes."""
    from ninfer_kv.dist import export, import_

    init(rank, port)
    tokens = 7 * 64  # 4 chunks of 2 pages
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=LAYERS, kv_heads=HKV, head_dim=D),
        serving=ServingConfig(max_context=tokens + 64, max_concurrency=4), kv_tokens=24 * 64))
    page = store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    res: dict[str, Any] = {}
    a, b = _interleaved(store, tokens)
    if rank == 0:
        fill_planes(store, 5)
        store.commit(a, "main", tokens)
        ck = store.finish(a, retain=True)
        store.finish(b)
        with store.boundary():
            pass
        assert ck is not None
        p = store.state.pools["main"]
        res["ids"] = [int(p.pages[s].device) for s in p.spaces[ck].members]  # type: ignore[union-attr]
        res["crcs"] = _page_crcs(store, ck)
        res["chunks"] = export(store, ck, 1, chunk_bytes=2 * page).chunks
    else:
        store.finish(a)          # frees every other page group
        with store.boundary():
            pass
        def slow(pool: str, idx: int, data: list[torch.Tensor]) -> None:
            if idx == 0:  # chunks 1, 2, ... arrive meanwhile: chunk 2 must not be posted
                time.sleep(0.3)  # into staging slot 0 before chunk 0 was checked and written

        rep = import_(store, 0, on_chunk=slow)
        p = store.state.pools["main"]
        res["ids"] = [int(p.pages[s].device)  # type: ignore[union-attr]
                      for s in p.spaces[rep.checkpoint].members]
        res["crcs"] = _page_crcs(store, rep.checkpoint)
        res["violations"] = store.violations()
    store.close()
    dump(Path(out) / f"f{rank}.json", res)
    dist.destroy_process_group()
