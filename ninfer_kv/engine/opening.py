"""Opening a store: lock, recover read-only, validate, allocate, and only then write.

The order is the rule (issue: "a refused open has already truncated the arena"):

1. the configuration is validated (``StoreConfig.__post_init__``) and planned;
2. the persistence/journal directories are created 0700 if missing and locked (``LOCK``) —
   the only files written before validation, and neither holds user data;
3. the journal is scanned and replayed *without repairing anything* (snapshot + tail): a
   snapshot whose state breaks §14 is skipped like a damaged one, and the recovered state
   must pass the full §14 check too;
4. the recovered pool set, model geometry, host capacity and host persistence are compared
   with the configuration, and the host arena's identity token with the journal's
   (``_check_arena``) — a mismatch raises ``ConfigError`` with every file as it was;
5. device planes, block tables and an in-memory host arena are allocated (CPU planes larger
   than all the memory the process could hold are refused first, ``_check_fits``; an
   allocation failure is a ``ConfigError``, still before any file changed);
6. only now: the journal's torn tail is cut and a new segment started, the host arena file
   is mapped (and sized), and the restart cleanup record is written and synced.

Any failure releases the locks and closes what was opened.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ninfer_kv.engine import state as state_mod
from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import CapacityPlan, geometry_mismatch
from ninfer_kv.engine.config import RecoveryReport, StoreConfig
from ninfer_kv.engine.device import DeviceState
from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.invariants import load_snapshot, violations
from ninfer_kv.engine.state import MAX_BUNDLE, StoreState
from ninfer_kv.errors import ConfigError, InvalidArgument, JournalCorrupt, JournalError
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.fs import OS_FS, fsync_dir, open_private, replace_durably
from ninfer_kv.journal.ids import CUT_NOTE, NEXT_ID, clear_cut_note, read_count, write_count
from ninfer_kv.journal.lock import lock_dirs
from ninfer_kv.journal.log import Journal, JournalOptions
from ninfer_kv.journal.restore import recover_state

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn

ARENA_NAME = "host_arena.bin"
ARENA_ID = "ARENA"  # in the journal directory: the token of the arena file its replicas are in
T = TypeVar("T")


def _token(path: str) -> str | None:
    """The arena identity token stored at ``path`` (None: no such file)."""
    try:
        fd = open_private(path, os.O_RDONLY)  # never through a symlink, as every store file
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return os.read(fd, 64).decode("ascii", errors="replace").strip()
    except OSError as exc:  # e.g. a directory under the token's name
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _check_arena(state: StoreState, arena_path: str, jdir: str | None) -> str | None:
    """The arena file may be opened by this store: an identity token beside each side
    (``<jdir>/ARENA`` and ``<arena>.id``) says which journal's host replicas it holds.
    ``ConfigError``, before anything is written, when

    - the arena carries another journal's token (or this store has no journal): opening it
      would resize it and write over that journal's durable checkpoints (a new or mistyped
      ``journal_dir`` on an existing ``persist_dir``);
    - this journal holds published host replicas and the arena is missing or is not the one
      they were published in (a mistyped ``persist_dir``): every replica's CRC would fail and
      the checkpoints would be released for good.

    An arena without a token is adopted when nothing is lost by it: this journal holds no
    published replica (a crash between the two token writes of a first open), or — a
    journal older than the tokens — holds them and has no token either. Returns the
    journal's token (None: a new one is made)."""
    mine = _token(os.path.join(jdir, ARENA_ID)) if jdir is not None else None
    theirs = _token(arena_path + ".id")
    exists = os.path.lexists(arena_path)
    held = state.host is not None and bool(state.host.live)
    if theirs is not None and theirs != mine:
        raise ConfigError(f"host arena {arena_path} belongs to another journal (its token "
                          f"{theirs!r}; journal {jdir} has {mine!r}): a wrong journal_dir or "
                          "persist_dir? Opening it would overwrite that journal's durable "
                          "checkpoints")
    if held and mine is not None and (theirs is None or not exists):
        why = "missing" if not exists else f"its token None != {mine!r}"
        raise ConfigError(f"host arena {arena_path} is not the one journal {jdir} published "
                          f"its host replicas in ({why}): a wrong persist_dir? If that arena "
                          f"is lost for good, remove {os.path.join(jdir or '', ARENA_ID)} and "
                          f"{arena_path}.id and create an empty {arena_path}: the reopen then "
                          "drops the checkpoints it held")
    if held and not exists:
        raise ConfigError(f"host arena {arena_path} is missing, and journal {jdir} holds "
                          "published host replicas in it: a wrong persist_dir? If it is lost "
                          "for good, create it empty: the reopen then drops those checkpoints")
    return mine


