"""Crash soak: SIGKILL a store that is serving the Mooncake trace with host offload and
persistence on, reopen it, and check that nothing acknowledged was lost or served corrupt.

Run (the last line is the verdict)::

    .venv/bin/python benchmarks/crash_soak.py --kills 1000
    ...
    kills=1000 acknowledged=A lost=0 corrupt_served=0 violations=0

Options: ``--kills N`` (default 20), ``--seed S`` (default 0; the child of kill ``k`` drives
its workload with seed ``S * 100003 + k``), ``--dir DIR`` (store directory; default a fresh
temp dir), ``--trace FILE`` (Mooncake jsonl; default the shared synthetic trace),
``--max-delay SEC`` (kill at uniform(0, SEC) after the child opened the store; default 0.5),
``--early FRAC`` (fraction of kills aimed at the child's open/recovery instead; default
0.1), ``--durable-sources`` (continue — Fork/Move — only from acknowledged checkpoints: a
narrower workload that leaves out continuations from checkpoints whose host replicas are not
published yet), ``--verbose`` (keep the store's structlog warnings). The exit status is 0
only for a clean verdict. The CI test (tests/engine/test_crash_soak.py) runs this script
with ``NINFER_KV_SOAK_KILLS`` kills (default 50, about 15-20 s).

**Fork server.** The parent imports torch, numba and the store once and warms up (a
throwaway store in a temp dir runs the child workload through a clean restart, so the numba
copy kernels — ``pack_pages`` for offload, ``unpack_pages`` for restore, ``copy_tail`` for
COW — are compiled/loaded for the exact argument types the child uses). Then, per kill, it
``os.fork()``s a child that opens the store and drives it; the parent kills it with SIGKILL
at a random moment, reaps it, reopens the store itself to check, snapshots and compacts the
journal (so reopen cost stays bounded however many kills run), and closes the store before
the next fork: the store holds an exclusive ``flock`` on its directories for its lifetime
(journal/lock.py) and a forked child inherits open descriptors, so the parent never forks
with a store open; the lock dies with the killed child.

Forking after a thread pool started is the hazard: numba's default threading layer here is
GNU OpenMP, which aborts a forked child ("fork() called from a process already using GNU
OpenMP"), and torch's OpenMP pool deadlocks a child whose parent ran a parallel torch op.
So the soak selects numba's fork-safe ``workqueue`` layer and ``torch.set_num_threads(1)``
before anything runs (:func:`prepare_process`), and refuses to start if numba already
launched another layer in this process (run it as a script, not inside a test process).

**Workload** (child, :class:`Driver`): root activations; Forks (``activate_from``, keeping
the source) and Move-or-Fork-and-release (``keep_source=False``) from its checkpoints at
mid-page, page-aligned or full frontiers — after a restart every checkpoint is host-only, so
these restore pages (H2D) and COW the partial tail; chunked prefill then decode; truncate;
``finish`` retaining (or aborting); ``offload`` with or without ``drop_device``, sometimes
with a Fork from the fresh checkpoint queued before its publishing boundary; ``drop_device``,
``drop_host`` (then re-offload), ``release`` with or without a following boundary, explicit
snapshots and compactions. Every sequence writes a payload that is a function of (position,
plane, head, salt) with a random salt per written run, so a page shared where it should have
been copied shows up. Protocol on a pipe, in order:

* ``OPEN`` — the store is open (recovery done);
* ``CK <id> <end:salt,...>`` — a checkpoint was retained with this payload recipe (printed
  before anything about it can be journaled);
* ``ACK <id>`` — durable from now: printed after the boundary that published and synced its
  host replica (or, after open, for every checkpoint the restart kept);
* ``REL <id>`` — may disappear from now: printed before release, Move/Fork-and-release, or
  ``drop_host`` of any page it holds;
* ``VIO <text>`` — the child saw a broken invariant while running.

After each kill the parent reopens the store and asserts: every acknowledged, unreleased
checkpoint is present with its acknowledged committed frontier; every present checkpoint's
payload, recomputed from the arena (not trusted from the journal), is byte-identical to its
recipe (and zero past the committed columns); ``store.violations()`` is empty (which
includes: no host extent leaked, free + live == capacity). A store that no longer opens
counts every acknowledged checkpoint as lost and ends the soak (later kills could only
repeat it). It prints a per-kill cost summary (seconds per kill and per phase, reopen cost
over the first and last 100 kills, journal size at the end), then the verdict line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar

import numba
import structlog
import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import P, PlaneOrder, ceil_div
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import (
    CapacityExhausted,
    HostArenaError,
    KVStoreError,
    WritePermissionError,
)
from ninfer_kv.journal.log import SyncPolicy
from ninfer_kv.tools.simulate import DEFAULT_TRACE, Request, load_trace

T = TypeVar("T")

Recipe = tuple[tuple[int, int], ...]
"""A checkpoint's payload: runs ``(end, salt)``; positions [previous end, end) were written
with ``salt``. The last end is the committed frontier."""

MAX_CHECKPOINTS = 8
"""Checkpoints a child keeps (it releases the oldest beyond this): bounds host use and the
recovery/check cost."""
CHILD_LIMIT_S = 120.0
"""A child that outlives this exits by itself (the parent always kills it much earlier)."""
FIRST_LINE_TIMEOUT_S = 60.0


def config(directory: str) -> StoreConfig:
    return StoreConfig(model=ModelGeometry(layers=1, kv_heads=2, head_dim=64),
                       serving=ServingConfig(max_context=2048, max_concurrency=4),
                       kv_tokens=2048 * 3, persist_dir=directory, host_bytes=48 << 20,
                       sync=SyncPolicy.OFF, snapshot_every=50, segment_bytes=256 << 10)


# --- payload ---------------------------------------------------------------------------------
def pattern(positions: torch.Tensor, salts: torch.Tensor, plane: int, heads: int) -> torch.Tensor:
    """[H, n] payload bytes of these positions (written with these salts) in one plane."""
    h = torch.arange(heads).view(-1, 1)
    v = positions.view(1, -1) * 31 + salts.view(1, -1) * 101 + plane * 7 + h * 13
    return (v & 0xFF).to(torch.uint8)


def recipe_end(recipe: Recipe) -> int:
    return recipe[-1][0] if recipe else 0


def recipe_cut(recipe: Recipe, end: int) -> Recipe:
    """The recipe of the first ``end`` positions."""
    out: list[tuple[int, int]] = []
    start = 0
    for e, s in recipe:
        if start >= end:
            break
        out.append((min(e, end), s))
        start = e
    return tuple(out)


def recipe_add(recipe: Recipe, end: int, salt: int) -> Recipe:
    """Positions [recipe_end, end) written with ``salt``."""
    if end <= recipe_end(recipe):
        return recipe
    if recipe and recipe[-1][1] == salt:
        return (*recipe[:-1], (end, salt))
    return (*recipe, (end, salt))


def encode_recipe(recipe: Recipe) -> str:
    return ",".join(f"{e}:{s}" for e, s in recipe) or "-"


def decode_recipe(text: str) -> Recipe:
    if text == "-":
        return ()
    return tuple((int(e), int(s)) for e, s in (run.split(":") for run in text.split(",")))


def recipe_salts(recipe: Recipe) -> torch.Tensor:
    """The salt of every position [0, end)."""
    ends = [0, *(e for e, _ in recipe)]
    lengths = torch.tensor([b - a for a, b in zip(ends, ends[1:], strict=False)])
    return torch.repeat_interleave(torch.tensor([s for _, s in recipe], dtype=torch.int64),
                                   lengths)


def write_tokens(store: KVStore, seq: int, start: int, end: int, salt: int) -> None:
    """The GPU unit: write the payload of positions [start, end) with ``salt``."""
    pd = store.device.pools["main"]
    row = store.space(seq).row
    planes = store.device.planes("main")
    pos = start
    while pos < end:
        blk = pos // P
        stop = min(end, (blk + 1) * P)
        g = int(pd.block_tables[row, blk])
        positions = torch.arange(pos, stop)
        salts = torch.full_like(positions, salt)
        for k, t in enumerate(planes):
            v = t.view(torch.uint8)  # [N, H, P, X*isz]
            v[g, :, pos % P:pos % P + (stop - pos), :] = \
                pattern(positions, salts, k, t.shape[1]).unsqueeze(-1)
        pos = stop


def check_checkpoint(store: KVStore, ck: int, recipe: Recipe) -> str | None:
    """Recompute the expected bytes of every page of ``ck`` from the host arena: committed
    columns equal the recipe's payload, columns past them are zero."""
    st = store.state
    pool = st.pools["main"]
    planes = store.device.planes("main")
    page_bytes = next(s.page_bytes for s in st.pool_specs if s.name == "main")
    sp = store.space(ck)
    end = recipe_end(recipe)
    if sp.committed != end:
        return f"committed frontier {sp.committed}, acknowledged {end}"
    if len(sp.members) != ceil_div(end, P):
        return f"{len(sp.members)} pages for {end} tokens"
    salts = recipe_salts(recipe)
    assert store.arena is not None
    for b, slot in enumerate(sp.members):
        pg = pool.pages[slot]
        if pg is None or pg.host is None:
            return f"block {b} has no host replica"
        cols = min(P, end - b * P)
        if pg.committed != cols:
            return f"block {b} (page {slot}) commits {pg.committed} columns, recipe {cols}"
        data = store.arena.data[pg.host[0]:pg.host[0] + page_bytes]
        positions = torch.arange(b * P, b * P + cols)
        off = 0
        for k, t in enumerate(planes):
            h, xb = t.shape[1], t.shape[3] * t.element_size()
            region = data[off:off + h * P * xb].view(h, P, xb)
            want = pattern(positions, salts[b * P:b * P + cols], k, h).unsqueeze(-1)
            if not torch.equal(region[:, :cols, :], want.expand(h, cols, xb)):
                return f"block {b} (page {slot}) plane {k}: payload differs"
            if cols < P and bool(region[:, cols:, :].any()):
                return f"block {b} (page {slot}) plane {k}: bytes past committed not zero"
            off += h * P * xb
    return None


