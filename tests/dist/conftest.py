"""The kernels are compiled (or loaded from the JIT cache) once here, before any rank is
spawned: two children compiling at once would each pay the full JIT time."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels() -> None:
    from ninfer_kv import warmup

    warmup(["bf16"])
