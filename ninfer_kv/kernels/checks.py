"""What the kernel wrappers check before a launch (spec §12.4: "the wrapper validates the
Tensor dtype, geometry, closed strides, table shape and execution envelope").

* ``check_view``: each plane has the dtype and [N, H, P, X] / [H, N, P, X] geometry of the
  view's closed profile (a float32 plane handed in for a BF16 profile is refused, not
  reinterpreted) and closed strides (contiguous: a stride of 0 would make pages alias);
  scale planes exist exactly when the codec has one; tables are int32 [C, L]; no two of
  them share memory (a K plane that is the V plane stores V over K).
* ``check_devices``: the op's tensors are on the planes' device.
* ``check_mapped`` / ``check_read_domain``: every (table row, position) a launch writes or
  reads is inside the table and maps a page group of the planes (an entry of -1 would
  otherwise index the pool's last page), and no two writes land on one token slot. It runs
  on the host for CPU tensors — a few torch ops over B entries; for CUDA tensors it would
  cost a device sync per launch, so there the kernels skip unmapped entries instead, and
  the check runs on host copies only in checked mode (``StoreConfig(checked=True)``).

Every refusal is an ``InvalidArgument`` (a ``KVStoreError`` and a ``ValueError``) naming the
tensor, what it is and what the rule wants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import P, PlaneOrder, Profile, codec_planes
from ninfer_kv.errors import InvalidArgument

F32_MAX = 3.4028234663852886e38
MAX_SPLITS = 1024
"""The most context splits one decode launch takes (its partial results are [B, Hq, n_split]:
``choose_splits`` picks at most ceil(max_ctx / 256), 512 at a 128k context)."""

_SAME_BITS = {torch.uint16: (torch.uint16, torch.int16, torch.bfloat16),
              torch.uint8: (torch.uint8,), torch.int8: (torch.int8,)}
"""Storage dtypes a plane may be handed in as (the same bits: BF16 codes as bfloat16)."""


def check_index(t: Any, name: str, who: str, ndim: int = 1) -> torch.Tensor:
    """An integer tensor of ``ndim`` dims (positions, rows, lengths): a float is refused,
    never truncated, and a list is not taken for a tensor. Returns it as the wrappers use it:
    uint16/uint32 (``torch.from_numpy`` of a numpy uint32 array) as int64, since torch has
    few operations on them (``max``, ``<``); every other dtype outside int8/16/32/64 and
    uint8 — uint64 from 2**63 has no int64 form, the sub-byte and quantized ones no
    arithmetic — is refused."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES and t.dtype not in _WIDENED:
        raise InvalidArgument(f"{who}: {name} must be an integer tensor (int8/16/32/64 or "
                              f"uint8/16/32), got {t.dtype}")
    _strided(t, name, who)
    if t.dim() != ndim:
        raise InvalidArgument(f"{who}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t.to(torch.int64) if t.dtype in _WIDENED else t


_INDEX_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))
_WIDENED = frozenset((torch.uint16, torch.uint32))