def pool_specs(plan: CapacityPlan) -> list[ev.PoolSpec]:
    """The pools ``plan`` lays out, as its journal's Configure records them: a journal (or a
    leader's state) with other specs holds another layout's pages."""
    return [ev.PoolSpec(kind.value, g.capacity, plan.C, plan.L, g.page_bytes)
            for kind, g in plan.layout.pools.items()]


def _apply_record(st: StoreState, seq: int, payload: memoryview) -> None:
    for e in CODEC.decode(payload):
        apply(st, e)
    st.seq = seq


def _check_matches(state: StoreState, config: StoreConfig, plan: CapacityPlan,
                   specs: list[ev.PoolSpec], arena_path: str | None, jdir: str | None) -> None:
    """The journal's pools, model geometry and host tier are the configuration's (§3.3:
    fixed at startup) — otherwise its pages would be read as another model's KV."""
    if state.pool_specs != specs:
        raise ConfigError(f"journal {jdir} was written for pools {state.pool_specs}, this "
                          f"config plans {specs}")
    differ = geometry_mismatch(state.plan, plan.to_dict())
    if differ:
        raise ConfigError(f"journal {jdir} was written for another geometry: "
                          + "; ".join(differ))
    have = state.host.capacity if state.host is not None else 0
    if have != config.host_bytes:
        raise ConfigError(f"journal {jdir} was written with host_bytes={have}, this config "
                          f"has {config.host_bytes}")
    if state.host_persistent in (0, 1) and bool(state.host_persistent) != (
            arena_path is not None):
        was = "a file-backed (persist_dir)" if state.host_persistent else "an in-memory"
        raise ConfigError(f"journal {jdir} was written with {was} host arena; open it the "
                          "same way (its published host replicas would otherwise be lost)")


def _allocate(what: str, make: Callable[[], T]) -> T:
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:  # torch's allocator says RuntimeError
        raise ConfigError(f"cannot allocate {what}: {' '.join(str(exc).split())[:200]}"
                          ) from None


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return None


