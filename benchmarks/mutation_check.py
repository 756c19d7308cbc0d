"""Targeted mutation check: disable each safety rule of the store one at a time and run the
tests that should notice. A rule whose removal no test notices is a test gap (or an equivalent
mutant, listed with its reason in ``EQUIVALENT``).

    .venv/bin/python benchmarks/mutation_check.py                    # everything (~1.5 h, 2 cores)
    .venv/bin/python benchmarks/mutation_check.py --list             # the mutants, no run
    .venv/bin/python benchmarks/mutation_check.py --module engine/host.py --kind filter
    .venv/bin/python benchmarks/mutation_check.py --match commit_many --no-tier2 -v
    .venv/bin/python benchmarks/mutation_check.py --ids /tmp/ninfer-mutation-X/survivors.txt

Each run's pytest temp dirs (host arena files: ~4 GB for one run of a tier-1 test set) are
removed as it ends; ``--keep-temp`` keeps them. Logs stay in ``--workdir``.

It prints one line per mutant (killed / killed by error / survived, seconds), then
``mutants=N killed=K survived=[id, ...]`` and the known-equivalent survivors ("justified",
not counted as survived). Exit status 0 iff no unjustified survivor; 2, before any run, when
an ``EQUIVALENT`` entry names no mutant (a stale excuse). Not part of ``make test``.

A mutant's id is ``<file under ninfer_kv/>:<function or Class.method>:<kind>:<label>`` (the
exception and message head, the operand's source, or the check's message); it carries no line
number, so ``EQUIVALENT`` keeps matching across unrelated edits ("#2" tells twins apart).
Hypothesis runs derandomized, without its example database and without shrinking.

Mutant kinds (what "disable one rule" means; where: ``TARGETS``):

* ``raise``    -- a ``raise X(...)`` of a ``KVStoreError`` subclass becomes ``pass``;
* ``check``    -- an ``out.append(...)`` / ``out.extend(...)`` of an invariant checker becomes
  ``pass`` (and a ``return [<message> for ...]`` becomes ``return []``);
* ``filter``   -- in a page-selection function, one operand of an ``and`` (in a ``return``, a
  ``lambda`` or a comprehension condition) or a whole comprehension condition becomes
  ``True``; an ``if`` that returns a reason string gets the test ``False`` (one mutant per
  operand of an ``or``);
* ``assert``   -- in ``apply``'s handlers (a damaged journal's event is refused whole), an
  ``assert`` becomes ``pass``, and so does a ``raise AssertionError(...)`` or
  ``raise ValueError(...)``;
* ``recovery`` -- in a recovery validity function, an ``if``/``elif`` that returns or yields
  a reason, or sets a verdict variable (``bad``, ``reason``, ``durable_later``), gets the
  test ``False``.

How a mutant runs (cheap: no reinstall, no re-import of torch/numba): the parent copies the
repository (edits made during the run do not race with it), imports the package once, runs
every selected test file once unmutated (the baseline: it warms numba's JIT and lists tests
already failing, which are then deselected), and forgets the test modules.
Then for each mutant it forks a child that recompiles only the enclosing top-level function or
method with the one node replaced (decorators kept, original line numbers, the module's
globals, ``__class__`` bound for zero-argument ``super()``), installs it on the module or class,
rebinds every ``from``-import of the old object in loaded project modules, and runs pytest
in-process on the module's tier-1 tests with ``-x``; the test modules are imported afresh in
the child, so they bind the mutated objects. Exit status != 0 means killed (1: a test failed;
anything else, a signal or the timeout: "killed by error"). A tier-1 survivor gets a second
child with tier 2: the hypothesis state machine, then every other fast test file, so a reported
survivor is one no test of the suite kills (only the minutes-long SLOW files are left out).

A compiled kernel called only by another compiled kernel (``materialize_plan`` inside
``materialize``, ``apply_commit`` inside ``apply_commit_raw``) is mutated on its module, not
inside its compiled caller: only tests that call it directly (tests/engine/test_round_kernels.py)
can kill its mutants. A survivor there is real (a rule no direct test holds), never a false kill.
A property test needs an explicit ``@example`` of each refusal: the run is derandomized.

Adding a mutant kind: write a ``_sites_<op>(unit, ctx)`` generator yielding ``Site``s (the node
to replace, its replacement ``"pass" | "True" | "False" | "[]"`` and a label), register it in
``OPS`` and in ``KIND_OPS``, and add ``Target``s. Which tests run for a module: ``TESTS``.
"""

from __future__ import annotations
import __future__ as future_flags

import argparse
import ast
import contextlib
import copy
import fnmatch
import glob
import importlib
import io
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ninfer_kv"

