"""Checkpoint export/import throughput over gloo vs a raw torch.distributed send of the same
bytes, measured in the same run on two local processes. Prints; never asserts on time.

    python benchmarks/transfer_bench.py [--pages 64] [--layers 4] [--repeat 5] [--chunk-mib 16]

The raw baseline sends the same number of bytes in tensors of the same chunk size with
``dist.send`` (no packing, no CRC, no store). The ratio (goal >= 0.8) is export throughput
(sender: header to the receiver's "published") over raw throughput.

A third line is the ceiling of any verified transfer on this machine: the same raw chunks
with a CRC-32C of every MiB computed on both sides (the sender after posting a chunk, the
receiver, which keeps two receives posted, once it arrived) and nothing else. On a 2-core
machine both ends of a loopback send already keep the cores busy, so the CRCs alone cost what
the ratio misses.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig  # noqa: E402
from ninfer_kv.dist import export, import_  # noqa: E402
from ninfer_kv.dist.transfer import DEFAULT_CHUNK  # noqa: E402


def make_store(a: argparse.Namespace) -> KVStore:
    return KVStore.open(StoreConfig(
        model=ModelGeometry(layers=a.layers, kv_heads=a.kv_heads, head_dim=128),
        serving=ServingConfig(max_context=a.pages * 64, max_concurrency=2),
        kv_tokens=2 * a.pages * 64))


def checkpoint(store: KVStore, pages: int) -> int:
    """A checkpoint of ``pages`` full pages whose planes hold random bytes."""
    s = store.activate(pages * 64, 0)
    store.ensure_mapped(s, "main", pages * 64)
    with store.boundary():
        for t in store.device.planes("main"):
            t.view(torch.uint8).random_(0, 256)
    store.commit(s, "main", pages * 64)
    return store.finish(s, retain=True)  # type: ignore[return-value]


def _crc_mib(t: torch.Tensor) -> None:
    a = t.numpy()
    for i in range(0, len(a), 1 << 20):
        crc32c(a[i:i + (1 << 20)])


def raw_with_crc(rank: int, whole: torch.Tensor, per: int) -> None:
    """``whole`` in chunks of ``per`` bytes, CRC-32C'd on both sides (two receives posted)."""
    chunks = list(whole.split(per))
    if rank == 0:
        works = []
        for c in chunks:
            works.append(dist.isend(c, 1))
            _crc_mib(c)
        for w in works:
            w.wait()
        dist.recv(torch.zeros(1), 1)
    else:
        works = [dist.irecv(c, 0) for c in chunks[:2]]
        for i, c in enumerate(chunks):
            works[i].wait()
            if i + 2 < len(chunks):
                works.append(dist.irecv(chunks[i + 2], 0))
            _crc_mib(c)
        dist.send(torch.zeros(1), 0)


def worker(rank: int, port: int, a: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    store = make_store(a)
    chunk = a.chunk_mib << 20
    res: dict[str, Any] = {"export": [], "import": [], "raw": [], "raw1": [], "rawcrc": []}
    ck = checkpoint(store, a.pages) if rank == 0 else 0
    total = a.pages * store.plan.layout.pools[next(iter(store.plan.layout.pools))].page_bytes
    per = max(1, chunk // (total // a.pages)) * (total // a.pages)
    raw = torch.empty(per, dtype=torch.uint8).random_(0, 256)
    whole = torch.empty(total, dtype=torch.uint8).random_(0, 256)
    for _ in range(a.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            left = total
            while left:
                n = min(per, left)
                dist.send(raw[:n], 1)
                left -= n
            dist.recv(torch.zeros(1), 1)
        else:
            left = total
            while left:
                n = min(per, left)
                dist.recv(raw[:n], 0)
                left -= n
            dist.send(torch.zeros(1), 0)
        res["raw"].append(total / (time.perf_counter() - t0) / 1e9)
        dist.barrier()
        t0 = time.perf_counter()  # the same bytes as one tensor
        if rank == 0:
            dist.send(whole, 1)
            dist.recv(torch.zeros(1), 1)
        else:
            dist.recv(whole, 0)
            dist.send(torch.zeros(1), 0)
        res["raw1"].append(total / (time.perf_counter() - t0) / 1e9)
        dist.barrier()
        t0 = time.perf_counter()  # the same chunks with a CRC-32C on both sides: the ceiling
        raw_with_crc(rank, whole, per)
        res["rawcrc"].append(total / (time.perf_counter() - t0) / 1e9)
        dist.barrier()
        if rank == 0:
            rep = export(store, ck, 1, chunk_bytes=chunk)
            res["export"].append(rep.gbps)
        else:
            rep = import_(store, 0)
            res["import"].append(rep.gbps)
            store.release(rep.checkpoint)
            with store.boundary():
                pass
    res["bytes"] = total
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    store.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK >> 20,
                   help="bytes per chunk (default: export's own default)")
    a = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(worker, args=(port, a, out), nprocs=2, join=True)
        r0 = json.loads(Path(out, "0.json").read_text())
        r1 = json.loads(Path(out, "1.json").read_text())
    mib = r0["bytes"] / (1 << 20)
    chunked, one = max(r0["raw"]), max(r0["raw1"])
    raw, exp, imp = max(chunked, one), max(r0["export"]), max(r1["import"])
    ceiling = max(r0["rawcrc"])
    print(f"checkpoint: {a.pages} pages, {mib:.1f} MiB, chunks of {a.chunk_mib} MiB, "
          f"best of {a.repeat}")
    print(f"raw dist.send, same chunks  {chunked:7.3f} GB/s")
    print(f"raw dist.send, one tensor   {one:7.3f} GB/s")
    print(f"raw + CRC-32C both sides    {ceiling:7.3f} GB/s   (= {ceiling / raw:.3f} of raw: "
          "the ceiling of a verified transfer here)")
    print(f"export (sender)             {exp:7.3f} GB/s")
    print(f"import (receiver)           {imp:7.3f} GB/s")
    print(f"ratio export / best raw     {exp / raw:7.3f}   (goal >= 0.8)")
    print(f"ratio export / raw + CRC    {exp / ceiling:7.3f}")


if __name__ == "__main__":
    main()
