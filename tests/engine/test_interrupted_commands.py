"""An exception raised at any line of a command — ``KeyboardInterrupt`` from Ctrl-C,
``SystemExit`` from an engine's SIGTERM handler, a ``MemoryError`` — either leaves the store as
it was and usable, or fails it (fail-stop): never half a command that the next boundary
journals. Before this rule an interrupt after ``ensure_mapped_many`` applied its Materialize
but before it queued the table write left a page mapped in the state and the journal and
missing from the block table: the kernels skipped the entry, the token's KV was lost, and
every later command succeeded.

The test raises ``KeyboardInterrupt`` at the N-th line the command executes inside
``ninfer_kv`` (a ``sys.settrace`` tracer), for every N from just before the command's first
event to its end, and at a sample of the lines before (planning, which mutates nothing)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import StoreFailed, StoreLocked
from ninfer_kv.journal.lock import _unlock_and_close
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.interrupts import Injector, lines_to_try


def setup(tmp: Path, checked: bool = False, host: bool = False, growth: bool = False
          ) -> tuple[KVStore, dict[str, int]]:
    """A store with a retained 100-token checkpoint and an active sequence mapped to 100
    tokens and committed to a page edge (64), all published; in checked mode both layers
    wrote what is committed and the active sequence's tokens up to 100 (a commit to 90);
    with a host tier a second checkpoint offloaded and published ("ck2"); with lease growth
    the active sequence entitled to less than its budget."""
    kw: dict[str, Any] = {"checked": checked}
    if host:
        kw.update(host_bytes=8 << 20, persist_dir=str(tmp / "persist"))
    if growth:
        kw.update(lease_growth=True, lease_window=64, lease_cushion=0)
    s = KVStore.open(small_config(tmp, **kw))

    def wrote(seq: int, lo: int, hi: int) -> None:  # both layers (checked mode's ledger)
        if checked:
            rows = torch.full((hi - lo,), s.space(seq).row, dtype=torch.int32)
            for layer in range(2):
                s.batch_view("main", layer).guard(rows, torch.arange(lo, hi))  # type: ignore[misc]

    ck = s.activate(100, 20)
    s.ensure_mapped(ck, "main", 100)
    with s.boundary():
        wrote(ck, 0, 100)
    s.commit(ck, "main", 100)
    s.finish(ck, retain=True)
    a = s.activate(64, 100)
    s.ensure_mapped(a, "main", 100)
    with s.boundary():
        wrote(a, 0, 100)
    s.commit(a, "main", 64)
    with s.boundary():
        pass
    handles = {"ck": ck, "a": a}
    if host:
        b = s.activate(64, 10)
        s.ensure_mapped(b, "main", 64)
        with s.boundary():
            pass
        s.commit(b, "main", 64)
        handles["ck2"] = ck2 = s.finish(b, retain=True)
        s.offload(ck2)
        with s.boundary():
            pass
    return s, handles


COMMANDS: dict[str, Callable[[KVStore, dict[str, int]], Any]] = {
    "activate": lambda s, h: s.activate(50, 50),
    "ensure_mapped_many (page crossing)": lambda s, h: s.ensure_mapped_many("main", [h["a"]],
                                                                            [129]),
    "commit_many": lambda s, h: s.commit_many("main", [h["a"]], [90]),
    "activate_from (Fork mid-page)": lambda s, h: s.activate_from(h["ck"], 70, 100, 20),
    "activate_from (Move)": lambda s, h: s.activate_from(h["ck"], 100, 100, 20,
                                                         keep_source=False),
    "finish (retain)": lambda s, h: s.finish(h["a"], retain=True),
    "finish": lambda s, h: s.finish(h["a"]),
    "release": lambda s, h: s.release(h["ck"]),
    "truncate": lambda s, h: s.truncate(h["a"], "main", 10),
    "share_prefix": lambda s, h: s.share_prefix(h["a"]),
    "release_tail": lambda s, h: s.release_tail(h["ck"], 64),
    "set_provisional_many": lambda s, h: s.set_provisional_many("main", [h["a"]], [80]),
    "trim": lambda s, h: s.trim(h["a"], "main"),
    "fork_live": lambda s, h: s.fork_live(h["a"], 20, 40),
    "set_metadata": lambda s, h: s.set_metadata(h["ck"], {"tokens": [1, 2, 3]}),
    "commit_many (checked mode)": lambda s, h: s.commit_many("main", [h["a"]], [90]),
    "truncate (checked mode)": lambda s, h: s.truncate(h["a"], "main", 10),
    "offload (host tier)": lambda s, h: s.offload(h["ck"]),
    "offload, drop_device (host tier)": lambda s, h: s.offload(h["ck"], drop_device=True),
    "drop_device (host tier)": lambda s, h: s.drop_device(h["ck2"]),
    "drop_host (host tier)": lambda s, h: s.drop_host(h["ck2"]),
    "grow (lease growth)": lambda s, h: s.grow(100),
}


def run(name: str, tmp: Path, at: int
        ) -> tuple[KVStore, str, dict[Any, set[int]], Injector, BaseException | None]:
    """Command ``name`` on a fresh ``setup`` with an interrupt at line ``at`` (0: none):
    (store, digest before, checked mode's writes before, the injector, what it raised)."""
    s, h = setup(tmp, checked="checked mode" in name, host="host tier" in name,
                 growth="lease growth" in name)
    before = s.digest()
    written = {k: set(v) for k, v in s._written.items()}
    inj = Injector(at)
    err = inj.run(lambda: COMMANDS[name](s, h))
    return s, before, written, inj, err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_an_interrupt_anywhere_leaves_the_store_as_it_was_or_failed(name: str,
                                                                     tmp_path: Path) -> None:
    s, _, _, dry, err = run(name, tmp_path / "dry", 0)
    assert err is None and dry.first_emit > 0, (name, err)
    s.close()
    outcomes = {"unchanged": 0, "failed": 0}
    for at in lines_to_try(dry.lines, dry.first_emit):
        tmp = tmp_path / f"at{at}"
        s, before, written, _, err = run(name, tmp, at)
        assert isinstance(err, KeyboardInterrupt), (name, at, err)  # the engine sees its own
        if s._failed is None:  # nothing of the command happened: usable, as it was
            outcomes["unchanged"] += 1
            assert s.digest() == before, (name, at)
            queued = (s._pending, s._effects, s._touched, s._freed_rows, s._transfers)
            assert not any(queued), (name, at, queued)
            assert s._written == written, (name, at)  # checked mode: writes still count
            with s.boundary():
                pass
            s.check_invariants()
            live = s.digest()
            s.close()
            assert replay(str(tmp / "journal")).digest == live, (name, at)
        else:  # failed: every later command refuses and the journal holds nothing of it
            outcomes["failed"] += 1
            with pytest.raises(StoreFailed):
                s.activate(1, 1)
            with pytest.raises(StoreFailed):
                with s.boundary():
                    pass
            s.close()
            assert replay(str(tmp / "journal")).digest == before, (name, at)
    assert outcomes["failed"] and outcomes["unchanged"], outcomes


def test_an_error_after_the_first_event_is_store_failed_from_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """An ordinary exception (a bug, a ``MemoryError``) after a command's first event: the
    store fails and the caller gets ``StoreFailed`` naming it, raised from it. Before the
    first event the same exception passes through and the store stays usable."""
    s, h = setup(tmp_path)
    before = s.digest()

    def boom(*args: object) -> None:
        raise RuntimeError("out of something")

    monkeypatch.setattr(s, "fault_hook", boom)  # called while activate_from plans
    with pytest.raises(RuntimeError, match="out of something"):
        s.activate_from(h["ck"], 70, 100, 20)
    assert s.failed is None and s.digest() == before
    monkeypatch.setattr(s, "fault_hook", None)
    monkeypatch.setattr(s, "_touch", boom)  # called after ensure_mapped_many's Materialize
    with pytest.raises(StoreFailed, match="ensure_mapped_many raised after it changed the "
                                          "state.*RuntimeError: out of something") as err:
        s.ensure_mapped_many("main", [h["a"]], [129])
    assert isinstance(err.value.__cause__, RuntimeError)
    assert s.failed is not None
    with pytest.raises(StoreFailed):
        s.activate(1, 1)
    s.close()
    assert replay(str(tmp_path / "journal")).digest == before


def test_an_interrupted_close_lets_the_directory_be_reopened(tmp_path: Path) -> None:
    """``KeyboardInterrupt`` at any line of ``close()`` (a record pending): a second
    ``close()`` finishes it and the directory reopens in the same process. Before, an
    interrupt while the journal or the arena closed, or in ``DirLock.release`` before its
    finalizer ran, left the lock held (``close`` had set closed first, so the second returned
    at once): ``StoreLocked`` until the store object was collected.

    One line stays open: the first of ``lock._unlock_and_close``, the finalizer, which
    ``weakref.finalize`` has already marked run — the descriptor then stays open and the
    lock lasts until the process exits (a reopen in this process is refused, loudly)."""
    s, _ = setup(tmp_path / "dry")
    s.activate(10, 10)
    dry = Injector(0, first="close")
    assert dry.run(s.close) is None
    leaked = set()
    for at in lines_to_try(dry.lines, dry.first_emit, stride=1):
        s, _ = setup(tmp_path / f"at{at}")
        s.activate(10, 10)
        inj = Injector(at)
        err = inj.run(s.close)
        assert err is None or isinstance(err, KeyboardInterrupt), (at, err)
        s.close()
        assert s._locks == [], at
        try:
            again = KVStore.open(s.config)
        except StoreLocked:
            leaked.add(inj.where)
            continue
        again.check_invariants()
        again.close()
    lines, start = inspect.getsourcelines(_unlock_and_close)
    first = start + next(i for i, x in enumerate(lines) if x.strip() == "try:")
    assert leaked <= {f"_unlock_and_close:{first}"}, leaked


def test_an_interrupt_in_close_boundary_never_leaves_a_frozen_store_behind(
        tmp_path: Path) -> None:
    """Found when a transformers test's sampled interrupt moved onto ``close_boundary``'s
    ``return``: the record was published and the store frozen, but the caller got the
    interrupt instead of the seq, so no ``unit_complete`` followed and every later command
    refused with ``FrozenUnit``. At every line of a boundary: the store is failed, or usable
    and unfrozen, and a replay agrees with it."""
    s, h = setup(tmp_path / "dry")
    s.commit_many("main", [h["a"]], [90])
    dry = Injector(0)
    assert dry.run(s.close_boundary) is None
    s.close()
    for at in range(1, dry.lines + 1):
        tmp = tmp_path / f"at{at}"
        s, h = setup(tmp)
        s.commit_many("main", [h["a"]], [90])
        err = Injector(at).run(s.close_boundary)
        assert isinstance(err, KeyboardInterrupt), (at, err)
        if s.failed is None:
            assert not s._frozen, at
            s.activate(1, 1)  # usable
            with s.boundary():
                pass
            live = s.digest()
            s.close()
            assert replay(str(tmp / "journal")).digest == live, at
        else:
            s.close()