# --- what to mutate -------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Mutate ``kind`` sites in the module(s) ``module`` (a glob under ninfer_kv/), in the
    top-level functions / methods named in ``funcs`` (qualnames; empty: all of them)."""

    module: str
    kind: str
    funcs: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()  # default: KIND_OPS[kind]


KIND_OPS: dict[str, tuple[str, ...]] = {"raise": ("raise",), "check": ("check",),
                                        "filter": ("select", "guard"), "recovery": ("guard",),
                                        "assert": ("assert",)}

RAISE_MODULES = ("engine/core.py", "engine/command.py", "engine/store.py", "engine/decode.py",
                 "engine/termination.py",
                 "engine/continuation.py", "engine/host.py", "engine/growth.py",
                 "engine/opening.py", "engine/checked.py", "engine/args.py", "engine/config.py",
                 "engine/capacity.py", "journal/lock.py", "journal/log.py", "journal/recovery.py",
                 "journal/restore.py",
                 "journal/reader.py", "journal/ids.py", "kernels/checks.py", "kernels/append.py",
                 "kernels/copy.py",
                 "kernels/prefill.py", "kernels/attention.py", "engine/views.py",
                 "integrations/transformers.py", "integrations/hf_served.py", "dist/replica.py",
                 "dist/follower.py", "dist/stream.py", "dist/standby.py", "cache/preemption.py",
                 "cache/index.py", "cache/retention.py", "engine/state.py")

TARGETS: tuple[Target, ...] = (
    *(Target(m, "raise") for m in RAISE_MODULES),
    Target("engine/apply*.py", "assert"),   # apply's refusals of a damaged journal's events
    Target("engine/page_life.py", "assert"),  # and its page half's (memberships, collection)
    Target("engine/invariants.py", "assert", ("load_snapshot",)),  # a snapshot breaking §14
    Target("engine/invariants.py", "check"),
    Target("engine/incremental*.py", "check"),
    Target("engine/host_arena.py", "check", ("ExtentAllocator.violations",)),
    Target("engine/bundle_table.py", "check", ("BundleTable.check",)),
    Target("engine/host.py", "filter", ("can_drop_device", "replica_valid", "_select", "offload",
                                        "drop_device", "drop_host", "drops_after_publish",
                                        "drops_after_unpin", "may_drop")),
    Target("engine/drop_rules.py", "raise"),
    Target("engine/decode.py", "filter", ("writable",)),
    Target("integrations/hf_served.py", "filter", ops=("guard",)),  # what the attention serves
    # the transfer's refusals that in-process tests reach (the rest need two ranks)
    Target("dist/transfer.py", "raise", ("recv_control",)),
    Target("dist/receive.py", "raise", ("_check_header",)),
    Target("dist/receive.py", "filter", ("_unended", "_abort_when_safe")),  # free, or stop
    Target("dist/packing.py", "raise", ("gather",)),
    Target("engine/round_kernels.py", "filter", ops=("guard",)),
    Target("engine/apply_kernels.py", "filter", ops=("guard",)),
    Target("engine/invariant_kernels.py", "filter", ops=("guard",)),
    Target("engine/record_kernels.py", "filter", ops=("guard",)),  # replay's parser
    Target("journal/frames.py", "filter", ("walk_frames",), ops=("guard",)),
    Target("engine/continuation.py", "filter", ("unrecoverable_reason",)),
    Target("engine/restart.py", "filter", ("recover_cleanup",), ops=("select",)),
    Target("engine/restart.py", "recovery", ("recover_cleanup",)),
    Target("engine/host.py", "recovery", ("verify_checkpoint",)),
    Target("journal/recovery.py", "recovery", ("scan", "_judge_damage", "_salvage_from",
                                                "_snapshots_past_the_end")),
    Target("journal/restore.py", "recovery", ("usable_snapshots", "snapshot_segment",
                                               "scan_from_snapshot", "recover_state")),
)

VERDICT_NAMES = frozenset({"bad", "reason", "durable_later", "twice"})
"""An ``if`` whose body assigns one of these is a validity check (guard op)."""

# --- which tests --------------------------------------------------------------------------------
# Tier 1: the fast tests that target the module, in the order run with -x (a killed mutant
# stops at its first failing test). Tier 2, for tier-1 survivors only: the module's tier-2 head
# (the hypothesis state machine first), then every other fast test file of the suite -- so a
# reported survivor is one that no test of the suite kills (SLOW files excepted).

ENGINE = ["tests/engine/test_trust_*.py", "tests/engine/test_rules.py",
          "tests/engine/test_store_core.py", "tests/engine/test_engine_api.py",
          "tests/engine/test_sync_policy.py",
          "tests/engine/test_continuation.py", "tests/engine/test_host_tier.py",
          "tests/engine/test_incremental*.py", "tests/engine/test_layout_capacity.py",
          "tests/engine/test_host_arena.py", "tests/engine/test_row_isolation.py",
          "tests/engine/test_snapshot_pruning.py", "tests/engine/test_interrupted_commands.py",
          "tests/engine/test_survives_restart.py", "tests/engine/test_metadata_roundtrip.py"]
INCREMENTAL = ["tests/engine/test_incremental_seeded.py", "tests/engine/test_incremental.py"]
MACHINE = ["tests/engine/test_state_machine.py"]
JOURNAL = ["tests/journal/test_journal_rules.py", "tests/journal/test_journal.py",
           "tests/journal/test_snapshot_scan.py", "tests/journal/test_live_reader.py",
           "tests/journal/test_journal_property.py",
           "tests/engine/test_trust_durability.py", "tests/engine/test_host_tier.py",
           "tests/tools/test_cli.py", "tests/tools/test_from_snapshot.py",
           "tests/tools/test_cli_errors.py", "tests/journal/test_journal_lock.py",
           "tests/journal/test_not_regular_files.py",
           "tests/engine/test_store_paths.py", "tests/engine/test_snapshot_pruning.py"]
KERNELS = ["tests/kernels/test_wrapper_checks.py", "tests/kernels/test_wrapper_review.py",
           "tests/kernels/test_prefill_varlen.py",
           "tests/engine/test_trust_isolation.py",
           "tests/engine/test_trust_errors.py",
           "tests/kernels/test_store_kernels.py", "tests/kernels/test_codecs.py",
           "tests/kernels/test_kernels_cpu.py", "tests/kernels/test_serial_twins.py",
           "tests/kernels/test_input_forms.py"]
OPENING = [*ENGINE, "tests/engine/test_store_paths.py", "tests/engine/test_open_limits.py",
           "tests/kernels/test_store_kernels.py", "tests/cache/test_cache_review.py",
           "tests/tools/test_cli*.py"]

TESTS: list[tuple[str, list[str], list[str]]] = [
    # (module glob, tier 1, tier-2 head); the first matching glob wins
    ("integrations/*.py", ["tests/integrations/test_transformers.py",
                           "tests/integrations/test_hf_review.py"], []),
    # in-process tests only: a mutant is installed in this process, not in spawned ranks
    *((f"dist/{m}", ["tests/dist/test_replica_refusals.py", "tests/dist/test_replica_stream.py",
                     "tests/dist/test_replica_host.py", "tests/dist/test_standby.py"],
       []) for m in ("replica.py", "follower.py", "stream.py", "standby.py")),
    *((f"dist/{m}", ["tests/dist/test_packing.py", "tests/dist/test_receive_abort.py",
                     "tests/dist/test_replica_refusals.py"], [])
      for m in ("transfer.py", "receive.py", "packing.py")),
    ("engine/views.py", ["tests/kernels/test_typed_views.py", *KERNELS], []),
    ("engine/invariants.py", ["tests/engine/test_bundle_table.py", *INCREMENTAL, *ENGINE],
     MACHINE),
    ("engine/bundle_table.py", ["tests/engine/test_bundle_table.py", *ENGINE], MACHINE),
    ("engine/state.py", ["tests/engine/test_seq_ids.py", "tests/engine/test_id_window.py",
                         *ENGINE], MACHINE),
    ("engine/incremental*.py", INCREMENTAL, MACHINE),
    ("engine/host_arena.py", ["tests/engine/test_host_arena.py", *INCREMENTAL, *ENGINE], MACHINE),
    ("engine/drop_rules.py", ["tests/cache/test_retention_shared.py",
                              "tests/engine/test_host_tier.py"], MACHINE),
    ("engine/host.py", ["tests/engine/test_host_tier.py", "tests/cache/test_retention_shared.py",
                        *ENGINE], MACHINE),
    ("engine/restart.py", ["tests/engine/test_trust_durability.py", "tests/engine/test_host_tier.py",
                           *ENGINE], MACHINE),
    ("engine/continuation.py", ["tests/engine/test_continuation.py",
                                "tests/engine/test_share_prefix.py",
                                "tests/engine/test_release_tail.py",
                                "tests/engine/test_capacity_short.py",
                                "tests/engine/test_fork_live.py",
                                "tests/cache/test_cache_review.py", *ENGINE], MACHINE),
    ("cache/*.py", ["tests/cache/test_*.py"], ["tests/tools/test_simulate_preemption.py"]),
    ("engine/checked.py", ["tests/engine/test_trust_isolation.py",
                           "tests/kernels/test_store_kernels.py", *ENGINE], MACHINE),
    *((f"engine/{m}", OPENING, MACHINE) for m in ("opening.py", "config.py", "capacity.py",
                                                   "args.py")),
    ("engine/round_kernels.py", ["tests/engine/test_round_kernels.py", *ENGINE], MACHINE),
    ("engine/record_kernels.py", ["tests/engine/test_record_kernels.py",
                                  "tests/engine/test_replay_runs.py",
                                  "tests/journal/test_digest_golden.py"], MACHINE),
    ("engine/invariant_kernels.py", ["tests/engine/test_invariant_kernels.py", *INCREMENTAL,
                                     *ENGINE], MACHINE),
    *((g, ["tests/engine/test_damaged_events.py",
                          "tests/engine/test_damaged_state.py", "tests/engine/test_round_kernels.py",
                          "tests/engine/test_apply_materialize.py",
                          "tests/engine/test_release_tail.py",
                          "tests/engine/test_share_prefix.py", "tests/engine/test_page_arrays.py",
                          *ENGINE], MACHINE) for g in ("engine/apply*.py", "engine/page_life*.py")),
    ("engine/termination.py", ["tests/engine/test_fork_live.py", *ENGINE], MACHINE),
    ("engine/*.py", [*ENGINE, "tests/kernels/test_store_kernels.py"], MACHINE),
    ("journal/frames.py", ["tests/journal/test_frames.py", *JOURNAL], []),
    ("journal/ids.py", ["tests/engine/test_id_window.py", *JOURNAL], []),
    ("journal/*.py", JOURNAL, ["tests/journal/test_kill9.py", *MACHINE]),
    ("kernels/*.py", KERNELS, MACHINE),
]
SUITE = ["tests/engine/test_*.py", "tests/journal/test_*.py", "tests/kernels/test_*.py",
         "tests/cache/test_*.py",
         "tests/integrations/test_*.py",
         "tests/tools/test_*.py",
         # the replication tests that run in this process (a mutant is not in spawned ranks)
         "tests/dist/test_replica_*.py", "tests/dist/test_packing.py"]
SLOW = {"tests/engine/test_crash_soak.py", "tests/journal/test_live_reader_soak.py",
        "tests/kernels/test_ptx.py",
        "tests/kernels/test_kernels_sim.py"}
"""Never run (minutes each)."""
HEAD_ONLY = {"tests/journal/test_kill9.py", "tests/tools/test_mutation_harness.py"}
"""Run in tier 2 only where a tier-2 head names them (kill9 tests the journal's own process)."""
TIER2_K = ""
"""pytest -k for tier 2 ("not MtpMachine and not DflashMachine": the single-pool machine only)."""

EQUIVALENT: dict[str, str] = {
    # replay's parser: a read of the one byte at the end, whose answer a later bound refuses
    "engine/record_kernels.py:str_equal:filter:p >= end -> False":
        "every str form then needs p + its header (+ n >= 1 bytes for a pool name or tag) <= "
        "end, so the answer is NOT_TAKEN either way; it keeps the kernel from reading the "
        "byte past the buffer (numba does not bounds-check), not a rule",
    "engine/record_kernels.py:bin_field:filter:p >= end -> False":
        "every bin form then needs p + 2, 3 or 5 <= end: NOT_TAKEN either way; it keeps the "
        "kernel from reading the byte past the buffer, not a rule",
    # apply: second lines of defence behind a check of the whole event that runs first
    "engine/invariant_kernels.py:check_slots:filter:s >= refs.shape[0] -> False":
        "PoolMirror.extend keeps n (the slots seen, tested by s >= n_mirror) <= the arrays' "
        "length; it guards the kernel's reads against a mirror built otherwise, not a rule",
    'engine/apply_host.py:host_reserve:assert:"HostReserve at {}: one is pending"':
        "the pending transfer's extent is live: the allocator refuses it and the event is undone",
    'engine/apply_kernels.py:append_members:assert:"0 <= sp_nmem[i] < sp_members.shape[1]"':
        "apply(Materialize) makes room first (ensure_members of materialize_plan's width), so "
        "no length reaching the kernel breaks it; it guards the kernel's writes, not a rule",
    # unreachable through the API: the guarded state cannot arise
    'engine/capacity.py:_finish:raise:CapacityError "layout bytes {} != B({}) = {}: the capacity '
    'curve is not af…"':
        "every plane slab is capacity * H * P * X * itemsize with P = 64 = ALIGN, so align_up is "
        "the identity and B(M) is exactly affine for every geometry",
    'engine/continuation.py:activate_from:raise:UnknownHandle "checkpoint {} has no address space '
    'in pool {}"':
        "a bundle has a space in every enabled pool or is gone: activate creates all of them and "
        "Release / Finish / Move / recovery drop all of them in one command",
    'engine/continuation.py:activate_from:raise:UnknownHandle "checkpoint {} pool {}: page {}:{} '
    'has neither a device repl…"':
        "a checkpoint page loses its device replica only through can_drop_device (a valid host "
        "replica covers its committed columns) or a recovery that verified it, and an inactive "
        "page's epoch and committed never change, so the replica stays valid",
    "engine/restart.py:recover_cleanup:filter:not x.active -> True":
        "every active bundle was just aborted by Finish(retain=False), which deletes it, before "
        "this generator runs",
    "engine/host.py:verify_checkpoint:recovery:arena is None -> False":
        "reached only when every page has a host replica, i.e. the journal has a HostConfigure, "
        "and opening refuses a config whose host_bytes differs from the journal's",
    "engine/host.py:offload:filter:pg.device != NO_PAGE -> True":
        "a page without a device replica always has a valid host replica (the second operand "
        "excludes it): it was dropped by can_drop_device or kept by a verifying recovery, and "
        "an inactive page never changes",
    # redundant: the same refusal or report comes from another check, only its text differs
    'engine/host_arena.py:ExtentAllocator.violations:check:"host arena: extents end at {}, capacity '
    '{}"':
        "with no gap or overlap (the first check) the extents end at free + live, so this fires "
        "exactly when 'free + live != capacity' does",
}

PYTEST_OPTS = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
HARNESS_ERROR = 70  # the child could not install the mutant: a bug here, not a kill

# --- discovery --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    module: str                    # dotted module name
    rel: str                       # path under ninfer_kv/
    unit: str                      # qualname of the enclosing top-level function / method
    kind: str
    label: str
    line: int
    key: tuple[str, int, int, int, int]  # the node to replace: type, span
    replacement: str               # "pass" | "True" | "False" | "[]"

    @property
    def id(self) -> str:
        return f"{self.rel}:{self.unit}:{self.kind}:{self.label}"


@dataclass(frozen=True)
class Site:
    node: ast.AST
    replacement: str
    label: str


@dataclass
class Ctx:
    module: ModuleType
    base_error: type


def node_key(n: ast.AST) -> tuple[str, int, int, int, int]:
    return (type(n).__name__, n.lineno, n.col_offset,  # type: ignore[attr-defined]
            n.end_lineno or 0, n.end_col_offset or 0)  # type: ignore[attr-defined]


def _short(text: str, n: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def message_head(arg: ast.expr | None) -> str:
    """The literal template of a message argument: f"seq {b} pool" -> 'seq {} pool'."""
    if isinstance(arg, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.GeneratorExp | ast.ListComp):
        return message_head(arg.elt)
    return ast.unparse(arg) if arg is not None else ""


def _resolve(expr: ast.expr, namespace: dict[str, Any]) -> Any:
    if isinstance(expr, ast.Name):
        return namespace.get(expr.id)
    if isinstance(expr, ast.Attribute):
        return getattr(_resolve(expr.value, namespace), expr.attr, None)
    return None


def _has_walrus(n: ast.AST) -> bool:
    return any(isinstance(x, ast.NamedExpr) for x in ast.walk(n))


def _sites_raise(unit: ast.AST, ctx: Ctx) -> Iterator[Site]:
    for n in ast.walk(unit):
        if isinstance(n, ast.Raise) and n.exc is not None:
            call = n.exc if isinstance(n.exc, ast.Call) else None
            exc = _resolve(call.func if call else n.exc, vars(ctx.module))
            if isinstance(exc, type) and issubclass(exc, ctx.base_error):
                args = call.args if call else []
                texts = [x for x in args if _stringish(x)] or args[-1:]
                head = message_head(texts[0] if texts else None)
                yield Site(n, "pass", f'{exc.__name__} "{_short(head, 60)}"')


def _sites_check(unit: ast.AST, ctx: Ctx) -> Iterator[Site]:
    for n in ast.walk(unit):
        if (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Attribute)
                and n.value.func.attr in ("append", "extend")
                and isinstance(n.value.func.value, ast.Name) and n.value.func.value.id == "out"):
            args = n.value.args
            yield Site(n, "pass", f'"{_short(message_head(args[0] if args else None))}"')
        elif (isinstance(n, ast.Return) and isinstance(n.value, ast.ListComp)
              and isinstance(n.value.elt, ast.JoinedStr | ast.Constant)):
            yield Site(n.value, "[]", f'"{_short(message_head(n.value))}"')


def _sites_assert(unit: ast.AST, ctx: Ctx) -> Iterator[Site]:
    """``apply``'s refusals: its asserts, and its raises of the plain exceptions replay turns
    into ``UnappliableRecord`` (``AssertionError``, ``ValueError``)."""
    for n in ast.walk(unit):
        if isinstance(n, ast.Assert):
            head = message_head(n.msg) if n.msg is not None else ast.unparse(n.test)
            yield Site(n, "pass", f'"{_short(head)}"')
        elif isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and isinstance(
                n.exc.func, ast.Name) and n.exc.func.id in ("AssertionError", "ValueError"):
            texts = [x for x in n.exc.args if _stringish(x)]
            head = message_head(texts[0] if texts else None)
            yield Site(n, "pass", f'{n.exc.func.id} "{_short(head, 60)}"')


def _conditions(unit: ast.AST) -> Iterator[ast.expr]:
    """Selection conditions: return expressions, lambda bodies, comprehension ifs."""
    for n in ast.walk(unit):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.BoolOp):
            yield n.value
        elif isinstance(n, ast.Lambda):
            yield n.body
        elif isinstance(n, ast.comprehension):
            yield from n.ifs


