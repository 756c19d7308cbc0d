"""``command``: a mutating command of ``KVStore`` is all done, not done, or the store fails.

The decorator lives apart from the store (engine/core.py) so the store module stays one idea;
it needs of the store only what ``Guarded`` names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from ninfer_kv.errors import StoreFailed


class Guarded(Protocol):
    """What ``guarded`` reads of the store: the count of events applied, why it failed, and
    the way to fail it (``StoreCore``)."""

    _applied: int
    _failed: str | None

    def _fail(self, what: str, exc: BaseException) -> None: ...


F = TypeVar("F", bound=Callable[..., Any])


def command(fn: F) -> F:
    """A mutating command of ``KVStore``: all of it happens, or none of it, or the store fails.

    Commands validate, then emit (applied at once), then fill the boundary's queues. An
    exception escaping once the first event reached ``apply`` — ``KeyboardInterrupt``,
    ``SystemExit`` from a signal handler, ``MemoryError``, a bug — would leave half a
    command for the next boundary (or ``close``) to journal: a page mapped in the state and
    missing from the block table, a COW tail whose copy never runs. So it fails the store
    (fail-stop: nothing pending is published, a reopen recovers from the journal); a
    ``KeyboardInterrupt`` or ``SystemExit`` then reaches the engine unchanged, any other
    exception as ``StoreFailed`` from it. An exception before the first event (a typed
    refusal, an interrupt while planning) changed nothing and passes through."""
    @functools.wraps(fn)
    def run(self: Guarded, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        return guarded(fn, self, args, kwargs)
    return cast(F, run)


def guarded(fn: Callable[..., Any], store: Guarded, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
    """``command``'s body, looked up at each call (a patch takes effect in decorated ones)."""
    mark = store._applied
    try:
        return fn(store, *args, **kwargs)
    except BaseException as exc:
        if store._applied == mark or store._failed is not None:
            raise
        store._fail(fn.__name__, exc)
        if not isinstance(exc, Exception):
            raise
        raise StoreFailed(f"{fn.__name__} raised after it changed the state; the store "
                          f"stopped: {store._failed}") from exc
