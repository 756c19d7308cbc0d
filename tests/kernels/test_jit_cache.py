"""Compiled CPU kernels are cached on disk (kernels/jit.py): a second process loads them
instead of compiling; the cache is keyed by the kernel sources; an application's own numba
cache directory is left alone."""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import json
import numbers
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from numba.core import config

from ninfer_kv.kernels import jit

CHILD = """
import json, torch
from ninfer_kv.engine.layout import PlaneOrder
from ninfer_kv.kernels import copy
planes = [torch.zeros(2, 1, 64, 8, dtype=torch.uint8)]  # 2 pages, 1 head
copy.copy_tail(planes, PlaneOrder.PAGE_MAJOR, 0, 1, 3)
st = copy._copy_serial.stats  # a 3-column tail: small work, the serial twin (jit.py)
print(json.dumps({"hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values()),
                  "path": st.cache_path}))
"""


def run_child(cache: Path) -> dict:
    env = {**os.environ, "NINFER_KV_JIT_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_kernel(tmp_path: Path) -> None:
    first = run_child(tmp_path)
    second = run_child(tmp_path)
    assert first["path"].startswith(str(tmp_path)) and first["path"] == second["path"]
    assert (first["hits"], first["misses"]) == (0, 1)  # compiled and stored
    assert (second["hits"], second["misses"]) == (1, 0)  # loaded, not compiled


def test_the_cache_is_keyed_by_the_kernel_sources(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "kernels"
    shutil.copytree(jit.KERNELS, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(jit, "KERNELS", src)
    before, after = cache_dirs_around_an_edit(tmp_path, monkeypatch, src / "codecs.py")
    assert before != after  # codecs.py: a module the kernels inline from
    assert os.path.dirname(before) == os.path.dirname(after) == str(tmp_path / "cache")


def cache_dirs_around_an_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              edited: Path) -> tuple[str, str]:
    """``jit.cache_dir()`` (under ``tmp_path/cache``) before and after appending to
    ``edited``."""
    monkeypatch.setenv("NINFER_KV_JIT_CACHE", str(tmp_path / "cache"))
    jit.cache_dir.cache_clear()
    try:
        before = jit.cache_dir()
        with edited.open("a") as f:
            f.write("\n# changed\n")
        jit.cache_dir.cache_clear()
        return before, jit.cache_dir()
    finally:
        jit.cache_dir.cache_clear()


def test_the_applications_numba_cache_dir_is_left_alone() -> None:
    saved = config.CACHE_DIR

    def f(x: int) -> int:
        return x + 1

    g = jit.njit()(f)
    assert config.CACHE_DIR == saved
    assert g._cache._cache_path.startswith(jit.cache_dir())


def test_the_kernels_and_warmup_are_exported() -> None:
    import importlib

    import ninfer_kv

    for name in ("append_kv", "paged_decode", "paged_prefill", "warmup", "KVStore"):
        mod = importlib.import_module(ninfer_kv._EXPORTS[name])
        assert getattr(ninfer_kv, name) is getattr(mod, name)
        assert name in ninfer_kv.__all__


def test_warmup_runs_every_kernel_of_a_profile() -> None:
    """In a fresh process (kernels compiled by other tests here would hide a gap). Review
    finding: head-major planes (a DFlash draft pool's) reach the kernels as non-contiguous
    arrays, which numba compiles apart ('A' layout): warmup left that compile (seconds) to
    the first request. The attention and append kernels have both variants compiled, and
    every kernel's serial twin too (the one small batches run)."""
    code = ("import json, ninfer_kv\n"
            "from ninfer_kv.kernels import append, attention, copy, prefill\n"
            "s = ninfer_kv.warmup(['bf16'])\n"
            "print(json.dumps([list(s), [sorted({a.layout for sig in k.signatures for a in sig"
            " if getattr(a, 'ndim', 0) == 4}) for k in "
            "(append._append_cpu, attention._decode_cpu, copy._copy_cpu, "
            "prefill._prefill_cpu, append._append_serial, attention._decode_serial, "
            "copy._copy_serial, prefill._prefill_serial)]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True)
    profiles, layouts = json.loads(out.stdout.strip().splitlines()[-1])
    assert profiles == ["bf16", "head-major"]
    # each kernel's parallel loop and its serial twin (small work runs serially: jit.py)
    for append, decode, copy, prefill in (layouts[:4], layouts[4:]):
        assert append == decode == prefill == ["A", "C"], (append, decode, prefill)
        assert copy == ["C"]  # the copies see every plane as dense [outer, page, mid, row] rows


def test_an_unwritable_cache_dir_never_falls_back_beside_the_sources(tmp_path: Path) -> None:
    """Review finding: numba's own fallback (the package's __pycache__) checks only the
    defining file's timestamp; a private temporary directory is used instead."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    code = ("from ninfer_kv.kernels import copy, jit\n"
            "print(copy._copy_cpu._cache._cache_path)\nprint(jit.KERNELS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True,
                         env={**os.environ, "NINFER_KV_JIT_CACHE": str(blocked / "cache")})
    path, kernels = out.stdout.strip().splitlines()[-2:]
    assert not path.startswith(kernels) and "ninfer-kv-numba-" in path
    assert "jit.cache_unwritable" in out.stderr


def keyed_copies(into: Path, monkeypatch: pytest.MonkeyPatch, attr: str) -> Path:
    """Copy the files ``jit.<attr>`` lists into ``into`` and key the cache by the copies."""
    into.mkdir()
    files = [into / p.name for p in getattr(jit, attr)]
    for src, dst in zip(getattr(jit, attr), files, strict=True):
        shutil.copy(src, dst)
    monkeypatch.setattr(jit, attr, tuple(files))
    return into


def test_the_control_plane_loops_cache_with_the_kernels(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: engine/round_kernels.py and free_ids.py used numba's own cache beside
    the sources (a read-only install could not even import the store), and the page size
    they bake in from layout.py was not part of any staleness check."""
    from ninfer_kv.engine import apply_kernels as ak
    from ninfer_kv.engine import free_ids
    from ninfer_kv.engine import round_kernels as rk

    for f in (rk.resolve, rk.check_commit, ak.apply_commit, ak.fork_pages, free_ids._flip,
              free_ids._lowest):
        assert f._cache._cache_path.startswith(jit.cache_dir()), f
    engine = keyed_copies(tmp_path / "engine", monkeypatch, "ENGINE_KERNELS")
    before, after = cache_dirs_around_an_edit(tmp_path, monkeypatch, engine / "layout.py")
    assert before != after  # layout.py: the P the control plane's loops bake in


def test_every_module_compiling_with_our_njit_is_in_the_cache_key() -> None:
    """Review finding: journal/frames.py cached its frame walk under a key that covered
    neither it nor journal/format.py, whose frame layout it bakes in; an edit there could
    leave stale machine code in use. Every module that decorates with ``jit.njit`` is part
    of the key (with the modules whose constants the key lists next to it)."""
    root = jit.KERNELS.parent
    keyed = {*jit.KERNELS.glob("*.py"), *jit.ENGINE_KERNELS, *jit.JOURNAL_KERNELS}
    users = {p for p in root.rglob("*.py") if "kernels.jit import njit" in p.read_text()}
    assert users and users <= keyed, sorted(str(p.relative_to(root)) for p in users - keyed)
    assert root / "journal" / "format.py" in keyed and root / "engine" / "layout.py" in keyed


def _baked(obj: object) -> bool:
    """What numba freezes into machine code when a compiled function reads it as a global:
    numbers (numpy scalars too), arrays, enum members, tuples, other compiled functions."""
    from numba.core.registry import CPUDispatcher
    return isinstance(obj, numbers.Number | np.generic | np.ndarray | enum.Enum | tuple
                      | CPUDispatcher)


def _read_from_unkeyed(f: Path, keyed: set[Path], package: str = "") -> list[str]:
    """The names module ``f`` (of ``package``: by default the one its path names) imports,
    or reads as ``module.NAME``, that ``_baked`` would freeze and whose module is not keyed
    (``from``/``import``, absolute or relative)."""
    root = jit.KERNELS.parent.parent
    package = package or ".".join(f.relative_to(root).with_suffix("").parts[:-1])
    tree = ast.parse(f.read_text())
    modules: dict[str, types.ModuleType] = {}  # local name -> an imported ninfer_kv module
    found = []

    def check(mod: types.ModuleType, name: str) -> None:
        obj = getattr(mod, name, None)
        if _baked(obj) and Path(str(mod.__file__)) not in keyed:
            found.append(f"{f.name}: {mod.__name__}.{name}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ninfer_kv.") and a.asname:
                    modules[a.asname] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom):
            name = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            if not name.startswith("ninfer_kv"):
                continue
            mod = importlib.import_module(name)
            for a in node.names:
                try:  # a submodule: its attributes are checked where they are read
                    modules[a.asname or a.name] = importlib.import_module(f"{name}.{a.name}")
                except ModuleNotFoundError:
                    check(mod, a.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            check(modules[node.value.id], node.attr)
    return found


def test_every_constant_or_kernel_a_keyed_module_reads_is_keyed_too() -> None:
    """Review finding: the engine kernels took the row numbers of ``PoolState.pg`` from
    engine/pages.py, which the key did not cover; reordering the rows (in both places, a
    consistent edit) left a warm cache writing each page's writer into its device field,
    without an error. What a keyed module reads from another and numba may freeze into
    machine code (``_baked``) comes from a keyed module; a re-export is caught where the
    re-exporting module imports it, since that module is keyed and scanned too."""
    keyed = {*jit.KERNELS.glob("*.py"), *jit.ENGINE_KERNELS, *jit.JOURNAL_KERNELS}
    assert not [x for f in sorted(keyed) for x in _read_from_unkeyed(f, keyed)]


def test_the_scan_sees_every_import_form(tmp_path: Path) -> None:
    """The forms an outside review found the first version of the test blind to: ``import
    ... as``, a module imported by ``from`` and read as ``module.NAME``, a relative import,
    and constants that are numpy scalars or tuples."""
    f = tmp_path / "probe.py"  # read as a module of ninfer_kv.engine
    f.write_text("import ninfer_kv.engine.pages as pg\n"
                 "from ninfer_kv.engine import pages\n"
                 "from .pages import NO_PAGE\n"
                 "from ninfer_kv.engine.pool import PG_FIELDS\n"
                 "from ninfer_kv.engine.bundle_table import _GOLDEN\n"
                 "X = (pg.PG_WRITER, pages.PG_DEVICE, NO_PAGE)\n")
    names = sorted(x.split(": ")[1] for x in _read_from_unkeyed(f, set(), "ninfer_kv.engine"))
    assert names == ["ninfer_kv.engine.bundle_table._GOLDEN", "ninfer_kv.engine.pages.NO_PAGE",
                     "ninfer_kv.engine.pages.PG_DEVICE", "ninfer_kv.engine.pages.PG_WRITER",
                     "ninfer_kv.engine.pool.PG_FIELDS"], names


def test_the_page_rows_are_part_of_the_key(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine = keyed_copies(tmp_path / "engine", monkeypatch, "ENGINE_KERNELS")
    before, after = cache_dirs_around_an_edit(tmp_path, monkeypatch, engine / "pages.py")
    assert before != after  # pages.py: the rows of PoolState.pg the loops bake in


def test_the_frame_layout_is_part_of_the_key(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    journal = keyed_copies(tmp_path / "journal", monkeypatch, "JOURNAL_KERNELS")
    before, after = cache_dirs_around_an_edit(tmp_path, monkeypatch, journal / "format.py")
    assert before != after
