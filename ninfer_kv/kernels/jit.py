"""CPU kernels compile once per machine, not once per process: ``njit`` here is numba's with
``cache=True`` into a directory of our own.

Where: ``$NINFER_KV_JIT_CACHE`` if set, else ``$XDG_CACHE_HOME/ninfer-kv/numba`` (default
``~/.cache``), then a subdirectory named by a hash of every ``ninfer_kv/kernels/*.py`` source,
of the control plane's compiled loops (``ENGINE_KERNELS``), of the journal's frame walk
(``JOURNAL_KERNELS``) and of the numba and llvmlite versions. The hash matters: numba checks
only the timestamp of the file that *defines* a cached function, while our kernels inline
codecs and quantizers from other modules (the control plane's bake in P from ``layout.py``
and the rows of the per-slot matrix from ``pages.py``, the frame walk the frame layout from
``journal/format.py``) — a change there would otherwise leave stale machine code in use.
numba keys entries by CPU model itself.

The directory is set on ``numba.config.CACHE_DIR`` only while our functions are decorated
(numba reads it then), so an application's own cached numba functions stay where it put them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llvmlite
import numba
import structlog
from numba.core import config

KERNELS = Path(__file__).parent
ENGINE_KERNELS = tuple(KERNELS.parent / "engine" / f for f in
                       ("bundle_table.py", "round_kernels.py", "apply_kernels.py", "page_life_kernels.py",
                        "free_ids.py", "layout.py", "pages.py", "msgpack_rows.py",
                        "invariant_kernels.py", "record_kernels.py"))
"""The control plane's compiled loops (and the page size and the rows of ``PoolState.pg``
they bake in) share the cache."""
JOURNAL_KERNELS = tuple(KERNELS.parent / "journal" / f for f in ("frames.py", "format.py"))
"""The journal's frame walk, and the frame layout it bakes in."""
log = structlog.get_logger(__name__)


@functools.cache
def cache_dir() -> str:
    """The directory this version of the kernels caches compiled code in. If it cannot be
    created or written, a fresh private temporary directory (compiled once per process) —
    never numba's fallback next to the sources, whose staleness check this module avoids."""
    base = os.environ.get("NINFER_KV_JIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"),
        "ninfer-kv", "numba")
    h = hashlib.sha256(f"numba {numba.__version__} llvmlite {llvmlite.__version__}".encode())
    for src in [*sorted(KERNELS.glob("*.py")), *ENGINE_KERNELS, *JOURNAL_KERNELS]:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    path = os.path.join(base, h.hexdigest()[:16])
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        fallback = tempfile.mkdtemp(prefix="ninfer-kv-numba-")
        log.warning("jit.cache_unwritable", path=path, error=str(exc), using=fallback)
        return fallback
    return path


@contextlib.contextmanager
def _caching_here() -> Iterator[None]:
    saved = config.CACHE_DIR
    config.CACHE_DIR = cache_dir()
    try:
        yield
    finally:
        config.CACHE_DIR = saved


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, **options)`` caching in :func:`cache_dir`."""
    def decorate(fn: Callable[..., Any]) -> Any:
        with _caching_here():
            return numba.njit(cache=True, **options)(fn)
    return decorate


# --- serial below a grain of work ----------------------------------------------------------------
SERIAL_BELOW = 1 << 18
"""Work (element operations; each kernel wrapper states what it counts) below which a CPU
kernel runs its serial twin on the calling thread instead of numba's parallel loop.

A parallel region ends at a barrier that waits for every worker thread. On an idle machine
that costs a few µs; when another process holds a core, a descheduled worker holds the
barrier for a scheduler time slice. Measured here (2 cores, numba's ``omp`` layer), one
128 KiB page copy: 3.2 µs serial, 6.4 µs parallel, 7,500 µs parallel beside two busy
processes (serial: still 3.2). The parallel gain is at most the thread count, so below
~2^18 element operations (0.1-1 ms of work) it does not pay for that risk; above, the
region's fixed costs are small beside the work. torch's intra-op loops keep a grain size
for the same reason.

A kernel's two drivers call one ``inline="always"`` item body; the serial twin is compiled
with ``error_model="numpy"``, the model numba gives a parallel loop's body. With another
error model the fastmath loops vectorise differently and the twins' outputs differ in the
last bit (1 ulp in 471 of 1,792 prefill outputs when measured);
tests/kernels/test_serial_twins.py holds them to the same bytes."""

_forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar("ninfer_kv_jit_forced",
                                                                     default=None)
"""The choice ``forcing`` imposes in this context (a thread's own: a warmup on one thread
never makes another thread's large work serial)."""


def parallel(work: int) -> bool:
    """Whether a kernel with ``work`` element operations runs its parallel loop."""
    forced = _forced.get()
    return work >= SERIAL_BELOW if forced is None else forced


@contextlib.contextmanager
def forcing(parallel: bool) -> Iterator[None]:
    """Every kernel this thread (context) runs inside takes its parallel loop (True) or its
    serial twin (False): for ``warmup``, which compiles both, and for tests holding the two
    to the same output."""
    token = _forced.set(parallel)
    try:
        yield
    finally:
        _forced.reset(token)