def _sites_select(unit: ast.AST, ctx: Ctx) -> Iterator[Site]:
    for cond in _conditions(unit):
        if isinstance(cond, ast.BoolOp) and isinstance(cond.op, ast.And):
            parts = cond.values
        elif isinstance(cond, ast.BoolOp):
            continue  # an `or` is not a filter conjunction
        else:
            parts = [cond]
        for p in parts:
            if not _has_walrus(p):  # a walrus binds a name later operands read
                yield Site(p, "True", f"{_short(ast.unparse(p))} -> True")


def _stringish(e: ast.expr | None) -> bool:
    if isinstance(e, ast.BinOp):
        return _stringish(e.left) or _stringish(e.right)
    return isinstance(e, ast.JoinedStr) or (isinstance(e, ast.Constant) and isinstance(e.value, str))


REFUSAL_CODES = frozenset({"UNKNOWN", "DUPLICATE", "FRONTIER", "ENTITLEMENT", "WRITE",
                           "NO_SPACE", "INACTIVE", "NO_GROUP", "FORK_ACTIVE_SOURCE",
                           "FORK_BAD_TARGET", "FORK_BAD_COUNT", "FORK_DEAD_PAGE",
                           "NO_ROOM", "BAD_SLOT", "LENGTHS", "COMMIT_LENGTHS", "TOO_WIDE", "GROW_BAD",
                           "BAD_LENGTH", "NOT_TAKEN",
                           "DEAD", "SHORT", "NO_DEVICE", "C_NO_SPACE", "C_ORDER", "C_DEAD",
                           "C_SHORT", "C_RANGE", "C_NEGATIVE",
                           "K_RELEASED_NOT_FREE", "K_OUT_OF_RANGE", "K_DOUBLE_LEASE",
                           "K_ON_FREE_LIST", "K_FREE_SLOT_LIVE", "K_DEAD_REFS", "K_REFS",
                           "K_ACTIVE_REFS", "K_COLUMNS", "K_WRITER", "K_SHARED_WRITER",
                           "K_NO_DEVICE", "K_PINS", "K_NOT_RECYCLED", "K_MIRROR_SHORT",
                           "K_WRITER_NOT_MEMBER", "B_DEAD", "B_SHORT", "B_RANGE", "B_INDEX",
                           "TORN_HEADER", "IMPLAUSIBLE", "TORN_RECORD", "BAD_CRC", "BAD_SALT",
                           "BAD_SEQ", "BAD_CHAIN"})
