"""Self-test of benchmarks/mutation_check.py (fast): discovery finds every mutant kind in the
real package, and an installed mutant really changes behaviour — of a function, of a method
using zero-argument ``super()``, of a classmethod, and through a ``from``-import — and a
forked child running pytest reports it killed."""

from __future__ import annotations

import importlib.util
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ninfer_kv.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_check",
                                                  ROOT / "benchmarks" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = mod
    spec.loader.exec_module(mod)
    return mod


mc = _load()

CORE = '''
from __future__ import annotations

from ninfer_kv.errors import InvalidArgument


def check(x: int) -> int:
    if x < 0:
        raise InvalidArgument(f"x={x} must be >= 0")
    if x > 100:
        raise ValueError("not a KVStoreError: never mutated")
    return x


def pick(xs: list[int]) -> list[int]:
    return [x for x in xs if x > 0 and x % 2 == 0]


def reason(x: int) -> str | None:
    if x < 0 or x > 9:
        return f"{x} out of range"
    return None


def _half(x: int) -> int:
    assert x % 2 == 0, "odd"
    if x > 100:
        raise ValueError("too big to halve")  # the assert kind: apply's refusals raise these too
    return x // 2


HANDLERS = {"half": _half}  # a dispatch table in the mutated module itself (apply's)


class Base:
    def value(self) -> int:
        return 1


class Thing(Base):
    def __init__(self, n: int) -> None:
        self.n = n

    def value(self) -> int:
        if self.n < 0:
            raise InvalidArgument("negative")
        return super().value() + self.n

    @classmethod
    def make(cls, n: int) -> Thing:
        if n > 10:
            raise InvalidArgument("too big")
        return cls(n)
'''

USER = "from {pkg}.core import check\n"


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    pkg = f"toy_mutation_{uuid.uuid4().hex[:8]}"
    d = tmp_path / pkg
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "core.py").write_text(CORE)
    (d / "user.py").write_text(USER.format(pkg=pkg))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(f"{pkg}.user")
    yield pkg, tmp_path
    for name in [n for n in sys.modules if n == pkg or n.startswith(pkg + ".")]:
        del sys.modules[name]


def _mutants(pkg: str, root: Path) -> dict[str, object]:
    targets = [mc.Target("core.py", "raise"), mc.Target("core.py", "filter", ("pick", "reason")),
               mc.Target("core.py", "assert", ("_half",))]
    return {m.id: m for m in mc.discover(targets, root=root, package=pkg)}


def test_discovery_finds_every_kind_in_the_package() -> None:
    ms = mc.discover()
    ids = {m.id for m in ms}
    assert {m.kind for m in ms} == {"raise", "check", "filter", "recovery", "assert"}
    assert len(ids) == len(ms)
    for want in ("engine/host.py:can_drop_device:filter:pg.pins == 0 -> True",
                 "engine/decode.py:writable:filter:pg.writer == bundle -> True",
                 "journal/restore.py:usable_snapshots:recovery:snap.seq != seq -> False"):
        assert want in ids
    assert any(i.startswith("engine/decode.py:commit_many:raise:FrontierError") for i in ids)
    assert any(i.startswith("engine/invariants.py:_pool_violations:check:") for i in ids)
    assert any(i.startswith("engine/apply.py:_trim:assert:") for i in ids)
    assert any(i.startswith("engine/page_life.py:members_of:assert:ValueError") for i in ids)
    assert mc.tests_for("engine/store.py", 1) and mc.tests_for("journal/log.py", 2)
    assert not set(mc.tests_for("engine/store.py", 1)) & mc.SLOW


def test_toy_discovery(toy: tuple[str, Path]) -> None:
    ms = _mutants(*toy)
    assert sorted(ms) == [
        'core.py:Thing.make:raise:InvalidArgument "too big"',
        'core.py:Thing.value:raise:InvalidArgument "negative"',
        'core.py:_half:assert:"odd"',
        'core.py:_half:assert:ValueError "too big to halve"',
        'core.py:check:raise:InvalidArgument "x={} must be >= 0"',
        "core.py:pick:filter:x % 2 == 0 -> True",
        "core.py:pick:filter:x > 0 -> True",
        "core.py:reason:filter:x < 0 -> False",
        "core.py:reason:filter:x > 9 -> False",
    ]


def test_installed_mutants_change_behaviour_and_undo(toy: tuple[str, Path]) -> None:
    pkg, root = toy
    ms = _mutants(pkg, root)
    core, user = sys.modules[f"{pkg}.core"], sys.modules[f"{pkg}.user"]
    with pytest.raises(InvalidArgument):
        user.check(-1)
    undo = mc.install(ms['core.py:check:raise:InvalidArgument "x={} must be >= 0"'])
    assert core.check(-1) == -1 and user.check(-1) == -1  # the from-import is rebound
    with pytest.raises(ValueError):
        core.check(101)
    undo()
    with pytest.raises(InvalidArgument):
        user.check(-1)

    undo = mc.install(ms['core.py:Thing.value:raise:InvalidArgument "negative"'])
    assert core.Thing(-1).value() == 0 and core.Thing(2).value() == 3  # super() still works
    undo()
    undo = mc.install(ms['core.py:Thing.make:raise:InvalidArgument "too big"'])
    assert core.Thing.make(11).n == 11  # still a classmethod
    undo()
    with pytest.raises(InvalidArgument):
        core.Thing.make(11)

    assert core.pick([-2, 2, 3]) == [2]
    undo = mc.install(ms["core.py:pick:filter:x > 0 -> True"])
    assert core.pick([-2, 2, 3]) == [-2, 2]
    undo()
    undo = mc.install(ms["core.py:reason:filter:x > 9 -> False"])
    assert core.reason(10) is None and core.reason(-1) is not None
    undo()

    with pytest.raises(AssertionError):
        core.HANDLERS["half"](3)
    undo = mc.install(ms['core.py:_half:assert:"odd"'])
    assert core.HANDLERS["half"](3) == 1  # the module's own dispatch table is rebound
    undo()
    with pytest.raises(AssertionError):
        core.HANDLERS["half"](3)


def test_forked_child_kills_and_spares(toy: tuple[str, Path], tmp_path: Path) -> None:
    pkg, root = toy
    ms = _mutants(pkg, root)
    test = tmp_path / "test_toy_module.py"
    test.write_text(f"import pytest\n\nfrom ninfer_kv.errors import InvalidArgument\n"
                    f"from {pkg}.core import check\n\n\ndef test_check() -> None:\n"
                    "    with pytest.raises(InvalidArgument):\n        check(-1)\n")
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    work = tmp_path / "work"
    work.mkdir()
    args = ["-c", str(ini), "--rootdir", str(tmp_path)]
    outcomes = []
    for n, m in enumerate([None, ms['core.py:check:raise:InvalidArgument "x={} must be >= 0"']]):
        job = mc.start_job(m, 1, [str(test)], args, str(work), 60, n)
        while (res := mc.poll(job)) is None:
            time.sleep(0.02)
        outcomes.append(res[0])
    assert outcomes == ["survived", "killed"], [mc.tail(str(p)) for p in work.glob("*.log")]