def memory_limit(read: Callable[[str], str | None] = _read) -> int | None:
    """The most memory this process could ever hold: ``MemTotal + SwapTotal`` of
    ``/proc/meminfo``, or, when lower, its own cgroup's (v2, found through
    ``/proc/self/cgroup``) ``memory.max`` plus ``memory.swap.max`` (the host's swap when that
    is unlimited); None where neither is known. A bound, not what is free now: caches (the
    page cache, ZFS's ARC) give memory back on demand, so only planes past this bound are
    sure never to fit."""
    kib: dict[str, int] = {}
    for line in (read("/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if name in ("MemTotal", "SwapTotal") and words and words[0].isdigit():
            kib[name] = int(words[0])
    swap = kib.get("SwapTotal", 0) * 1024
    limit = kib["MemTotal"] * 1024 + swap if "MemTotal" in kib else None
    rel = next((line[3:].strip() for line in (read("/proc/self/cgroup") or "").splitlines()
                if line.startswith("0::")), None)
    if rel is not None:
        base = "/sys/fs/cgroup" + ("" if rel == "/" else rel)
        ram, more = (read(base + "/memory.max") or "").strip(), \
            (read(base + "/memory.swap.max") or "").strip()
        if ram.isdigit():
            cap = int(ram) + (int(more) if more.isdigit() else swap)
            limit = cap if limit is None else min(limit, cap)
    return limit


def _check_fits(plan: CapacityPlan, config: StoreConfig) -> None:
    """CPU planes are zero-filled at open, so every byte of them is touched at once. Planes
    larger than all the memory this process could hold (``memory_limit``) would not fail as
    an allocation error: the kernel's OOM killer would end the process (an outside review's
    probe took 24 GB that way). They are refused here, before any file changes, naming both
    sizes. A CUDA device's allocator raises on its own (``_allocate`` types it)."""
    if not config.allocate_planes or torch.device(config.device).type != "cpu":
        return
    need = sum(g.total_bytes for g in plan.layout.pools.values())
    limit = memory_limit()
    if limit is not None and need > limit:
        raise ConfigError(f"cannot allocate device planes: the plan needs {need:,} bytes of "
                          f"CPU memory and this process can hold at most {limit:,} (MemTotal "
                          "+ SwapTotal, or its cgroup's memory.max + memory.swap.max); lower "
                          "kv_tokens or the model geometry")


def _check_dir(name: str, path: str) -> None:
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        raise ConfigError(f"{name}={path!r} exists and is not a directory")


def _resolved(config: StoreConfig) -> StoreConfig:
    """``config`` with its directories resolved once, at open, to absolute paths without a
    symlink or a ``..`` (``realpath``): the lock, the journal and the arena then name one
    directory however it was spelt and wherever the process later ``chdir``s. Review
    findings: a relative ``journal_dir`` followed a ``chdir``, so later segments and
    snapshots went elsewhere and a reopen lost acknowledged records; ``link/..`` was locked
    lexically (``abspath``) but written physically, so two writers shared one journal."""
    dirs = {name: os.path.realpath(getattr(config, name))
            for name in ("journal_dir", "persist_dir") if getattr(config, name) is not None}
    return dataclasses.replace(config, **dirs) if dirs else config


S = TypeVar("S", bound="Txn")


def open_store(cls: Callable[..., S], config: StoreConfig | None) -> S:
    """Open ``cls(config, plan, state, journal, locks, device)`` (a ``StoreCore`` subclass)
    in the order the module docstring gives."""
    config = StoreConfig() if config is None else config
    if not isinstance(config, StoreConfig):
        raise InvalidArgument(f"config must be a StoreConfig, not {type(config).__name__}")
    plan = config.plan()
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={config.device!r}: torch sees no CUDA device here")
    specs = pool_specs(plan)
    for name, d in (("persist_dir", config.persist_dir), ("journal_dir", config.journal_path)):
        if d is not None:
            _check_dir(name, d)
    config = _resolved(config)
    jdir = config.journal_path
    dirs = [d for d in (config.persist_dir, jdir) if d is not None]
    arena_path = (os.path.join(config.persist_dir, ARENA_NAME)
                  if config.persist_dir is not None and config.host_bytes else None)
    try:
        locks = lock_dirs(dirs)
    except OSError as exc:
        raise ConfigError(f"cannot create or lock {dirs}: {exc.strerror or exc}") from None
    opened: list[Any] = []
    try:
        state, report, res = StoreState(), RecoveryReport(), None
        if jdir is not None:                                   # 3. read-only recovery
            def used(seq: int) -> None:
                report.snapshot_seq = seq

            state, last, res = recover_state(  # from the newest snapshot's segment on
                jdir, schema_major=CODEC.schema[0], initial=StoreState,
                load_snapshot=load_snapshot, apply_record=_apply_record, repair=False,
                skipped=report.snapshots_skipped, on_snapshot=used)
            report.records = last
            report.cuts = [str(c) for c in res.cuts]
            report.cut_bytes = sum(c.bytes_cut for c in res.cuts) + read_count(jdir, CUT_NOTE)
            report.id_floor = read_count(jdir, NEXT_ID)
            broken = violations(state)
            if broken:
                raise JournalCorrupt(res.segments[-1].number if res.segments else 0, 0,
                                     f"the recovered state breaks §14: {'; '.join(broken[:3])}")
            if not res.segments and os.path.lexists(os.path.join(jdir, ARENA_ID)):
                # a first open writes segment 1 before the token, so no crash leaves this
                raise JournalCorrupt(0, 0, f"journal {jdir} holds no segment, but its "
                                     f"{ARENA_ID} token says it had a history (a host tier "
                                     "was opened with it): its log is gone. To start a new "
                                     f"journal here, remove {ARENA_ID} and the arena's .id "
                                     "token")
        if state.configured:                                   # 4. validate against it
            _check_matches(state, config, plan, specs, arena_path, jdir)
        token = _check_arena(state, arena_path, jdir) if arena_path is not None else None
        if arena_path is not None and os.path.lexists(arena_path) and (
                os.path.islink(arena_path) or not os.path.isfile(arena_path)):
            raise ConfigError(f"host arena {arena_path} is not a regular file")
        _check_fits(plan, config)
        device = _allocate("device planes and block tables", lambda: DeviceState(
            {k.value: g for k, g in plan.layout.pools.items()}, plan.C, plan.L, config.device,
            config.allocate_planes))                           # 5. allocate
        arena = None
        if config.host_bytes and arena_path is None:
            arena = _allocate("the host arena", lambda: HostArenaBuffer(config.host_bytes))
        journal = None                                         # 6. now write
        if jdir is not None:
            journal = Journal.open(jdir, CODEC, JournalOptions(  # the store holds its lock
                sync=config.sync, segment_bytes=config.segment_bytes,
                interval_ms=config.sync_interval_ms), scan_result=res, lock=False)
            opened.append(journal)
        if arena_path is not None:
            try:  # the journal's token first: a crash before the arena's leaves an arena
                # without one, which the next open adopts (``_check_arena``)
                if jdir is not None and token is None:
                    token = secrets.token_hex(16)
                    replace_durably(OS_FS, os.path.join(jdir, ARENA_ID), f"{token}\n".encode())
                arena = HostArenaBuffer(config.host_bytes, arena_path)
                fsync_dir(os.path.dirname(arena_path))
                if token is not None and _token(arena_path + ".id") != token:
                    replace_durably(OS_FS, arena_path + ".id", f"{token}\n".encode())
            except OSError as exc:
                raise ConfigError(f"cannot map host arena {arena_path}: {exc.strerror or exc}"
                                  ) from None
            opened.append(arena)
        store = cls(config, plan, state, journal, locks, device)
        store.recovery = report
        store.arena = arena
        if not state.configured:
            store._emit(ev.Configure(specs, plan.to_dict()))
            if config.host_bytes:
                store._emit(ev.HostConfigure(config.host_bytes, int(arena_path is not None)))
            if report.cut_bytes or report.id_floor:  # a journal cut back to nothing: its
                store._emit(ev.Recovered(0, b"", b"", min(  # ids must not return either
                    report.id_floor + state_mod.ID_GAP + report.cut_bytes, MAX_BUNDLE + 1)))
        else:
            store._recover_cleanup()
        if jdir is not None and store.state.next_bundle > report.id_floor:  # before the
            write_count(jdir, NEXT_ID, store.state.next_bundle)  # record: whatever a later
            # recovery cuts from the log, ids stay above it (a new journal needs none)
        store._publish_record()
        if store.journal is not None:
            store.journal.sync()
            clear_cut_note(jdir)  # the reopen record holds what it accounted for
        return store
    except BaseException:
        for f in reversed(opened):
            try:
                f.close()
            except (OSError, JournalError):
                pass
        for lk in locks:
            lk.release()
        raise