"""engine/round_kernels.py's and apply_kernels.py's refusal codes: an ``if`` returning one is
a check (guard op); so is one recording a problem row that names one
(engine/invariant_kernels.py), or a frame walk's stop code (journal/frames.py)."""


def _returns_code(value: ast.expr | None) -> bool:
    parts = value.elts if isinstance(value, ast.Tuple) else [value]
    return any(isinstance(p, ast.Name) and p.id in REFUSAL_CODES for p in parts)


def _target_name(t: ast.expr) -> str | None:
    """The name assigned: ``x = ...`` or ``x[i] = ...``."""
    if isinstance(t, ast.Subscript):
        t = t.value
    return t.id if isinstance(t, ast.Name) else None


def _is_guard(stmt: ast.If) -> bool:
    """The body returns or yields a reason string or a refusal code, or sets a verdict
    variable."""
    for s in stmt.body:
        if isinstance(s, ast.Return) and (_stringish(s.value) or _returns_code(s.value)):
            return True
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Yield) and _stringish(s.value.value):
            return True
        if isinstance(s, ast.Assign) and (_returns_code(s.value) or any(
                _target_name(t) in VERDICT_NAMES for t in s.targets)):
            return True
    return False


def _sites_guard(unit: ast.AST, ctx: Ctx) -> Iterator[Site]:
    for n in ast.walk(unit):
        if isinstance(n, ast.If) and _is_guard(n):
            test = n.test
            parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) \
                else [test]
            for p in parts:
                yield Site(p, "False", f"{_short(ast.unparse(p))} -> False")