def check_values(t: Any, name: str, who: str, ndim: int) -> None:
    """A floating-point tensor (q, k, v) of ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dim() != ndim:
        raise InvalidArgument(f"{who}: {name} must be a {ndim}-D floating-point tensor, got "
                              f"{t.dtype} {tuple(t.shape)}")
    _strided(t, name, who)



def _strided(t: torch.Tensor, name: str, who: str) -> None:
    """A dense tensor: a sparse or nested one has no strides for the kernels to read (and its
    conversions fail later, past the checks)."""
    if t.layout != torch.strided or t.is_nested:
        raise InvalidArgument(f"{who}: {name} must be a dense (strided) tensor, got layout "
                              f"{t.layout}{' (nested)' if t.is_nested else ''}")


def check_view(view: Any, who: str) -> None:
    tables = getattr(view, "block_tables", None)
    if not isinstance(tables, torch.Tensor):  # e.g. §12.1's one-sequence PagedKVLayerView
        raise InvalidArgument(f"{who}: takes a batch view with a block-table matrix "
                              f"(store.batch_view, §12.2), not a {type(view).__name__}")
    if tables.dtype != torch.int32 or tables.dim() != 2:  # the kernels index [row, block]
        raise InvalidArgument(f"{who}: block table must be int32 [C, L], got "
                              f"{tables.dtype} {tuple(tables.shape)}")
    if not isinstance(view.storage, Profile) or not isinstance(view.order, PlaneOrder):
        raise InvalidArgument(f"{who}: the view's storage must be a Profile and its order a "
                              f"PlaneOrder, got {view.storage!r} and {view.order!r}")
    as_int(f"{who}: view num_kv_heads", view.num_kv_heads, lo=1)
    as_int(f"{who}: view head_dim", view.head_dim, lo=1)
    if not tables.is_contiguous():  # its memory is then one range, which the overlap check sees
        raise InvalidArgument(f"{who}: block table {tuple(tables.shape)} has strides "
                              f"{tables.stride()}, not the closed strides of its shape (§12.4)")
    n_pages = None
    spans: list[tuple[str, torch.Tensor]] = [("block table", tables)]
    for side, codec in zip(("k", "v"), view.storage.codecs, strict=True):
        want = dict((role, (dt, x)) for role, dt, x, _ in codec_planes(codec, view.head_dim))
        for role in ("code", "scale"):
            t = getattr(view, f"{side}_pages" if role == "code" else f"{side}_scale_pages")
            name = f"{side}_{role}"
            if role not in want:
                if t is not None:
                    raise InvalidArgument(f"{who}: {view.storage.value} has no {name} plane, "
                                          f"got a {t.dtype} tensor")
                continue
            dt, x = want[role]
            if t is None:
                raise InvalidArgument(f"{who}: {view.storage.value} needs a {name} plane")
            if t.dtype not in _SAME_BITS[dt]:
                raise InvalidArgument(f"{who}: {name} plane is {t.dtype}; profile "
                                      f"{view.storage.value} stores {dt} (§4.3)")
            if t.dim() != 4:
                raise InvalidArgument(f"{who}: {name} plane must be 4-D, got {tuple(t.shape)}")
            h, n = ((t.shape[1], t.shape[0]) if view.order is PlaneOrder.PAGE_MAJOR
                    else (t.shape[0], t.shape[1]))
            if (h, t.shape[2], t.shape[3]) != (view.num_kv_heads, P, x):
                raise InvalidArgument(f"{who}: {name} plane {tuple(t.shape)} ({view.order.value}"
                                      f") does not hold H={view.num_kv_heads}, P={P}, X={x}")
            if n_pages is not None and n != n_pages:
                raise InvalidArgument(f"{who}: planes disagree on the page count ({n} vs "
                                      f"{n_pages}); a page group spans every plane (§4.2)")
            n_pages = n
            if not t.is_contiguous():  # a stride of 0, or a slice a copy would write apart
                raise InvalidArgument(f"{who}: {name} plane {tuple(t.shape)} has strides "
                                      f"{t.stride()}, not the closed strides of its shape "
                                      f"(§12.4: contiguous, each page its own memory)")
            spans.append((f"{name} plane", t))
    _refuse_overlap(spans, who)


def _refuse_overlap(spans: list[tuple[str, torch.Tensor]], who: str) -> None:
    """No two of the view's tensors (contiguous: one byte range each) share memory: a K plane
    that is the V plane, or a scale plane inside a code plane, would make one token's write
    another's bytes (§12.4)."""
    ranges = sorted((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(),
                     name) for name, t in spans if t.numel())
    # sorted by start: if a range overlaps any later one, it overlaps the next
    for (dev, _, hi, name), (dev2, lo2, _, name2) in zip(ranges, ranges[1:], strict=False):
        if dev == dev2 and lo2 < hi:
            raise InvalidArgument(f"{who}: the view's {name} and {name2} share memory "
                                  f"(bytes {lo2:#x}..{hi:#x}); every plane and the table "
                                  "need their own (§12.4)")


def check_devices(view: Any, who: str, **tensors: torch.Tensor) -> None:
    """Every plane, the table and every op input on one device (§12.4: the execution
    envelope), refused by name — not a ``TypeError`` from inside a launch, nor a host check
    skipped because one input is on CUDA while the kernels run on the CPU."""
    dev = view.k_pages.device
    parts = [("v_code plane", view.v_pages), ("k_scale plane", view.k_scale_pages),
             ("v_scale plane", view.v_scale_pages), ("block table", view.block_tables),
             *tensors.items()]
    for name, t in parts:
        if t is not None and t.device != dev:
            raise InvalidArgument(f"{who}: {name} is on {t.device}, the view's k_code plane "
                                  f"on {dev}")


