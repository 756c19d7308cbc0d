"""ninfer-kv's decode round next to vLLM, SGLang and nano-vllm on the shared peer harness.

Runs ``../shared/bench/peer_bench.py`` once (same trace, same capacity, peers and ninfer-kv in
one process, medians of ``--repeats``), then prints µs per request-step of each system and the
ratio of ninfer-kv (journal on and off) to the best peer. Measures; asserts nothing.

    ../shared/bench/setup.sh                         # once: harness venv + peer sources
    .venv/bin/python benchmarks/peer_harness.py [--repeats 3] [--pool-frac 1.0] [--json out.json]

ninfer-kv runs twice per journal setting: the harness's adapter (``ninfer_adapter``: dicts
and lists per step) and ``benchmarks/peer_adapter.py`` (per-request arrays, as an engine keeps
them). The harness lives in ``$PEER_BENCH_DIR`` (default /tmp/peer_bench).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ("ref-paged", "vllm", "nano", "sglang-paged-b", "sglang-token-b")
OURS = ("ninfer_adapter:NinferAdapter", "ninfer_adapter:NinferNoJournal",
        "peer_adapter:NinferArrays", "peer_adapter:NinferArraysNoJournal",
        "peer_adapter:NinferSharing", "peer_adapter:NinferGrowth",
        "peer_adapter:VllmFirstAdmission")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-frac", type=float, default=1.0)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--json", help="also write the harness's JSON here")
    a = ap.parse_args()
    bench = Path(os.environ.get("PEER_BENCH_DIR", "/tmp/peer_bench"))
    py = bench / ".venv" / "bin" / "python"
    if not py.exists():
        print(f"no harness at {bench}: run ../shared/bench/setup.sh first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        out = Path(a.json) if a.json else Path(d) / "peers.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE), str(bench), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        cmd = [str(py), "peer_bench.py", "--peers", a.peers, "--repeats", str(a.repeats),
               "--pool-frac", str(a.pool_frac), "--json", str(out)]
        for o in OURS:
            cmd += ["--adapter", o]
        subprocess.run(cmd, cwd=bench, env=env, check=True)
        res = json.loads(out.read_text())["results"]
    step = {k: v["median"]["us_per_req_step"] for k, v in res.items()}
    hit = {k: v["median"].get("prefix_hit_frac") for k, v in res.items()}
    first = {k: v["median"].get("first_hit_frac") for k, v in res.items()}
    pre = {k: v["median"].get("preemptions", 0) for k, v in res.items()}
    fill = {k: v["median"].get("prefill_tokens") for k, v in res.items()}
    peers = {k: s for k, s in step.items()
             if not k.startswith("ninfer") and k != "vllm-first"}  # vllm-first: vllm again
    best = min(peers, key=peers.get)  # type: ignore[arg-type]
    print(f"\nµs per request-step (median of {a.repeats}); best peer: {best} "
          f"{peers[best]:.3f}")
    for k in sorted(step, key=step.get):  # type: ignore[arg-type]
        h = "" if hit[k] is None else f"  hit {100 * hit[k]:5.1f}%"
        if first[k] is not None:
            h += (f" (first admission {100 * first[k]:4.1f}%, {pre[k]:.0f} preemptions, "
                  f"{fill[k] / 1e6:.3f}M tokens prefilled)")
        print(f"  {k:16s} {step[k]:7.3f}  x{step[k] / peers[best]:5.2f} of best peer{h}")
    print("hit: prompt tokens continued from cached KV over all admissions, re-admissions of "
          "preempted requests included;\nfirst admission: each request's first admission only "
          "(what the prefix cache reused, whatever the preemption policy);\nprefilled: prompt "
          "tokens computed over all admissions (what preemption and misses cost the engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
