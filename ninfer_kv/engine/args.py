"""Normalizing caller input at the public boundary.

Every integer a caller passes goes through :func:`as_int` (``operator.index``: Python and numpy
integers pass, floats, strings and bools do not) before any rule is checked, so a journaled
event only ever holds plain ``int`` values. Batched arguments go through :func:`as_ints`.
Both raise :class:`~ninfer_kv.errors.InvalidArgument`, which names the argument and the rule.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ninfer_kv.errors import FrontierError, InvalidArgument
from ninfer_kv.journal.events import METADATA_MAX, METADATA_PER_RECORD, REASON_MAX, SetMetadata

_BOOLS = (bool, np.bool_)


def as_bool(name: str, value: Any) -> bool:
    """A caller's flag: a ``bool`` itself (it has no subclasses; ``np.bool_``, 0 and 1 are
    refused, as ``as_int`` refuses bools), or ``InvalidArgument``."""
    if type(value) is not bool:
        raise InvalidArgument(f"{name}={value!r} must be a bool")
    return value


def as_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """``operator.index(value)`` checked against ``[lo, hi]``."""
    if type(value) is int:  # the common case (``type(True) is bool``, so no bool passes here)
        v = value
    else:
        if isinstance(value, _BOOLS) or str(getattr(value, "dtype", "")) == "torch.bool":
            raise InvalidArgument(f"{name}={value!r}: a bool is not an integer")
        if getattr(value, "ndim", 0):  # torch indexes a one-element tensor of any shape
            raise InvalidArgument(f"{name}={value!r}: a {value.ndim}-D array is not an "
                                  "integer (pass a scalar)")
        try:
            v = operator.index(value)
        except TypeError:
            raise InvalidArgument(f"{name}={value!r} ({type(value).__name__}) is not an "
                                  "integer") from None
    if lo is not None and v < lo:
        raise InvalidArgument(f"{name}={v} must be >= {lo}")
    if hi is not None and v > hi:
        raise InvalidArgument(f"{name}={v} must be <= {hi}")
    return v


def as_ints(name: str, values: Sequence[Any] | np.ndarray) -> list[int]:
    """A batch of integers as a list of plain ints (numpy integer arrays are accepted whole;
    an object array's elements each go through ``operator.index``, as a list's do; an empty
    1-D array is an empty batch whatever its dtype: ``np.array([])`` is float64)."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and (
            values.dtype == object or values.size == 0):
        values = values.tolist()
    if isinstance(values, np.ndarray):  # kind, not issubdtype: numpy files timedelta64
        if values.ndim != 1 or values.dtype.kind not in "iu":  # under signedinteger
            raise InvalidArgument(f"{name}: want a 1-D integer array, got dtype {values.dtype} "
                                  f"shape {values.shape}")
        return values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{name}={values!r}: want a sequence of integers")
    out = list(values)
    if set(map(type, out)) <= _PLAIN:  # the hot path: plain ints only, one C-level pass
        return out
    for i, v in enumerate(out):
        if type(v) is not int:
            out[i] = as_int(f"{name}[{i}]", v)
    return out


_PLAIN = frozenset((int,))  # ``type(True) is bool``: bools take the checked path and are refused


