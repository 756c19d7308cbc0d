"""The data-plane walk (tests/engine/data_walk.py): random lifecycles whose KV bytes must read
back as the shadow's, on every backend, checked mode on and off.

``NINFER_DATA_WALK_SEEDS`` (default 1 per case) and ``NINFER_DATA_WALK_STEPS`` (default 150)
run it longer, e.g. ``NINFER_DATA_WALK_SEEDS=50 .venv/bin/python -m pytest -n 2
tests/engine/test_data_walk.py`` (a few seconds a walk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ninfer_kv.engine.capacity import Backend
from tests.engine.data_walk import DataWalk

SEEDS = int(os.environ.get("NINFER_DATA_WALK_SEEDS", "1"))
STEPS = int(os.environ.get("NINFER_DATA_WALK_STEPS", "150"))
CASES = [(Backend.OFF, True, 20, 5), (Backend.MTP, False, 40, 6), (Backend.DFLASH, True, 24, 5)]


@pytest.mark.parametrize("seed", range(SEEDS))
@pytest.mark.parametrize(("backend", "checked", "pages", "concurrency"), CASES,
                         ids=[f"{b.value}-{'checked' if c else 'plain'}" for b, c, _, _ in CASES])
def test_committed_bytes_read_back_as_written(tmp_path: Path, seed: int, backend: Backend,
                                              checked: bool, pages: int,
                                              concurrency: int) -> None:
    walk = DataWalk(1000 * seed + 7, tmp_path, backend, pages, checked, concurrency)
    try:
        walk.run(STEPS)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast operations:\n  " + "\n  ".join(walk.log[-15:])
                             ) from exc
