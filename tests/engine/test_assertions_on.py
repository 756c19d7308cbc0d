"""``python -O`` strips the ``assert`` statements ``apply`` guards every journaled event with,
and the compiled kernels behind them do not bounds-check: under ``-O`` a damaged Materialize
was applied with uninitialised space indices and a Pin of slot -1 wrapped to the last page
(found in review). The engine refuses to load instead of running without its checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_engine_refuses_to_load_without_assertions(how: str) -> None:
    env = dict(os.environ)
    args = [sys.executable]
    if how == "flag":
        args.append("-O")
    else:
        env["PYTHONOPTIMIZE"] = "1"
    res = subprocess.run([*args, "-c", "import ninfer_kv.engine.apply"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "needs its assertions" in res.stderr


def test_with_assertions_it_loads() -> None:
    res = subprocess.run([sys.executable, "-c", "import ninfer_kv.engine.apply"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_the_cli_says_so_in_one_line() -> None:
    """CLI errors are one line, exit 2 — also this one (``--help`` used to end in a traceback:
    the journal commands import apply)."""
    res = subprocess.run([sys.executable, "-O", "-m", "ninfer_kv.tools.cli", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "without python -O" in res.stderr


def test_the_engine_refuses_to_load_on_a_big_endian_machine() -> None:
    """The kernels read journaled int32 fields in place; on a big-endian machine every id
    would be byte-swapped. Simulated by setting ``sys.byteorder`` before the import."""
    res = subprocess.run([sys.executable, "-c", "import sys; sys.byteorder = 'big'; "
                          "import ninfer_kv.engine"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert "needs a little-endian machine" in res.stderr