def as_int_array(name: str, values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """A batch of integers as a 1-D int64 array (the array-valued commands' form). Every
    element goes through ``operator.index`` (numpy integer arrays are accepted whole); a value
    outside int64 is refused by name."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind == "i":
        return values.astype(np.int64, copy=False)
    ints = as_ints(name, values)
    try:
        return np.fromiter(ints, np.int64, len(ints))
    except OverflowError:
        big = next(v for v in ints if not -(1 << 63) <= v < (1 << 63))
        raise InvalidArgument(f"{name}: {big} does not fit in 64 bits") from None


_I64_LO, _I64_HI = -(1 << 63), 1 << 63


def one_pair(bname: str, bundle: Any, vname: str, value: Any) -> tuple[np.ndarray, np.ndarray]:
    """A one-sequence command as the batched form's int64 arrays (``as_int`` each, refused by
    name outside 64 bits): what ``as_int_array`` makes of ``[bundle]`` and ``[value]``."""
    b, v = as_int(bname, bundle), as_int(vname, value)
    if not _I64_LO <= b < _I64_HI:
        raise InvalidArgument(f"{bname}: {b} does not fit in 64 bits")
    if not _I64_LO <= v < _I64_HI:
        raise InvalidArgument(f"{vname}: {v} does not fit in 64 bits")
    pair = np.array((b, v), np.int64)
    return pair[:1], pair[1:]


def a_store(store: Any, who: str) -> None:  # noqa: ANN401
    """``store`` is a store (it has a state and commands), else ``InvalidArgument`` naming
    ``who``: the helpers over a store (cache/) would otherwise fail on its first attribute."""
    if not (hasattr(getattr(store, "state", None), "bundles") and hasattr(store, "activate")):
        raise InvalidArgument(f"{who}: {store!r} is not a KVStore")


def duplicated(values: np.ndarray) -> list[int]:
    """The values that appear more than once in ``values`` (sorted; empty when none)."""
    if len(values) < 2:
        return []
    s = np.sort(values)
    return np.unique(s[1:][s[1:] == s[:-1]]).tolist()


def same_length(**batches: Sequence[Any]) -> int:
    """The common length of batched arguments; refuses a mismatch naming every length."""
    lengths = [len(v) for v in batches.values()]
    if lengths and min(lengths) != max(lengths):
        raise InvalidArgument("batched arguments differ in length: "
                              + ", ".join(f"{k}={len(v)}" for k, v in batches.items()))
    return lengths[0] if lengths else 0


def token_budget(prompt_tokens: Any, max_output_tokens: Any, s: int) -> tuple[int, int, int]:
    """(prompt, output, total) of an activation: integers >= 0 whose sum is positive and at
    most the logical ceiling ``s`` (§3.2), else refused naming them."""
    prompt_tokens = as_int("prompt_tokens", prompt_tokens, lo=0)
    max_output_tokens = as_int("max_output_tokens", max_output_tokens, lo=0)
    total = prompt_tokens + max_output_tokens
    if total <= 0:
        raise FrontierError(f"prompt_tokens={prompt_tokens} + max_output_tokens="
                            f"{max_output_tokens}: need a positive budget (a positive sum)")
    if total > s:
        raise FrontierError(f"prompt {prompt_tokens} + output {max_output_tokens} = {total} "
                            f"tokens > S={s}, the logical ceiling (§3.2)")
    return prompt_tokens, max_output_tokens, total


def one_of(name: str, value: Any, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidArgument(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    return value


def finish_reason(reason: Any) -> str:
    """``reason`` as a finish journals it: an exact ``str`` (a subclass such as numpy.str_
    would not encode, nor digest, at the boundary), valid UTF-8, at most ``REASON_MAX``
    bytes — refused now, not there."""
    if type(reason) is not str:
        raise InvalidArgument(f"finish: reason={reason!r} must be a str")
    try:
        size = len(reason.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"finish: reason={reason!r} is not valid UTF-8") from None
    if size > REASON_MAX:
        raise InvalidArgument(f"finish: a reason of {size} UTF-8 bytes > REASON_MAX={REASON_MAX}")
    return reason


def metadata_room(what: str, pending: Sequence[Any], size: int) -> None:
    """``size`` more bytes of metadata fit this boundary's record: at most ``METADATA_MAX`` for
    one bundle, ``METADATA_PER_RECORD`` for all the ``SetMetadata`` events ``pending``."""
    if size > METADATA_MAX:
        raise InvalidArgument(f"{what}: {size} bytes encoded > METADATA_MAX={METADATA_MAX}")
    queued = sum(len(e.meta) for e in pending if isinstance(e, SetMetadata))
    if queued + size > METADATA_PER_RECORD:
        raise InvalidArgument(f"{what}: {queued} + {size} metadata bytes in one boundary > "
                              f"METADATA_PER_RECORD={METADATA_PER_RECORD}; run a boundary first")