def on_host(view: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(the [C, L] table, *tensors) on the host for a check: as they are when all are on the
    CPU. For CUDA tensors the check would cost a device sync per launch, so there it runs
    only for a view in checked mode (``StoreConfig(checked=True)`` gives the view a write
    ``guard``), on host copies; otherwise None, and the kernels skip unmapped entries."""
    if not view.block_tables.is_cuda and not any(t.is_cuda for t in tensors):
        return (view.block_tables, *tensors)
    if getattr(view, "guard", None) is None:
        return None
    return tuple(t.cpu() for t in (view.block_tables, *tensors))


def _refuse_first(bad: torch.Tensor, message: Callable[[int], str]) -> None:
    if bool(bad.any()):
        raise InvalidArgument(message(int(bad.nonzero()[0, 0])))


def attention_options(who: str, sm_scale: Any, n_split: Any = None
                      ) -> tuple[float | None, int | None]:
    """``sm_scale`` (None: 1/sqrt(D)) as a finite float and ``n_split`` (None: chosen) as an
    int in [1, MAX_SPLITS], or ``InvalidArgument`` naming the value."""
    scale = None
    if sm_scale is not None:
        try:
            if isinstance(sm_scale, str | bytes | bool):
                raise TypeError
            scale = float(sm_scale)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of many values
            raise InvalidArgument(f"{who}: sm_scale={sm_scale!r} is not a real number") from None
        if not math.isfinite(scale) or abs(scale) > F32_MAX:  # the kernels take a float32
            raise InvalidArgument(f"{who}: sm_scale={scale} is not a finite float32")
    splits = None if n_split is None else as_int(f"{who}: n_split", n_split, lo=1, hi=MAX_SPLITS)
    return scale, splits


def int32_or_skip(t: torch.Tensor) -> torch.Tensor:
    """Rows, positions and context lengths as the kernels' int32, on the tensor's device
    without a host sync: a value outside [0, 2**31) becomes -1, which every kernel skips (a
    plain cast would wrap 2**32 to 0 — another row, or a committed token — on CUDA tensors,
    which no host check sees)."""
    t = t.to(torch.int64)  # compared as int64: 2**31 does not fit an int32 tensor's dtype
    return torch.where((t >= 0) & (t < 2**31), t, -1).to(torch.int32)


def check_mapped(view: Any, table_rows: torch.Tensor, positions: torch.Tensor,
                 who: str) -> None:
    """Every ``(table_rows[i], positions[i])`` lies in the table and maps a page group, and
    no two write one token slot (a page group's column)."""
    host = on_host(view, table_rows, positions)
    if host is None:
        return
    tables, table_rows, positions = host
    rows, cols = tables.shape
    r, pos = table_rows.long(), positions.long()
    where = lambda i: f"{who}: entry {i} (table row {int(r[i])}, position {int(pos[i])})"  # noqa: E731
    _refuse_first((r < 0) | (r >= rows) | (pos < 0) | (pos >= cols * P),
                  lambda i: f"{where(i)} is outside the table [C={rows}, L*P={cols * P}]")
    g = tables[r, pos >> 6]
    n_pages = view.k_pages.shape[0 if view.order is PlaneOrder.PAGE_MAJOR else 1]
    _refuse_first((g < 0) | (g >= n_pages),
                  lambda i: f"{where(i)} maps page group {int(g[i])}: not mapped "
                            "(ensure_mapped before the launch, §8.1)")
    if len(r) > 1:  # two writes of one slot run in parallel: a row could mix their bytes,
        # through one table row or two that map the same page (a fork's shared prefix)
        slot = g.long() * P + (pos & (P - 1))
        keys, counts = torch.unique(slot, return_counts=True)
        if bool((counts > 1).any()):
            i, j = (int(x) for x in (slot == keys[counts > 1][0]).nonzero()[:2, 0])
            raise InvalidArgument(f"{who}: entries {i} and {j} (table rows {int(r[i])} and "
                                  f"{int(r[j])}, positions {int(pos[i])} and {int(pos[j])}) "
                                  f"both write column {int(pos[i]) % P} of page group "
                                  f"{int(g[i])} in one call")


def check_read_domain(view: Any, table_rows: torch.Tensor, context_lens: torch.Tensor,
                      who: str) -> None:
    """Every block a row reads (positions < context_lens[i]) is mapped (§12.4)."""
    host = on_host(view, table_rows, context_lens)
    if host is None:
        return
    tables, table_rows, context_lens = host
    rows, cols = tables.shape
    r, ctx = table_rows.long(), context_lens.long()
    _refuse_first((r < 0) | (r >= rows) | (ctx < 0) | (ctx > cols * P),
                  lambda i: f"{who}: row {i} (table row {int(r[i])}, context {int(ctx[i])}) "
                            f"is outside the table [C={rows}, L*P={cols * P}]")
    needed = torch.arange(cols).view(1, -1) < ((ctx + P - 1) // P).view(-1, 1)
    n_pages = view.k_pages.shape[0 if view.order is PlaneOrder.PAGE_MAJOR else 1]
    g = tables[r]
    unmapped = needed & ((g < 0) | (g >= n_pages))  # past the pool: another's memory
    if bool(unmapped.any()):
        i, b = (int(x) for x in unmapped.nonzero()[0])
        raise InvalidArgument(f"{who}: row {i} (table row {int(r[i])}) reads block {b} below "
                              f"its context {int(ctx[i])}, which maps page group "
                              f"{int(g[i, b])}: not a mapped page of the {n_pages} (§12.4)")