OPS: dict[str, Callable[[ast.AST, Ctx], Iterator[Site]]] = {
    "raise": _sites_raise, "check": _sites_check, "select": _sites_select, "guard": _sites_guard,
    "assert": _sites_assert}


def units(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) of every top-level function and method; the last def of a name wins."""
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    found[f"{node.name}.{sub.name}"] = sub
    yield from found.items()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


_TREES: dict[str, ast.Module] = {}
"""Module ASTs as parsed at discovery (the source the mutants were cut from)."""


def discover(targets: Sequence[Target] = TARGETS, root: Path | None = None,
             package: str = PACKAGE) -> list[Mutant]:
    """Every mutant of ``targets``, sorted by file and line; ids are unique."""
    from ninfer_kv.errors import KVStoreError

    base = (root or ROOT) / package
    out: dict[str, Mutant] = {}
    for t in targets:
        for rel in sorted(str(p.relative_to(base)) for p in base.glob(t.module) if p.is_file()):
            name = f"{package}." + rel.removesuffix(".py").replace("/", ".")
            ctx = Ctx(importlib.import_module(name), KVStoreError)
            tree = _TREES.setdefault(name, _parse(base / rel))
            for qual, unit in units(tree):
                if t.funcs and qual not in t.funcs:
                    continue
                for op in t.ops or KIND_OPS[t.kind]:
                    for s in OPS[op](unit, ctx):
                        m = Mutant(name, rel, qual, t.kind, s.label,
                                   s.node.lineno, node_key(s.node),  # type: ignore[attr-defined]
                                   s.replacement)
                        label, k = m.label, 1
                        while m.id in out:
                            k += 1
                            m = Mutant(m.module, rel, qual, t.kind, f"{label} #{k}", m.line, m.key,
                                       m.replacement)
                        out[m.id] = m
    return sorted(out.values(), key=lambda m: (m.rel, m.line, m.key, m.id))


# --- applying one mutant ------------------------------------------------------------------------
FACTORY = "__mutation_factory__"


class _Replace(ast.NodeTransformer):
    def __init__(self, key: tuple[str, int, int, int, int], replacement: str) -> None:
        self.key = key
        self.replacement = replacement
        self.done = False

    def visit(self, node: ast.AST) -> Any:
        if not self.done and hasattr(node, "lineno") and node_key(node) == self.key:
            self.done = True
            new: ast.AST
            if self.replacement == "pass":
                new = ast.Pass()
            elif self.replacement == "[]":
                new = ast.List(elts=[], ctx=ast.Load())
            else:
                new = ast.Constant(value=self.replacement == "True")
            return ast.copy_location(new, node)
        return self.generic_visit(node)


def _find_unit(tree: ast.Module, qual: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    return dict(units(tree))[qual]


def build(m: Mutant, module: ModuleType, tree: ast.Module, owner: Any) -> Any:
    """The mutated function object (decorators applied), compiled in the module's globals."""
    unit = copy.deepcopy(_find_unit(tree, m.unit))
    rep = _Replace(m.key, m.replacement)
    unit = rep.visit(unit)
    if not rep.done:
        raise RuntimeError(f"{m.id}: node {m.key} not found in {m.unit}")
    if "." in m.unit and any(isinstance(n, ast.Attribute) and n.attr.startswith("__")
                             and not n.attr.endswith("__") for n in ast.walk(unit)):
        raise RuntimeError(f"{m.id}: private name mangling is not supported")
    shell = ast.parse(f"def {FACTORY}(__class__):\n    pass\n    return {unit.name}\n")
    shell.body[0].body[0] = unit  # type: ignore[attr-defined]
    ast.fix_missing_locations(shell)
    code = compile(shell, module.__file__ or m.rel, "exec",
                   flags=future_flags.annotations.compiler_flag, dont_inherit=True)
    ns = vars(module)
    saved = ns.get("njit")
    if saved is not None:  # a compiled kernel: numba's on-disk cache is keyed by name and line,
        ns["njit"] = _uncached_njit  # so every mutant of a function would load the first one
    try:
        exec(code, ns)  # defines only the factory; the function stays local to it
        factory = ns.pop(FACTORY)
        return factory(owner if "." in m.unit else None)
    finally:
        if saved is not None:
            ns["njit"] = saved


