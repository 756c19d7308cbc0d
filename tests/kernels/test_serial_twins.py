"""Small work runs a kernel's serial twin on the calling thread, large work its parallel loop
(``jit.SERIAL_BELOW``: a parallel region's barrier waits for a descheduled worker, ~7 ms
beside a busy process for a 3 µs copy). The twins share one item body, so they write the same
bytes; these tests hold them to it and check which twin each wrapper picks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.kernels import append, attention, copy, jit, prefill
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from ninfer_kv.kernels.copy import copy_pages, copy_tails
from ninfer_kv.kernels.prefill import paged_prefill_varlen
from tests.kernels.helpers import make_view

H, D, ROWS, LOGICAL = 2, 64, 3, 4
LAYOUTS = [*((p, PlaneOrder.PAGE_MAJOR) for p in Profile),
           (Profile.BF16, PlaneOrder.HEAD_MAJOR)]  # head-major: a DFlash draft pool's (§4.3)


def filled(profile: Profile, order: PlaneOrder = PlaneOrder.PAGE_MAJOR):  # noqa: ANN201
    """A view whose rows hold 150 random tokens each (written by the parallel twin)."""
    view = make_view(profile, H, D, pages=ROWS * LOGICAL + 2, rows=ROWS, logical=LOGICAL,
                     order=order, seed=3)
    g = torch.Generator().manual_seed(7)
    n = 150
    rows = torch.arange(ROWS, dtype=torch.int32).repeat_interleave(n)
    pos = torch.arange(n, dtype=torch.int32).repeat(ROWS)
    k, v = torch.randn(ROWS * n, H, D, generator=g), torch.randn(ROWS * n, H, D, generator=g)
    with jit.forcing(True):
        append_kv(view, rows, pos, k, v)
    return view


def planes(view) -> list[torch.Tensor]:  # noqa: ANN001
    return [t for t in (view.k_pages, view.v_pages, view.k_scale_pages, view.v_scale_pages)
            if t is not None]


def both(run: Callable[[], object]) -> tuple[object, object]:
    with jit.forcing(True):
        a = run()
    with jit.forcing(False):
        b = run()
    return a, b


@pytest.mark.parametrize("profile,order", LAYOUTS, ids=lambda x: getattr(x, "value", x))
def test_the_twins_write_and_read_the_same_bytes(profile: Profile, order: PlaneOrder) -> None:
    views = [filled(profile, order), filled(profile, order)]
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(ROWS, H, D, generator=g), torch.randn(ROWS, H, D, generator=g)
    rows, pos = torch.arange(ROWS, dtype=torch.int32), torch.tensor([150, 151, 255],
                                                                    dtype=torch.int32)
    for view, parallel in zip(views, (True, False), strict=True):
        with jit.forcing(parallel):
            append_kv(view, rows, pos, k, v)
    for a, b in zip(planes(views[0]), planes(views[1]), strict=True):
        assert torch.equal(a, b)
    view = views[0]
    q = torch.randn(ROWS, 2 * H, D, generator=g)
    ctx = torch.tensor([151, 152, 256], dtype=torch.int32)
    for n_split in (1, 3):
        a, b = both(lambda n=n_split: paged_decode(q, view, rows, ctx, n_split=n))
        assert torch.equal(a, b)  # type: ignore[arg-type]
    qv = torch.randn(7, 2 * H, D, generator=g)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    lens = torch.tensor([40, 5, 150], dtype=torch.int32)
    a, b = both(lambda: paged_prefill_varlen(qv, view, rows, cu, lens))
    assert torch.equal(a, b)  # type: ignore[arg-type]
    for copy_run in (lambda p: copy_pages(p, view.order, [0, 5], [12, 13]),
                     lambda p: copy_tails(p, view.order, [1, 6], [12, 13], [17, 64])):
        out = []
        for parallel in (True, False):
            p = [t.clone() for t in planes(view)]
            with jit.forcing(parallel):
                copy_run(p)
            out.append(p)
        assert all(torch.equal(x, y) for x, y in zip(*out, strict=True))
        assert not all(torch.equal(x, y) for x, y in zip(out[0], planes(view), strict=True))


def recording(monkeypatch: pytest.MonkeyPatch, module: object, parallel: str, serial: str
              ) -> list[str]:
    """Replace ``module``'s two twins by stubs that record which ran."""
    ran: list[str] = []
    monkeypatch.setattr(module, parallel, lambda *a: ran.append("parallel"))
    monkeypatch.setattr(module, serial, lambda *a: ran.append("serial"))
    return ran


def test_small_work_runs_serially_and_large_work_in_parallel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    view = filled(Profile.BF16)
    rows = torch.arange(ROWS, dtype=torch.int32)
    ctx = torch.tensor([10, 20, 30], dtype=torch.int32)
    q = torch.randn(ROWS, H, D)
    cases = [
        (copy, "_copy_cpu", "_copy_serial",
         lambda: copy_tails(planes(view), view.order, [1], [12], [3]),
         H * 64 * D * 2),  # one page of a plane (each plane a call): H rows of 64 x D
        # bf16, copied in bytes (a tail's columns are bytes; whole pages move in words)
        (append, "_append_cpu", "_append_serial",
         lambda: append_kv(view, rows, ctx, q, q), ROWS * H * D),
        (attention, "_decode_cpu", "_decode_serial",
         lambda: paged_decode(q, view, rows, ctx), H * D * (10 + 20 + 30)),
        (prefill, "_prefill_cpu", "_prefill_serial",
         lambda: paged_prefill_varlen(q, view, rows, torch.tensor([0, 1, 2, 3]), ctx),
         H * D * (10 + 20 + 30)),
    ]
    for module, par, ser, run, work in cases:
        ran = recording(monkeypatch, module, par, ser)
        picked = []
        for grain in (1 << 18, work, work + 1):  # the default; the same work at the grain
            monkeypatch.setattr(jit, "SERIAL_BELOW", grain)
            run()
            picked.append(sorted(set(ran)))  # copies: one call per plane, all alike
            ran.clear()
        assert picked == [["serial"], ["parallel"], ["serial"]], (module.__name__, picked)


def test_forcing_holds_in_its_own_thread_only() -> None:
    """Review finding: ``forcing`` set a module global, so a ``warmup`` on one thread made
    another thread's large work serial, and interleaved exits on two threads left it forced
    for good. It is a context variable now: each thread sees only its own."""
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def warming() -> None:
        with jit.forcing(False):
            inside.set()
            release.wait(10)
            seen.append(jit.parallel(1 << 40))

    t = threading.Thread(target=warming)
    t.start()
    assert inside.wait(10)
    with jit.forcing(True):
        assert jit.parallel(1)           # this thread's own choice
    assert jit.parallel(1 << 40) and not jit.parallel(1)  # the other's is not seen here
    release.set()
    t.join(10)
    assert seen == [False]
    assert jit._forced.get() is None