# --- the child's workload --------------------------------------------------------------------
class Driver:
    """Drives an open store like an engine with one sequence in flight, reporting on ``fd``
    (protocol in the module docstring). ``recipes``: the payload of every checkpoint the
    store may hold (inherited from the parent); the driver adopts every checkpoint present."""

    def __init__(self, store: KVStore, rng: random.Random, fd: int, reqs: list[Request],
                 recipes: dict[int, Recipe], durable_sources: bool = False) -> None:
        # write_tokens and check_checkpoint index planes as [N, H, P, X] (page-major)
        assert store.device.pools["main"].geometry.order is PlaneOrder.PAGE_MAJOR
        self.store, self.rng, self.fd, self.reqs = store, rng, fd, reqs
        self.mine: dict[int, Recipe] = {}   # checkpoint -> recipe, oldest first
        self.durable: set[int] = set()      # acknowledged and not released since
        self.pending: list[int] = []        # offload queued: ACK after the next boundary
        self.durable_sources = durable_sources  # continue only from acknowledged checkpoints
        self.i = rng.randrange(len(reqs))
        for ck in store.checkpoints():      # what the restart kept is durable
            recipe = recipes.get(ck)
            if recipe is not None:
                self.mine[ck] = recipe
                self.durable.add(ck)
                self.say("ACK", ck)

    # --- protocol ----------------------------------------------------------------------------
    def say(self, *words: object) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())

    def forget(self, ck: int) -> Recipe:
        """REL before anything that may make ``ck`` disappear; the driver stops using it."""
        self.say("REL", ck)
        self.durable.discard(ck)
        if ck in self.pending:
            self.pending.remove(ck)
        return self.mine.pop(ck)

    def flush_acks(self) -> None:
        for ck in self.pending:
            if ck in self.mine:
                self.durable.add(ck)
                self.say("ACK", ck)
        self.pending.clear()

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """A GPU unit: the boundary published (and synced) every queued offload first."""
        with self.store.boundary():
            self.flush_acks()
            yield

    def publish(self) -> None:
        with self.unit():
            pass

    # --- capacity ----------------------------------------------------------------------------
    def roomy(self, fn: Callable[[], T], avoid: int | None = None) -> T | None:
        """``fn()``; on CapacityExhausted/HostArenaError (raised before anything is emitted)
        drop device replicas, then release the oldest checkpoints, and retry."""
        for attempt in range(MAX_CHECKPOINTS + 2):
            try:
                return fn()
            except (CapacityExhausted, HostArenaError):
                if not self.make_room(attempt, avoid):
                    return None
        return None

    def make_room(self, attempt: int, avoid: int | None) -> bool:
        if attempt == 0:
            for ck in list(self.mine):
                self.store.drop_device(ck)
            self.publish()
            return True
        victims = [ck for ck in self.mine if ck != avoid]
        if not victims:
            return False
        self.forget(victims[0])
        self.store.release(victims[0])
        self.publish()
        return True

    # --- actions -----------------------------------------------------------------------------
    def next_request(self) -> tuple[int, int]:
        r = self.reqs[self.i % len(self.reqs)]
        self.i += 1
        return max(8, min(1500, r.prompt // 64)), max(1, min(300, r.output))

    def pick_frontier(self, committed: int) -> int:
        x = self.rng.random()
        mid = [f for f in (self.rng.randint(1, committed) for _ in range(4)) if f % P]
        if x < 0.6 and mid:
            return mid[0]
        if x < 0.8:
            return P * self.rng.randint(0, committed // P)
        return committed

    def new_request(self) -> None:
        prompt, out = self.next_request()
        seq = self.roomy(lambda: self.store.activate(prompt, out))
        if seq is not None:
            self.serve(seq, (), 0, prompt, prompt + self.rng.randint(1, out))

    def continue_from(self, ck: int, keep_source: bool) -> bool:
        """Fork (keep the source) or Move-or-Fork-and-release from ``ck``."""
        recipe = self.mine[ck]
        f = self.pick_frontier(recipe_end(recipe))
        prompt, out = self.next_request()
        prompt = max(prompt, f)
        out = min(out, 2048 - prompt)
        if out < 1:
            prompt, out = f, 1
        if not keep_source:
            self.forget(ck)
        seq = self.roomy(lambda: self.store.activate_from(ck, f, prompt, out,
                                                          keep_source=keep_source), avoid=ck)
        if seq is None:
            if not keep_source:  # not consumed: still present, no longer acknowledged
                self.mine[ck] = recipe
            return False
        self.serve(seq, recipe_cut(recipe, f), f, prompt, prompt + self.rng.randint(1, out))
        return True

    def serve(self, seq: int, recipe: Recipe, start: int, prompt: int, target: int) -> None:
        """Chunked prefill to ``prompt``, decode to ``target``; finish, retain, offload."""
        store, rng = self.store, self.rng
        salt = rng.randrange(256)
        prefill = rng.choice([64, 200, 512, 4096])
        decode = rng.choice([1, 1, 4, 16, 64])
        frontier = start
        # once in a while roll back (truncate) at some point and rewrite with another salt
        roll = rng.randint(start + 1, target) if rng.random() < 0.15 else target + 1
        while frontier < target:
            limit, step = (prompt, prefill) if frontier < prompt else (target, decode)
            nxt = min(limit, frontier + step)
            store.ensure_mapped(seq, "main", nxt)
            with self.unit():
                write_tokens(store, seq, frontier, nxt, salt)
            store.commit(seq, "main", nxt)
            recipe = recipe_add(recipe, nxt, salt)
            frontier = nxt
            if roll <= frontier < target:
                roll = target + 1
                back = rng.randint(store.space(seq).protected, frontier)
                with contextlib.suppress(WritePermissionError):
                    store.truncate(seq, "main", back)
                    recipe, frontier = recipe_cut(recipe, back), back
                    salt = (salt + 1 + rng.randrange(255)) % 256
        if rng.random() < 0.07:
            store.finish(seq, retain=False, reason="abort")
            if rng.random() < 0.5:
                self.publish()
            return
        ck = store.finish(seq, retain=True)
        assert ck is not None
        self.say("CK", ck, encode_recipe(recipe))
        self.mine[ck] = recipe
        self.offload(ck, drop_device=rng.random() < 0.5)
        if rng.random() < 0.2 and ck in self.mine and not self.durable_sources:
            # continue before the publishing boundary (from a not yet durable checkpoint)
            self.continue_from(ck, keep_source=rng.random() < 0.7)
        if self.pending:
            self.publish()
        self.trim_checkpoints()

    def offload(self, ck: int, drop_device: bool) -> None:
        if self.roomy(lambda: self.store.offload(ck, drop_device=drop_device), avoid=ck) \
                is not None and ck in self.mine:
            self.pending.append(ck)

    def trim_checkpoints(self) -> None:
        while len(self.mine) > MAX_CHECKPOINTS:
            ck = next(iter(self.mine))
            self.forget(ck)
            self.store.release(ck)
            if self.rng.random() < 0.5:
                self.publish()

    def drop_host(self, ck: int) -> None:
        """Host replicas of ``ck``'s device-resident pages go; every checkpoint sharing one of
        its pages stops being durable (REL) until re-offloaded."""
        slots = set(self.store.space(ck).members)
        for other in [c for c in self.mine if slots & set(self.store.space(c).members)]:
            recipe = self.forget(other)
            self.mine[other] = recipe
        self.store.drop_host(ck)
        if self.rng.random() < 0.7:
            self.publish()

    def step(self) -> None:
        rng, store = self.rng, self.store
        x = rng.random()
        cks = list(self.mine)
        sources = [c for c in cks if c in self.durable] if self.durable_sources else cks
        loose = [c for c in cks if c not in self.durable and c not in self.pending]
        if loose and rng.random() < 0.5:
            self.offload(rng.choice(loose), drop_device=rng.random() < 0.3)
            self.publish()
        elif not cks or x < 0.35:
            self.new_request()
        elif x < 0.60 and sources:
            self.continue_from(rng.choice(sources), keep_source=True)
        elif x < 0.72 and sources:
            self.continue_from(rng.choice(sources), keep_source=False)
        elif x < 0.72:
            self.new_request()
        elif x < 0.80:
            store.drop_device(rng.choice(cks))
            if rng.random() < 0.7:
                self.publish()
        elif x < 0.85:
            self.drop_host(rng.choice(cks))
        elif x < 0.93:
            ck = rng.choice(cks)
            self.forget(ck)
            store.release(ck)
            if rng.random() < 0.5:  # else the release rides on a later boundary
                self.publish()
        elif x < 0.97:
            store.snapshot()
        else:
            store.snapshot()
            store.compact()
        if rng.random() < 0.05:
            for v in store.violations():
                self.say("VIO", v.replace("\n", " "))

    def run(self, actions: int | None = None, deadline: float | None = None) -> None:
        n = 0
        while (actions is None or n < actions) and (deadline is None
                                                     or time.monotonic() < deadline):
            self.step()
            n += 1


# --- fork server -----------------------------------------------------------------------------
def prepare_process() -> None:
    """Make this process safe to fork after warming up (see the module docstring)."""
    from numba.np.ufunc import parallel

    if parallel._is_initialized and numba.threading_layer() != "workqueue":
        raise RuntimeError(f"numba's {numba.threading_layer()!r} threading layer already runs in "
                           "this process and is not fork-safe; run the soak as a script "
                           "(python benchmarks/crash_soak.py)")
    numba.config.THREADING_LAYER = "workqueue"
    torch.set_num_threads(1)


def warm_up(reqs: list[Request], seed: int) -> float:
    """Run the workload on a throwaway store, through a clean restart, until offload (D2H),
    restore (H2D) and COW copies have all run: every kernel the child calls is compiled."""
    t0 = time.monotonic()
    d = tempfile.mkdtemp(prefix="ninfer-kv-soak-warm-")
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        recipes: dict[int, Recipe] = {}
        seen = {"d2h_pages": 0, "h2d_pages": 0, "cow_copies": 0}
        for rnd in range(20):
            store = KVStore.open(config(d))
            try:
                drv = Driver(store, random.Random(seed * 7919 + rnd), fd, reqs, recipes)
                drv.run(actions=25)
                for k in seen:
                    seen[k] += store.stats[k]
                bad = store.violations()
                if bad:
                    raise AssertionError(f"warm-up: invariants broken: {bad[:3]}")
                recipes = dict(drv.mine)
            finally:
                store.close()
            if rnd >= 1 and all(seen.values()):
                break
    finally:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    return time.monotonic() - t0


class LineReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.lines: list[str] = []
        self.eof = False

    def _read(self, timeout: float) -> None:
        r, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if r:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.eof = True
            self.buf += chunk
            *done, self.buf = self.buf.split(b"\n")
            self.lines.extend(x.decode() for x in done)

    def until_line(self, prefix: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.eof and time.monotonic() < end:
            if any(x.startswith(prefix) for x in self.lines):
                return True
            self._read(end - time.monotonic())
        return any(x.startswith(prefix) for x in self.lines)

    def until(self, deadline: float) -> None:
        while not self.eof and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())

    def to_eof(self) -> None:
        while not self.eof:
            self._read(5.0)


def _child(directory: str, reqs: list[Request], seed: int, fd: int,
           recipes: dict[int, Recipe], durable_sources: bool) -> NoReturn:
    code = 0
    try:
        store = KVStore.open(config(directory))
        os.write(fd, b"OPEN\n")
        Driver(store, random.Random(seed), fd, reqs, recipes, durable_sources).run(
            deadline=time.monotonic() + CHILD_LIMIT_S)
        code = 4  # ran out of time: the parent should have killed it long ago
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        code = 3
    finally:
        os._exit(code)


@dataclass
class Costs:
    """Seconds per phase, summed over kills."""

    open: float = 0.0        # fork -> OPEN (child recovery)
    run: float = 0.0         # OPEN -> SIGKILL
    reap: float = 0.0
    reopen: float = 0.0      # parent recovery
    check: float = 0.0
    compact: float = 0.0     # snapshot + compact + close
    reopen_max: float = 0.0
    reopen_first: list[float] = field(default_factory=list)
    reopen_last: list[float] = field(default_factory=list)


def soak(kills: int, trace: str, directory: str, seed: int = 0, log: bool = True,
         max_delay: float = 0.5, early: float = 0.1,
         durable_sources: bool = False) -> dict[str, float]:
    prepare_process()
    reqs = load_trace(trace)
    t_start = time.monotonic()
    warm = warm_up(reqs, seed)
    rng = random.Random(seed)
    recipes: dict[int, Recipe] = {}
    durable: set[int] = set()
    acked: set[int] = set()
    totals = {"kills": 0, "acknowledged": 0, "lost": 0, "corrupt_served": 0, "violations": 0,
              "child_errors": 0, "early_kills": 0, "reopen_failures": 0}
    costs = Costs()
    open_est = 0.05
    t_loop = time.monotonic()
    for k in range(kills):
        child_seed = seed * 100003 + k
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(directory, reqs, child_seed, w, recipes, durable_sources)
        os.close(w)
        reader = LineReader(r)
        aim_early = rng.random() < early
        if aim_early:  # land in the child's open/recovery
            totals["early_kills"] += 1
            reader.until(t0 + rng.uniform(0.0, 1.5 * open_est))
            t_open = time.monotonic()
        else:
            if not reader.until_line("OPEN", FIRST_LINE_TIMEOUT_S) and log:
                print(f"kill {k}: child (seed {child_seed}) never opened the store")
            t_open = time.monotonic()
            open_est = 0.8 * open_est + 0.2 * (t_open - t0)
            reader.until(t_open + rng.uniform(0.0, max_delay))
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        reader.to_eof()
        os.close(r)
        t_reaped = time.monotonic()
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            totals["child_errors"] += 1
            if log:
                print(f"kill {k}: child (seed {child_seed}) exited by itself, status {status}")
        for line in reader.lines:
            kind, _, rest = line.partition(" ")
            if kind == "CK":
                ck, _, text = rest.partition(" ")
                recipes[int(ck)] = decode_recipe(text)
            elif kind == "ACK":
                durable.add(int(rest))
                acked.add(int(rest))
            elif kind == "REL":
                durable.discard(int(rest))
            elif kind == "VIO":
                totals["violations"] += 1
                if log:
                    print(f"kill {k} (seed {child_seed}): live violation: {rest}")
        totals["kills"] += 1

        try:
            store = KVStore.open(config(directory))
        except KVStoreError as exc:
            # the store no longer opens: everything acknowledged is out of reach (a store bug,
            # never a harness outcome); stop here — later kills would only repeat it
            totals["reopen_failures"] += 1
            totals["lost"] += len(durable)
            if log:
                print(f"kill {k} (seed {child_seed}): REOPEN FAILED, {len(durable)} acknowledged "
                      f"checkpoints out of reach: {type(exc).__name__}: {exc} "
                      f"(cause: {exc.__cause__!r})")
            break
        t_reopened = time.monotonic()
        try:
            violations = store.violations()
            totals["violations"] += len(violations)
            if log and violations:
                print(f"kill {k} (seed {child_seed}): VIOLATIONS {violations[:3]}")
            for ck in sorted(durable):
                b = store.state.bundles.get(ck)
                if b is None or b.active:
                    totals["lost"] += 1
                    if log:
                        print(f"kill {k} (seed {child_seed}): LOST {ck}: "
                              f"{store.recovery.dropped.get(ck, 'absent')}")
            present = store.checkpoints()
            for ck in present:
                recipe = recipes.get(ck)
                why = "no CK line for it" if recipe is None else check_checkpoint(store, ck,
                                                                                  recipe)
                if why is not None:
                    totals["corrupt_served"] += 1
                    if log:
                        print(f"kill {k} (seed {child_seed}): CORRUPT {ck}: {why}")
            # what is gone stays gone (ids are never reused once journaled)
            recipes = {ck: recipes[ck] for ck in present if ck in recipes}
            durable &= set(present)
            t_checked = time.monotonic()
            store.snapshot()
            store.compact()
        finally:
            store.close()
        t_end = time.monotonic()
        costs.open += t_open - t0
        costs.run += t_kill - t_open
        costs.reap += t_reaped - t_kill
        costs.reopen += t_reopened - t_reaped
        costs.check += t_checked - t_reopened
        costs.compact += t_end - t_checked
        costs.reopen_max = max(costs.reopen_max, t_reopened - t_reaped)
        (costs.reopen_first if k < 100 else costs.reopen_last).append(t_reopened - t_reaped)
        if len(costs.reopen_last) > 100:
            costs.reopen_last.pop(0)
    totals["acknowledged"] = len(acked)
    loop = time.monotonic() - t_loop
    n = max(1, totals["kills"])
    journal = Path(directory) / "journal"
    jfiles = list(journal.iterdir()) if journal.is_dir() else []
    if log:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        print(f"cost: {loop / n:.3f} s/kill over {n} kills ({loop:.1f} s; warm-up {warm:.1f} s, "
              f"total {time.monotonic() - t_start:.1f} s)")
        print(f"  per kill: child open {costs.open / n:.3f}  child run {costs.run / n:.3f}  "
              f"reap {costs.reap / n:.3f}  parent reopen {costs.reopen / n:.3f} "
              f"(max {costs.reopen_max:.3f}; first 100 {mean(costs.reopen_first):.3f}, "
              f"last 100 {mean(costs.reopen_last):.3f})  check {costs.check / n:.3f}  "
              f"snapshot+compact+close {costs.compact / n:.3f}")
        print(f"  journal at end: {len(jfiles)} files, "
              f"{sum(f.stat().st_size for f in jfiles) >> 10} KiB; early kills "
              f"{totals['early_kills']}; child errors {totals['child_errors']}; reopen failures "
              f"{totals['reopen_failures']}")
    totals["seconds_per_kill"] = loop / n
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=0.5)
    ap.add_argument("--early", type=float, default=0.1)
    ap.add_argument("--durable-sources", action="store_true",
                    help="continue (Fork/Move) only from acknowledged checkpoints")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if not a.verbose:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    directory = a.dir or tempfile.mkdtemp(prefix="ninfer-kv-soak-")
    t = soak(a.kills, a.trace, directory, a.seed, max_delay=a.max_delay, early=a.early,
             durable_sources=a.durable_sources)
    print(f"kills={t['kills']} acknowledged={t['acknowledged']} lost={t['lost']} "
          f"corrupt_served={t['corrupt_served']} violations={t['violations']}")
    if t["child_errors"] or t["reopen_failures"] or t["lost"] or t["corrupt_served"] or t["violations"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