def _uncached_njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    import numba
    return numba.njit(**{**options, "cache": False})


def install(m: Mutant, prefixes: Sequence[str] = (PACKAGE, "tests")) -> Callable[[], None]:
    """Install the mutant; rebind from-imports of the replaced object. Returns an undo."""
    module = importlib.import_module(m.module)
    tree = _TREES.get(m.module) or _parse(Path(module.__file__ or ""))
    cls_name, _, name = m.unit.rpartition(".")
    owner: Any = getattr(module, cls_name) if cls_name else module
    old = vars(owner)[name]
    new = build(m, module, tree, owner)
    setattr(owner, name, new)
    undo: list[Callable[[], None]] = [lambda: setattr(owner, name, old)]
    roots = {*prefixes, m.module.split(".")[0]}
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.split(".")[0] not in roots:
            continue
        for k, v in list(vars(mod).items()):
            if v is old and mod is not module:
                setattr(mod, k, new)
                undo.append(lambda mod=mod, k=k: setattr(mod, k, old))
            elif isinstance(v, dict):  # dispatch tables (apply's _HANDLERS: in the module itself)
                for kk, vv in list(v.items()):
                    if vv is old:
                        v[kk] = new
                        undo.append(lambda d=v, kk=kk: d.__setitem__(kk, old))

    def restore() -> None:
        for u in reversed(undo):
            u()
    return restore


# --- running --------------------------------------------------------------------------------------


def tests_for(rel: str, tier: int) -> list[str]:
    """The test files of ``tier`` for the module ``rel`` (tier 2: never a tier-1 file)."""
    t1, head = next(((t1, head) for pattern, t1, head in TESTS if fnmatch.fnmatch(rel, pattern)),
                    (ENGINE, MACHINE))
    if tier == 1:
        return expand(t1)
    first = set(expand(t1))
    rest = [f for f in expand(SUITE) if f not in HEAD_ONLY]
    return [f for f in dict.fromkeys(expand(head) + rest) if f not in first]


def expand(patterns: Sequence[str]) -> list[str]:
    """Globs -> existing test files (relative to ROOT), in order, once each, SLOW left out."""
    out: list[str] = []
    for p in patterns:
        for f in sorted(glob.glob(str(ROOT / p))):
            rel = str(Path(f).relative_to(ROOT))
            if rel not in out and rel not in SLOW:
                out.append(rel)
    return out


def _child(m: Mutant | None, args: list[str], log: str) -> NoReturn:
    """In the forked child: install the mutant, run pytest, exit with its status."""
    code = HARNESS_ERROR
    try:
        os.setpgid(0, 0)  # so a timeout kills the tests' own subprocesses too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
        if m is not None:
            install(m)
            print(f"mutant installed: {m.id} (line {m.line} -> {m.replacement})", flush=True)
        import pytest

        code = int(pytest.main(args))
    except BaseException:  # noqa: B036 - report anything, then exit with a code
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@dataclass
class Job:
    mutant: Mutant | None
    tier: int
    pid: int
    start: float
    log: str
    timeout: float
    tmp: str = ""          # its pytest --basetemp (host arena files: GBs over a run)


@dataclass
class Outcome:
    status: str            # killed | error | survived
    tier: int
    seconds: float
    detail: str = ""


def start_job(m: Mutant | None, tier: int, tests: list[str], extra: list[str], workdir: str,
              timeout: float, n: int) -> Job:
    log = os.path.join(workdir, f"m{n:04d}-t{tier}.log")
    tmp = os.path.join(workdir, f"tmp{n:04d}-t{tier}")
    args = [*tests, "-x", *PYTEST_OPTS, "--basetemp", tmp, *extra]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(m, args, log)
    return Job(m, tier, pid, time.monotonic(), log, timeout, tmp)


