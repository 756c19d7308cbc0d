"""A random walk over the store's whole lifecycle with a shadow of the KV *bytes*.

The state machine (test_state_machine.py) holds the control plane to a model; this walk holds
the data plane: every token written gets bytes unique to (its lineage's tag, its position,
its plane), and after every operation each sequence's and checkpoint's committed tokens must
read back as exactly the bytes the shadow says — active sequences through their *published*
block-table row (§6.1: the table is the execution mirror), checkpoints through their device
page or their packed host replica (§5.1). So a request that reads another's page, a COW tail
(§9.3) that copies the wrong columns, a restore into the wrong page group, a freed page still
mapped, or a table row that was not republished shows up as wrong bytes.

Bait: every unit also writes junk (tags >= ``JUNK``) above what it will commit, and commits
sometimes accept only a prefix (speculative rejection). Junk must never become anyone's
committed token. Refused commands must leave the digest, the pending events, the queued
copies and the occupancy unchanged (§14). Operations: activate, units (several sequences, a
mapped lead), fork_live with parent and child writing in one unit, share_prefix, truncate,
provisional + trim, finish (retained or not), activate_from (auto, Move, Fork, at mid-page and
aligned frontiers, per-pool frontiers on MTP/DFlash), release, release_tail, offload,
drop_device, drop_host, swap out/in, snapshot, compact, reopen, kill -9, and faults injected
at every activation step. From an outside review (2026-12-03); it caught a hand mutation of
Trim that dropped a whole membership.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ninfer_kv.cache.preemption import swap_in, swap_out
from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import CapacityExhausted, KVStoreError
from tests.engine.conftest import crash
from tests.engine.shadow import _planes, pattern, write

JUNK = 10_000  # tags of bytes written above the commit point
STEPS = ("create", "reserve", "restore", "move_fork", "cow", "rows", "tables", "publish")


class DataWalk:
    def __init__(self, seed: int, root: Path, backend: Backend = Backend.OFF, pages: int = 20,
                 checked: bool = True, concurrency: int = 5) -> None:
        self.rng = random.Random(seed)
        model = ModelGeometry(layers=1, kv_heads=1, head_dim=16, mtp_layers=1,
                              draft_layers=1 if backend is Backend.DFLASH else 0,
                              draft_kv_heads=1, draft_head_dim=16)
        serving = ServingConfig(max_context=768, max_concurrency=concurrency, backend=backend,
                                draft_window=4)
        self.cfg = StoreConfig(model=model, serving=serving, kv_tokens=pages * P,
                               journal_dir=str(root / "j"), host_bytes=2 << 20,
                               persist_dir=str(root / "p"), checked=checked,
                               segment_bytes=16 << 10)
        self.s = KVStore.open(self.cfg)
        self.content: dict[tuple[int, str], list[int]] = {}  # (seq, pool) -> committed tags
        self.tag = 0
        self.log: list[str] = []
        self.per_pool = backend is not Backend.OFF

    # --- the bytes (the payload of tests/engine/shadow.py) -------------------------------------
    def _planes(self, pool: str) -> tuple[list[torch.Tensor], PlaneOrder]:
        return _planes(self.s, pool)

    def write(self, seq: int, pool: str, start: int, tags: list[int]) -> None:
        write(self.s, seq, pool, start, tags)

    def _differs(self, pool: str, pages: list[torch.Tensor], tags: list[int],
                 base: int) -> str | None:
        planes, order = self._planes(pool)
        n = len(tags)
        for k, (got, t) in enumerate(zip(pages, planes, strict=True)):
            heads = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
            want = pattern(torch.tensor(tags), torch.arange(base, base + n), k, heads,
                           t.shape[3])
            for c in range(n):
                if not torch.equal(got.reshape(heads, P, -1)[:, c], want[:, c]):
                    return f"plane {k} column {c} (position {base + c}, tag {tags[c]})"
        return None

    def check_all(self, via_table: bool) -> None:
        """Every sequence's and checkpoint's committed tokens read back as the shadow's
        bytes: active ones through their published table row when ``via_table`` (no
        boundary owed), checkpoints through their device page or host replica."""
        s, st = self.s, self.s.state
        bad: list[str] = []
        for b, bundle in st.bundles.items():
            for pool in bundle.pools:
                p, want = st.pools[pool], self.content.get((b, pool))
                sp = p.spaces[b]
                if want is None or sp.committed != len(want):
                    bad.append(f"seq {b} {pool}: committed {sp.committed}, shadow "
                               f"{None if want is None else len(want)}")
                    continue
                planes, order = self._planes(pool)
                for block in range(-(-len(want) // P)):
                    tags = want[block * P:(block + 1) * P]
                    page = p.pages[sp.member(block)]
                    assert page is not None
                    where = f"seq {b} {pool} block {block} (slot {page.slot})"
                    if sp.active and via_table:
                        g = int(s.device.pools[pool].block_tables[sp.row, block])
                        if g != page.device:
                            bad.append(f"{where}: table maps {g}, state {page.device}")
                            continue
                    if page.device != -1:
                        got = [t[page.device] if order is PlaneOrder.PAGE_MAJOR
                               else t[:, page.device] for t in planes]
                    elif page.host is not None and s.arena is not None:
                        raw = torch.as_tensor(s.arena.data[page.host[0]:])
                        got, off = [], 0
                        for t in planes:  # packed plane after plane, each [heads, P, width]
                            nb = t[0].numel() if order is PlaneOrder.PAGE_MAJOR else \
                                t[:, 0].numel()
                            got.append(raw[off:off + nb])
                            off += nb
                    else:
                        bad.append(f"{where}: no replica")
                        continue
                    why = self._differs(pool, got, tags, block * P)
                    if why:
                        bad.append(f"{where} on {'device' if page.device != -1 else 'host'}"
                                   f": {why}")
        assert not bad, "wrong bytes: " + "; ".join(bad[:6])

    # --- driving --------------------------------------------------------------------------------
    def attempt(self, name: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:  # noqa: ANN401
        """``fn(*a, **kw)``, or None when refused — refused with a typed error and nothing
        changed (§14)."""
        s = self.s
        seen = lambda: (s.digest(), len(s._pending), len(s._effects), str(s.occupancy()))  # noqa: E731
        before = seen()
        try:
            out = fn(*a, **kw)
        except KVStoreError as exc:
            assert seen() == before, f"{name}{a} refused ({exc!r}) but changed the state"
            self.log.append(f"{name}{a}{kw} -> refused {type(exc).__name__}")
            return None
        self.log.append(f"{name}{a}{kw} -> {out}")
        return True if out is None else out

    def boundary(self) -> None:
        with self.s.boundary():
            self.check_all(True)
        self.s.check_invariants()

    def pick(self, xs: list[int]) -> int | None:
        return self.rng.choice(sorted(xs)) if xs else None

    def frontier_for(self, committed: dict[str, int], choices: list[int]) -> Any:  # noqa: ANN401
        f = self.rng.choice(choices)
        if self.per_pool and self.rng.random() < 0.5:
            return {p: self.rng.randint(0, c) for p, c in committed.items()}
        return f

    def inherit(self, dst: int, src: int, f: Any, whole_pages: bool = False) -> None:  # noqa: ANN401
        for p in self.s.pools:
            fp = f[p] if isinstance(f, dict) else f
            self.content[(dst, p)] = self.content[(src, p)][:fp // P * P if whole_pages else fp]

    def inject_fault(self) -> None:
        step, pool = self.rng.choice(STEPS), self.rng.choice(self.s.pools)

        def hook(at: str, name: str) -> None:
            if (at, name) == (step, pool):
                raise CapacityExhausted(f"injected at {at} {name}", pool=name)
        self.s.fault_hook = hook

    def reopened(self, kill: bool) -> None:
        if kill:
            crash(self.s)
        else:
            self.s.close()
        self.log.append("kill -9" if kill else "reopen")
        self.s = KVStore.open(self.cfg)
        for key in [k for k in self.content if k[0] not in self.s.state.bundles]:
            del self.content[key]
        self.check_all(False)
        self.s.check_invariants()

    # --- operations -----------------------------------------------------------------------------
    def op_activate(self) -> None:
        if self.rng.random() < 0.1:
            self.inject_fault()
        try:
            b = self.attempt("activate", self.s.activate, self.rng.randint(1, 300),
                             self.rng.randint(1, 200))
        finally:
            self.s.fault_hook = None
        if b is not None:
            for p in self.s.pools:
                self.content[(b, p)] = []

    def op_unit(self, seqs: list[int] | None = None) -> None:
        """One GPU unit: map (sometimes a lead past what it commits), write the new tokens
        and junk above them inside the boundary, commit all or a prefix."""
        s = self.s
        act = sorted(s.active())
        if not act:
            return
        seqs = seqs or self.rng.sample(act, self.rng.randint(1, len(act)))
        tokens = self.rng.choice([1, 1, 3, 17, 63, 64, 65, 130])
        plans: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
        for pool in s.pools:
            plan, lead = {}, {}
            for b in seqs:
                sp = s.space(b, pool)
                room = min(sp.entitlement, s.plan.L) * P
                n = tokens if not self.per_pool or self.rng.random() < 0.5 else \
                    self.rng.choice([0, 1, 2, 40, 70])
                plan[b] = sp.committed + min(n, max(0, room - sp.committed))
                lead[b] = min(plan[b] + self.rng.choice([0, 0, 5, 40]), room)
            if self.attempt("ensure_mapped_many", s.ensure_mapped_many, pool, list(lead),
                            list(lead.values())) is None:
                if self.attempt("ensure_mapped_many", s.ensure_mapped_many, pool, list(plan),
                                list(plan.values())) is None:
                    return
                lead = dict(plan)
            plans[pool] = (plan, lead)
        self.tag += 1
        with s.boundary():
            self.check_all(True)
            for pool, (plan, lead) in plans.items():
                for b, f in plan.items():
                    old = s.space(b, pool).committed
                    self.write(b, pool, old, [self.tag] * (f - old))
                    end = min(lead[b], s.space(b, pool).nmem * P)
                    self.write(b, pool, f, [JUNK + self.tag] * max(0, end - f))
        s.check_invariants()
        for pool, (plan, _) in plans.items():
            got = {b: f if self.rng.random() < 0.8 else
                   self.rng.randint(s.space(b, pool).committed, f) for b, f in plan.items()}
            if self.attempt("commit_many", s.commit_many, pool, list(got), list(got.values())):
                for b, f in got.items():
                    c = self.content[(b, pool)]
                    c.extend([self.tag] * (f - len(c)))

    def op_fork_live(self) -> None:
        b = self.pick(self.s.active())
        if b is None:
            return
        committed = {p: self.s.space(b, p).committed for p in self.s.pools}
        c = min(committed.values())
        f = self.frontier_for(committed, [c, self.rng.randint(0, c), c - c % P])
        dst = self.attempt("fork_live", self.s.fork_live, b, self.rng.randint(1, 150), f)
        if dst is not None:
            self.inherit(dst, b, f)
            if self.rng.random() < 0.6:  # parent and child write in the same unit
                self.op_unit([b, dst])

    def op_share(self) -> None:
        b = self.pick(self.s.active())
        if b is not None:
            f = self.rng.randint(0, min(self.s.space(b, p).committed for p in self.s.pools))
            ck = self.attempt("share_prefix", self.s.share_prefix, b, f)
            if ck is not None:
                self.inherit(ck, b, f, whole_pages=True)

    def op_truncate(self) -> None:
        b = self.pick(self.s.active())
        for p in self.s.pools if b is not None else []:
            f = max(0, self.s.space(b, p).committed - self.rng.choice([1, 5, 30, 64, 70, 200]))
            if self.attempt("truncate", self.s.truncate, b, p, f):
                del self.content[(b, p)][f:]

    def op_trim(self) -> None:
        b = self.pick(self.s.active())
        for p in self.s.pools if b is not None else []:
            sp = self.s.space(b, p)
            self.attempt("set_provisional", self.s.set_provisional, b, p,
                         min(sp.committed + self.rng.randint(0, 70), sp.nmem * P))
            self.attempt("trim", self.s.trim, b, p)

    def op_finish(self) -> None:
        b = self.pick(self.s.active())
        retain = self.rng.random() < 0.7
        if b is not None and self.attempt("finish", self.s.finish, b, retain=retain) \
                and not retain:
            for p in self.s.pools:
                del self.content[(b, p)]

    def op_activate_from(self) -> None:
        ck = self.pick(self.s.checkpoints())
        if ck is None:
            return
        committed = {p: self.s.space(ck, p).committed for p in self.s.pools}
        lo = min(committed.values())
        f = self.frontier_for(committed, [lo, self.rng.randint(0, lo), lo - lo % P])
        top = max(f.values()) if isinstance(f, dict) else f
        if self.rng.random() < 0.15:
            self.inject_fault()
        try:
            dst = self.attempt("activate_from", self.s.activate_from, ck, f,
                               top + self.rng.randint(1, 40), self.rng.randint(1, 100),
                               keep_source=self.rng.random() < 0.5,
                               mode=self.rng.choice(["auto", "auto", "move", "fork"]))
        finally:
            self.s.fault_hook = None
        if dst is not None:
            self.inherit(dst, ck, f)
            if self.rng.random() < 0.5:
                self.op_unit([dst])

    def op_release_tail(self) -> None:
        ck = self.pick(self.s.checkpoints())
        if ck is not None:
            committed = {p: self.s.space(ck, p).committed for p in self.s.pools}
            f = self.frontier_for(committed, [self.rng.randint(0, min(committed.values()))])
            new = self.attempt("release_tail", self.s.release_tail, ck, f)
            if new is not None and new is not True:
                self.inherit(new, ck, f, whole_pages=True)

    def on_checkpoint(self, name: str, **kw: Any) -> None:  # noqa: ANN401
        ck = self.pick(self.s.checkpoints())
        if ck is not None:
            self.attempt(name, getattr(self.s, name), ck, **kw)

    def op_swap(self) -> None:
        b = self.pick(self.s.active())
        if b is None:
            return
        c = max(self.s.space(b, p).committed for p in self.s.pools)
        try:
            out = swap_out(self.s, b, min(self.s.plan.S, c + self.rng.randint(1, 100)))
        except KVStoreError:
            return
        self.boundary()
        try:
            new = swap_in(self.s, out)
        except KVStoreError:
            return
        self.inherit(new, out.checkpoint, out.frontier)

    def step(self) -> None:
        r, s = self.rng.random(), self.s
        ops: list[tuple[float, Callable[[], None]]] = [
            (6, self.op_activate), (14, self.op_unit), (5, self.op_fork_live),
            (3, self.op_share), (3, self.op_truncate), (2, self.op_trim), (5, self.op_finish),
            (6, self.op_activate_from), (3, lambda: self.on_checkpoint("release")),
            (2, self.op_release_tail),
            (3, lambda: self.on_checkpoint("offload", drop_device=self.rng.random() < 0.5)),
            (2, lambda: self.on_checkpoint("drop_device")),
            (1, lambda: (b := self.pick(list(s.state.bundles))) is not None
             and self.attempt("drop_host", s.drop_host, b)),
            (2, self.op_swap), (4, self.boundary), (1, lambda: self.reopened(kill=False)),
            (1, lambda: self.reopened(kill=True)),
            (1, lambda: self.attempt("snapshot", s.snapshot) and self.rng.random() < 0.5
             and self.attempt("compact", s.compact))]
        r *= sum(w for w, _ in ops)
        for w, op in ops:
            if r < w:
                op()
                break
            r -= w
        self.s.check_invariants()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        self.boundary()
        self.s.close()
