"""``ninfer-kv simulate --tp N`` and ``--disagg``: the two multi-GPU topologies of
docs/multi-gpu.md on local gloo processes (CPU), with a toy model (seeded random K/V).

* ``--tp N``: rank 0 leads (commands, ``dist.Leader``), ranks 1..N-1 follow its records
  (``dist.Follower``); every rank holds kv_heads/N heads and appends its K/V each unit. Every
  finished request is retained and offloaded to the host tier with its device pages dropped;
  once the next boundary dropped them it is continued for ``CONTINUE`` tokens (its pages
  restored, H2D) and the checkpoint released: every rank copies its own shard out and back
  (§5.3), and each follower checks its replicas against its own CRCs every step.
  ``--standby``: the leader and the last rank keep their directories (a persistent host tier)
  and that rank is a standby; every other finished request's checkpoint stays offloaded, and
  at the end the standby is promoted: it must keep exactly what a reopen of the leader keeps.
* ``--disagg``: rank 0 prefills each request and exports the checkpoint; rank 1 imports it and
  decodes it (``dist.export`` / ``dist.import_``).

Reported: bytes moved (record stream or page payload), transfer GB/s, per-rank digests (TP:
they must be equal) and each rank's invariant check.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from ninfer_kv.dist import Follower, Leader, export, import_, shard_config
from ninfer_kv.dist.wire import receiver, sender
from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import HostArenaError, InvalidArgument
from ninfer_kv.kernels.append import append_kv

LAYERS, KV_HEADS, HEAD_DIM = 2, 4, 64
CONTINUE = 2
"""Tokens a continuation of an offloaded checkpoint decodes (``--tp``)."""
HOST_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class DistSimOptions:
    tp: int = 1
    disagg: bool = False
    standby: bool = False
    requests: int = 8
    seed: int = 0
    chunk_bytes: int = 1 << 20
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if (self.tp > 1) == self.disagg:
            raise InvalidArgument(f"tp={self.tp}, disagg={self.disagg}: choose one topology "
                                  "(--tp N with N >= 2, or --disagg)")
        if self.standby and self.tp < 2:
            raise InvalidArgument("--standby needs --tp N with N >= 2 (the last rank stands by)")
        if KV_HEADS % self.tp:
            raise InvalidArgument(f"--tp {self.tp} must divide the toy model's {KV_HEADS} KV "
                                  "heads")


def config() -> StoreConfig:
    return StoreConfig(model=ModelGeometry(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM),
                       serving=ServingConfig(max_context=1024, max_concurrency=4),
                       kv_tokens=64 * 64)


def requests(opts: DistSimOptions) -> list[tuple[int, int]]:
    rng = random.Random(opts.seed)
    return [(rng.randint(16, 400), rng.randint(1, 6)) for _ in range(opts.requests)]


def _kv(store: KVStore, seqs: list[int], starts: list[int], ends: list[int], step: int,
        rank: int, tp: int) -> None:
    """One unit: every layer's K/V of the new tokens, this rank's heads."""
    gen = torch.Generator().manual_seed(step)
    flat = [s for s, a, e in zip(seqs, starts, ends, strict=True) for _ in range(e - a)]
    if not flat:
        return
    pos = torch.tensor([p for a, e in zip(starts, ends, strict=True) for p in range(a, e)],
                       dtype=torch.int32)
    rows = store.table_rows("main", flat)
    h = KV_HEADS // tp
    for layer in range(LAYERS):
        k, v = torch.randn(2, len(flat), KV_HEADS, HEAD_DIM, generator=gen)[:, :, rank * h:
                                                                             (rank + 1) * h]
        append_kv(store.batch_view("main", layer), rows, pos, k.contiguous(), v.contiguous())


def _lead(store: KVStore, leader: Leader, reqs: list[tuple[int, int]], tp: int,
          keep_every: int = 0) -> int:
    """Continuous batching on the leader: admit while rows are free, one token per round. A
    finished request's checkpoint is offloaded (device pages dropped at the next boundary),
    then continued once the next boundary dropped its device pages: from its host replicas."""
    queue, running, step = list(reqs), {}, 0
    offloaded: list[tuple[int, int]] = []   # (checkpoint, the round it was offloaded in)
    continuations: set[int] = set()
    while queue or running or offloaded:
        seqs, starts, ends = [], [], []
        while offloaded and offloaded[0][1] + 1 < step and len(running) < store.plan.C:
            ck = offloaded.pop(0)[0]
            f = store.checkpoint_info(ck).frontier
            s = store.activate_from(ck, f, f, CONTINUE)  # host-only pages: restored (H2D)
            store.release(ck)
            running[s] = CONTINUE
            continuations.add(s)
        while queue and len(running) < store.plan.C:
            prompt, out = queue.pop(0)
            s = store.activate(prompt, out)
            running[s] = out
            seqs.append(s)
            starts.append(0)
            ends.append(prompt)
        for s in running:
            if s not in seqs:
                f = store.checkpoint_info(s).frontier
                seqs.append(s)
                starts.append(f)
                ends.append(f + 1)
        store.ensure_mapped_many("main", seqs, ends)
        with leader.boundary(msgspec.msgpack.encode([seqs, starts, ends, step])):
            _kv(store, seqs, starts, ends, step, 0, tp)
        store.commit_many("main", seqs, ends)
        for s in list(running):
            running[s] -= 1
            if not running[s]:
                del running[s]
                if s in continuations:
                    store.finish(s, retain=False)
                    continue
                ck = store.finish(s, retain=True)
                assert ck is not None
                try:
                    store.offload(ck, drop_device=True)
                except HostArenaError:  # the arena is full of kept checkpoints: let it go
                    store.release(ck)
                    continue
                if not (keep_every and ck % keep_every == 0):  # else it stays, durable
                    offloaded.append((ck, step))
        step += 1
    leader.close()
    return step


def worker(rank: int, port: int, opts: DistSimOptions, out: str) -> None:
    world = opts.tp if opts.tp > 1 else 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=opts.timeout_s))
    res: dict[str, Any] = {"rank": rank}
    t0 = time.perf_counter()
    if opts.tp > 1:
        last = world - 1
        standby = opts.standby and rank in (0, last)  # the leader's dirs, the standby's
        cfg = shard_config(config(), opts.tp, host_bytes=HOST_BYTES,
                           persist_dir=str(Path(out, f"rank{rank}")) if standby else None)
        if rank == 0:
            store = KVStore.open(cfg)
            leader = Leader(store, sender(range(1, world)), send_digest=True,
                            acks=[receiver(last)] if opts.standby else ())
            res["boundaries"] = _lead(store, leader, requests(opts), opts.tp,
                                      2 if opts.standby else 0)
            res.update(bytes=leader.stats["bytes"] * (world - 1), records=leader.stats["records"],
                       host_bad=[], acked=leader.stats["acked"])
        else:
            f = Follower.join(cfg, receiver(0), ack=sender([0]) if standby else None)
            store = f.store
            bad: list[str] = []

            def on_step(s: Any) -> None:
                if s.note:
                    _kv(store, *msgspec.msgpack.decode(s.note), rank, opts.tp)
                bad.extend(f.verify_host())  # this rank's replicas against its own CRCs

            f.run(on_step)
            res.update(bytes=f.stats["bytes"], records=f.stats["records"], host_bad=bad)
        res.update(d2h_pages=store.stats["d2h_pages"], h2d_pages=store.stats["h2d_pages"])
    else:
        store = KVStore.open(config())
        res.update(_disagg(store, rank, opts))
    res["seconds"] = time.perf_counter() - t0
    res["digest"] = store.digest()
    res["violations"] = store.violations()
    if opts.tp > 1 and standby:  # after the stream: promote the standby, reopen the leader
        if rank == last:
            store = f.promote()
        else:
            store.close()
            store = KVStore.open(cfg)
        res["kept"] = sorted(store.recovery.kept)
        res["violations"] += store.violations()
    store.close()
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _disagg(store: KVStore, rank: int, opts: DistSimOptions) -> dict[str, Any]:
    moved = pages = 0
    busy = 0.0
    for i, (prompt, out) in enumerate(requests(opts)):
        if rank == 0:  # prefill node
            s = store.activate(prompt, out)
            store.ensure_mapped(s, "main", prompt)
            with store.boundary():
                _kv(store, [s], [0], [prompt], i, 0, 1)
            store.commit(s, "main", prompt)
            store.set_metadata(s, {"request": i, "output": out})
            ck = store.finish(s, retain=True)
            rep = export(store, ck, 1, chunk_bytes=opts.chunk_bytes)  # type: ignore[arg-type]
            store.release(ck)  # type: ignore[arg-type]
        else:  # decode node
            rep = import_(store, 0)
            f = store.checkpoint_info(rep.checkpoint).frontier
            s = store.activate_from(rep.checkpoint, f, f, out)
            for t in range(f, f + out):
                store.ensure_mapped(s, "main", t + 1)
                with store.boundary():
                    _kv(store, [s], [t], [t + 1], 10_000 + t, 0, 1)
                store.commit(s, "main", t + 1)
            store.finish(s)
            store.release(rep.checkpoint)
        moved += rep.bytes
        pages += rep.pages
        busy += rep.seconds
    with store.boundary():
        pass
    return {"bytes": moved, "pages": pages, "checkpoints": opts.requests,
            "transfer_seconds": busy}


def run(opts: DistSimOptions) -> dict[str, Any]:
    """Spawn the ranks, wait, and summarize what each reported."""
    world = opts.tp if opts.tp > 1 else 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="ninfer-kv-dist-") as out:
        torch.multiprocessing.spawn(worker, args=(port, opts, out), nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    digests = [r["digest"] for r in ranks]
    summary: dict[str, Any] = {"mode": f"tp={opts.tp}" if opts.tp > 1 else "disagg",
                               "ranks": world, "requests": opts.requests, **asdict(opts)}
    if opts.tp > 1:
        lead = ranks[0]
        summary.update(boundaries=lead["boundaries"], records=lead["records"],
                       bytes_moved=lead["bytes"], seconds=round(lead["seconds"], 4),
                       digests_equal=len(set(digests)) == 1,
                       d2h_pages=[r["d2h_pages"] for r in ranks],
                       h2d_pages=[r["h2d_pages"] for r in ranks],
                       host_replicas_ok=all(not r["host_bad"] for r in ranks))
        if opts.standby:  # the promoted standby keeps what a reopen of the leader keeps
            summary.update(acked=lead["acked"], leader_reopen_kept=lead["kept"],
                           standby_promoted_kept=ranks[-1]["kept"],
                           standby_ok=lead["kept"] == ranks[-1]["kept"] != [])
        secs = lead["seconds"]
    else:
        summary.update(checkpoints=ranks[1]["checkpoints"], pages=ranks[1]["pages"],
                       bytes_moved=ranks[1]["bytes"],
                       transfer_seconds=round(ranks[1]["transfer_seconds"], 4))
        secs = ranks[1]["transfer_seconds"]
    summary["transfer_gbps"] = round(summary["bytes_moved"] / secs / 1e9, 6) if secs else 0.0
    summary["digests"] = digests
    summary["invariants_ok"] = all(not r["violations"] for r in ranks)
    return summary


def run_cli(a: Any, console: Any) -> int:
    """``simulate --tp N`` / ``--disagg`` (``--limit`` requests, default 8; ``--seed``)."""
    from rich.table import Table

    from ninfer_kv.tools.output import emit_json

    opts = DistSimOptions(tp=a.tp, disagg=a.disagg, requests=a.limit or 8, seed=a.seed,
                          standby=a.standby)
    d = run(opts)
    ok = d["invariants_ok"] and d.get("digests_equal", True) and d.get("host_replicas_ok", True) \
        and d.get("standby_ok", True)
    if a.json:
        emit_json(d)
        return 0 if ok else 1
    t = Table(title=f"simulate {d['mode']} on {d['ranks']} gloo processes")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in d.items():
        if k != "digests":
            t.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    for r, dg in enumerate(d["digests"]):
        t.add_row(f"digest rank {r}", dg[:16])
    console.print(t)
    return 0 if ok else 1