def _kill(job: Job) -> None:
    for target in (lambda: os.killpg(job.pid, signal.SIGKILL), lambda: os.kill(job.pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def poll(job: Job) -> tuple[str, str] | None:
    """None while running; else (status, detail)."""
    pid, status = os.waitpid(job.pid, os.WNOHANG)
    if pid == 0:
        if time.monotonic() - job.start < job.timeout:
            return None
        _kill(job)
        os.waitpid(job.pid, 0)
        return "error", f"timeout after {job.timeout:.0f}s"
    if os.WIFSIGNALED(status):
        return "error", f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "survived", ""
    if code == 1:
        return "killed", ""
    if code == 5:  # every test deselected: nothing could notice the mutant
        return "survived", "no tests ran"
    if code == HARNESS_ERROR:
        return "error", "HARNESS ERROR (the mutant could not be installed)"
    what = {2: "interrupted / collection error", 3: "pytest internal error", 4: "usage error",
            5: "no tests collected"}.get(code, "")
    return "error", f"exit {code} {what}".strip()


def tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --- baseline (parent) ---------------------------------------------------------------------------


class _Failures:
    """pytest plugin: which tests fail, which files do not collect."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.broken: list[str] = []
        self.passed: set[str] = set()  # files with at least one passing test

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.add(report.nodeid.split("::")[0])

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.broken.append(report.nodeid)


def baseline(files: list[str], extra: list[str], workdir: str, tag: str) -> _Failures:
    """Run ``files`` unmutated in this process (warms numba's JIT); output to a log."""
    import pytest

    plugin = _Failures()
    log = os.path.join(workdir, f"baseline-{tag}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        pytest.main([*files, *PYTEST_OPTS, "--basetemp", os.path.join(workdir, f"base-{tag}"),
                     *extra], plugins=[plugin])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for x in (*saved, fd):
            os.close(x)
    return plugin


def forget_test_modules() -> None:
    """Drop the test modules the baseline imported, so each child imports them afresh (and
    binds the mutated objects). Project modules stay loaded (and JIT-warm)."""
    here = sys.modules.get(__name__)
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        local = f.startswith(str(ROOT / "tests")) or f.startswith(str(ROOT / "benchmarks"))
        if (name == "tests" or name.startswith("tests.") or local) and mod is not here \
                and name != "__main__":
            del sys.modules[name]


SNAPSHOT_SKIP = (".venv", ".git", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__",
                 "*.egg-info", "out")


def snapshot(src: Path, into: str) -> Path:
    """A private copy of the repository (without the venv and caches) at ``into/<name>``: the
    whole run tests the sources as they were at its start, whatever is edited meanwhile. The
    repository's siblings are linked next to it (the package finds ``../shared`` that way)."""
    dst = Path(into) / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*SNAPSHOT_SKIP), dirs_exist_ok=True)
    for sibling in src.parent.iterdir():
        link = Path(into) / sibling.name
        if sibling != src and not sibling.name.startswith(".") and not link.exists():
            link.symlink_to(sibling)
    return dst


