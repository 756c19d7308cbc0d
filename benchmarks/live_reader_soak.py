"""Live-reader soak: read a journal while another process writes it, as `ninfer-kv replay` /
`inspect` / `dump` / `events` do beside a running engine (they take no lock).

A writer process serves the Mooncake trace with host offload, small segments, a snapshot
every few records and a compaction every few rounds; after each round it publishes a boundary
and appends ``<record> <digest>`` to ``digests.txt``. Meanwhile this process opens a
``JournalReader`` again and again and replays it. Every read must succeed, and where the
writer noted a digest for the reader's last record the replayed state must have it.

Run (the last line is the verdict; exit status 0 only for a clean one)::

    .venv/bin/python benchmarks/live_reader_soak.py --requests 1500
    ...
    reads=R failed=0 checked=C mismatched=0 writer_records=W

Options: ``--requests N`` (trace requests the writer serves; default 400), ``--segment-bytes``
(default 4000), ``--snapshot-every`` (records; default 20), ``--compact-every`` (rounds;
default 50), ``--dir DIR`` (default a fresh temp dir). The CI test
(tests/journal/test_live_reader_soak.py) runs it with ``NINFER_KV_LIVE_READER_REQUESTS`` requests
(default 150).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

WRITER = "--writer"


def writer(directory: str, requests: int, segment_bytes: int, snapshot_every: int,
           compact_every: int) -> None:
    from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
    from ninfer_kv.engine.store import KVStore, StoreConfig
    from ninfer_kv.journal.log import SyncPolicy
    from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, simulate

    jdir = os.path.join(directory, "journal")
    opts = SimOptions(journal_dir=jdir, scale=16, kv_tokens=1 << 16, offload=True, share=True,
                      host_bytes=1 << 26, max_context=8192)
    model = ModelGeometry(layers=opts.layers, kv_heads=opts.kv_heads, head_dim=opts.head_dim)
    serving = ServingConfig(max_context=opts.max_context,
                            max_concurrency=opts.max_concurrency, backend=Backend.OFF,
                            draft_window=opts.draft_window)
    store = KVStore.open(StoreConfig(
        model=model, serving=serving, kv_tokens=opts.kv_tokens, journal_dir=jdir,
        sync=SyncPolicy.OFF, allocate_planes=False, segment_bytes=segment_bytes,
        snapshot_every=snapshot_every, host_bytes=opts.host_bytes, lease_growth=True))
    with open(os.path.join(directory, "digests.txt"), "a", buffering=1) as out:
        def on_round(st: KVStore, res: object) -> None:
            with st.boundary() as seq:
                out.write(f"{seq} {st.digest()}\n")
            if st.journal is not None and st.journal.last_seq % compact_every == 0:
                st.compact()
        store, _ = simulate(load_trace(DEFAULT_TRACE, requests), opts, on_round, store)
    store.close()


def read_digests(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                seq, digest = line.split()
                out[int(seq)] = digest
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--segment-bytes", type=int, default=4000)
    ap.add_argument("--snapshot-every", type=int, default=20)
    ap.add_argument("--compact-every", type=int, default=50)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    directory = a.dir or tempfile.mkdtemp(prefix="ninfer-live-reader-")
    os.makedirs(directory, exist_ok=True)
    jdir = os.path.join(directory, "journal")
    open(os.path.join(directory, "digests.txt"), "w").close()
    child = subprocess.Popen([sys.executable, __file__, WRITER, directory, str(a.requests),
                              str(a.segment_bytes), str(a.snapshot_every),
                              str(a.compact_every)])

    from ninfer_kv.errors import KVStoreError
    from ninfer_kv.journal.reader import JournalReader
    from ninfer_kv.replay import replay

    reads = failed = checked = mismatched = 0
    while child.poll() is None:
        if not os.path.exists(os.path.join(jdir, "seg-00000001.log")) and reads == 0:
            time.sleep(0.05)  # the writer is still starting
            continue
        try:
            reader = JournalReader(jdir)
            digest = replay(reader).digest
        except KVStoreError as exc:
            failed += 1
            print(f"read {reads}: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            reads += 1
        want = read_digests(os.path.join(directory, "digests.txt")).get(reader.last_seq)
        if want is not None:
            checked += 1
            if want != digest:
                mismatched += 1
                print(f"read {reads}: record {reader.last_seq} replays to {digest}, the "
                      f"writer had {want}", flush=True)
    records = max(read_digests(os.path.join(directory, "digests.txt")), default=0)
    print(f"reads={reads} failed={failed} checked={checked} mismatched={mismatched} "
          f"writer_records={records} writer_rc={child.returncode}")
    return int(bool(failed or mismatched or child.returncode or not checked))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WRITER:
        d, n, seg, snap, comp = sys.argv[2:7]
        writer(d, int(n), int(seg), int(snap), int(comp))
    else:
        sys.exit(main())