def use_root(root: Path) -> None:
    """Import ``ninfer_kv`` and the tests from ``root`` -- here (sys.path comes before the
    editable install's finder) and in the tests' subprocesses (PYTHONPATH)."""
    global ROOT
    if PACKAGE in sys.modules:
        raise RuntimeError(f"{PACKAGE} was imported before the snapshot was taken")
    ROOT = root
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def prepare_process() -> None:
    """Before numba/torch are imported: fork-safe single-threaded pools, the CUDA simulator
    (as tests/conftest.py), and a hypothesis profile that neither reads nor writes the
    example database (mutants' failures must not land in .hypothesis/), is deterministic and
    does not shrink."""
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from hypothesis import Phase, settings

    # no shrinking: a mutant is killed by the first failing example; shrinking it takes minutes
    settings.register_profile("mutation-check", database=None, derandomize=True, deadline=None,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutation-check")


# --- main ------------------------------------------------------------------------------------------


@dataclass
class Plan:
    mutants: list[Mutant]
    extra: dict[int, list[str]] = field(default_factory=dict)  # tier -> --deselect args etc.
    dropped: set[str] = field(default_factory=set)              # test files that do not collect

    def tests(self, m: Mutant, tier: int) -> list[str]:
        return [f for f in tests_for(m.rel, tier) if f not in self.dropped]


def select(mutants: list[Mutant], a: argparse.Namespace) -> list[Mutant]:
    out = []
    for m in mutants:
        if a.module and not any(fnmatch.fnmatch(m.rel, p) for p in a.module):
            continue
        if a.kind and m.kind not in a.kind:
            continue
        if a.match and not any(s in m.id for s in a.match):
            continue
        if a.ids is not None and m.id not in a.ids:
            continue
        out.append(m)
    return out


def run(plan: Plan, a: argparse.Namespace, workdir: str) -> dict[str, Outcome]:
    queue: list[tuple[Mutant, int]] = [(m, 1) for m in plan.mutants]
    running: list[Job] = []
    results: dict[str, Outcome] = {}
    index = {m.id: i for i, m in enumerate(plan.mutants)}
    total, done = len(plan.mutants), 0
    spent: dict[str, float] = {}
    try:
        while queue or running:
            while queue and len(running) < a.jobs:
                m, tier = queue.pop(0)
                tests = plan.tests(m, tier)
                timeout = a.timeout if tier == 1 else a.timeout2
                running.append(start_job(m, tier, tests, plan.extra.get(tier, []), workdir,
                                         timeout, index[m.id]))
            time.sleep(0.05)
            for job in list(running):
                res = poll(job)
                if res is None:
                    continue
                running.remove(job)
                if not a.keep_temp:  # a run of every mutant kept ~40 GB of them otherwise
                    shutil.rmtree(job.tmp, ignore_errors=True)
                m = job.mutant
                assert m is not None
                status, detail = res
                secs = spent[m.id] = spent.get(m.id, 0.0) + time.monotonic() - job.start
                if status == "survived" and job.tier == 1 and not a.no_tier2 \
                        and plan.tests(m, 2):
                    queue.insert(0, (m, 2))
                    continue
                if status == "error":
                    detail += f" (log {job.log})"
                    if a.verbose:
                        detail += "\n" + tail(job.log)
                results[m.id] = Outcome(status, job.tier, secs, detail)
                done += 1
                report_line(done, total, m, results[m.id])
    except KeyboardInterrupt:
        for job in running:
            _kill(job)
            os.waitpid(job.pid, 0)
        print("interrupted", file=sys.stderr)
    return results


def report_line(done: int, total: int, m: Mutant, o: Outcome) -> None:
    what = {"killed": "killed", "error": "killed by error", "survived": "SURVIVED"}[o.status]
    if o.status == "survived" and m.id in EQUIVALENT:
        what = "survived (justified)"
    tier = f" (tier {o.tier})" if o.status != "survived" else ""
    print(f"[{done:4d}/{total}] {what + tier:28s} {o.seconds:6.1f}s  {m.id}  L{m.line}"
          + (f"  {o.detail}" if o.detail else ""), flush=True)


def summarize(plan: Plan, results: dict[str, Outcome]) -> int:
    ms = [m for m in plan.mutants if m.id in results]
    killed = [m for m in ms if results[m.id].status in ("killed", "error")]
    errors = [m for m in ms if results[m.id].status == "error"]
    surv = [m for m in ms if results[m.id].status == "survived"]
    justified = [m for m in surv if m.id in EQUIVALENT]
    unjust = [m for m in surv if m.id not in EQUIVALENT]
    print()
    if errors:
        print(f"killed by error ({len(errors)}):")
        for m in errors:
            print(f"  {m.id}  L{m.line}: {results[m.id].detail.splitlines()[0]}")
    if justified:
        print(f"justified survivors (equivalent mutants, {len(justified)}):")
        for m in justified:
            print(f"  {m.id}: {EQUIVALENT[m.id]}")
    stale = [i for i in EQUIVALENT if i in results and results[i].status != "survived"]
    for i in stale:
        print(f"note: {i} is listed in EQUIVALENT but was killed; remove it")
    if unjust:
        print(f"survivors ({len(unjust)}):")
        for m in unjust:
            print(f"  {m.id}  ({m.module.replace('.', '/')}.py:{m.line})")
    ids = ", ".join(m.id for m in unjust)
    print(f"mutants={len(ms)} killed={len(killed)} survived=[{ids}]")
    print(f"killed_by_error={len(errors)} justified={len(justified)}")
    return 1 if unjust or len(ms) < len(plan.mutants) else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", action="append", default=[],
                    help="glob under ninfer_kv/, e.g. engine/store.py (repeatable)")
    ap.add_argument("--kind", action="append", default=[], choices=sorted(KIND_OPS))
    ap.add_argument("--match", action="append", default=[], help="substring of the mutant id")
    ap.add_argument("--ids", type=Path, help="only the mutant ids listed in this file, one a line "
                                             "(e.g. a previous run's survivors.txt)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests; no run")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300, help="per mutant, tier 1 (s)")
    ap.add_argument("--timeout2", type=float, default=900, help="per mutant, tier 2 (s)")
    ap.add_argument("--no-tier2", action="store_true", help="tier 1 only (faster; more survivors)")
    ap.add_argument("--tier2-k", default=TIER2_K, help="pytest -k for tier 2 ('' for all)")
    ap.add_argument("--workdir", help="logs and temp dirs (default: a new /tmp dir)")
    ap.add_argument("--keep-temp", action="store_true",
                    help="keep each mutant's pytest temp dir (removed when it ends otherwise)")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="test the working tree itself, not a copy taken at start (edits made "
                         "during the run then race with it)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the log tail of errors")
    a = ap.parse_args(argv)
    a.ids = set(filter(None, a.ids.read_text().splitlines())) if a.ids else None
    signal.signal(signal.SIGTERM, _interrupt)  # kill: stop the running children too
    workdir = ""
    if not a.list:
        workdir = a.workdir or tempfile.mkdtemp(prefix="ninfer-mutation-")
        os.makedirs(workdir, exist_ok=True)
        if not a.no_snapshot:
            use_root(snapshot(ROOT, os.path.join(workdir, "tree")))
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    prepare_process()
    every = discover()
    stale = sorted(set(EQUIVALENT) - {m.id for m in every})
    if stale:  # a justification outlives the code it excused: it would hide a new mutant
        print(f"EQUIVALENT names no mutant (remove or re-word these): {stale}", file=sys.stderr)
        return 2
    mutants = select(every, a)
    plan = Plan(mutants)
    if a.list:
        for m in mutants:
            print(f"{m.id}  L{m.line}  -> {m.replacement}")
        for tier in (1, 2):
            groups = sorted({" ".join(plan.tests(m, tier)) for m in mutants})
            print(f"tier {tier} test sets: {len(groups)}")
            for g in groups:
                print(f"  {g or '(none)'}")
        print(f"mutants={len(mutants)}")
        return 0
    t0 = time.monotonic()
    pkg = Path(sys.modules[PACKAGE].__file__ or "").parent
    print(f"{len(mutants)} mutants; logs in {workdir}; testing {pkg}", flush=True)
    for tier in (1,) if a.no_tier2 else (1, 2):
        files = expand([f for m in mutants for f in tests_for(m.rel, tier)])
        if not files:
            continue
        extra = ["-k", a.tier2_k] if tier == 2 and a.tier2_k else []
        t = time.monotonic()
        base = baseline(files, extra, workdir, f"tier{tier}")
        if not a.keep_temp:
            shutil.rmtree(os.path.join(workdir, f"base-tier{tier}"), ignore_errors=True)
        plan.dropped.update(b.split("::")[0] for b in base.broken)
        plan.dropped.update(f for f in files if f not in base.passed)  # nothing left to run
        plan.extra[tier] = extra + [f"--deselect={n}" for n in base.failed]
        print(f"baseline tier {tier}: {len(files)} files, {time.monotonic() - t:.0f}s; failing "
              f"unmutated (deselected): {base.failed or 'none'}; not collecting: "
              f"{base.broken or 'none'}; nothing passing (dropped): "
              f"{[f for f in files if f not in base.passed] or 'none'}", flush=True)
    forget_test_modules()
    if mutants:  # the fork path itself must pass unmutated
        sane = start_job(None, 1, plan.tests(mutants[0], 1), plan.extra.get(1, []), workdir,
                         a.timeout, 9999)
        while (res := poll(sane)) is None:
            time.sleep(0.05)
        if not a.keep_temp:
            shutil.rmtree(sane.tmp, ignore_errors=True)
        if res[0] != "survived":
            print(f"sanity run (no mutant) failed: {res}\n{tail(sane.log, 40)}", file=sys.stderr)
            return 2
        print(f"sanity run (no mutant, forked): passed in {time.monotonic() - sane.start:.0f}s",
              flush=True)
    results = run(plan, a, workdir)
    code = summarize(plan, results)
    survivors = [i for i, o in results.items() if o.status == "survived" and i not in EQUIVALENT]
    Path(workdir, "survivors.txt").write_text("".join(f"{i}\n" for i in survivors))
    print(f"survivor ids: {os.path.join(workdir, 'survivors.txt')} (rerun them with --ids)")
    print(f"total {time.monotonic() - t0:.0f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
