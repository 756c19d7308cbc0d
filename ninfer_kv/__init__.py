"""ninfer-kv: an event-sourced KV-cache storage layer for LLM inference engines.

The public API is re-exported lazily so that ``import ninfer_kv.journal`` stays light (no torch).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


class LogSink:
    """Where the library's default log lines go: the *current* ``sys.stderr`` (not the one of
    import time), or, while ``held`` is a list, that list — the CLI holds them while a command
    runs, so a command that fails says so in one line (tools/cli.py). Past ``HOLD_MAX``
    pieces (a long command logging at debug) the held ones are written and the rest go out
    as they come."""

    HOLD_MAX = 256
    held: list[str] | None = None

    def write(self, text: str) -> None:
        held = self.held
        if held is None:
            sys.stderr.write(text)
        elif len(held) < self.HOLD_MAX:
            held.append(text)
        else:
            sys.stderr.write("".join(held) + text)
            held.clear()
            self.held = None

    def flush(self) -> None:
        if self.held is None:
            sys.stderr.flush()


LOG_SINK = LogSink()

if not structlog.is_configured():
    # Library default: key-value lines on stderr (never stdout: CLI --json owns it), level from
    # NINFER_KV_LOG (default warning). An application that configures structlog itself wins.
    _level = getattr(logging, os.environ.get("NINFER_KV_LOG", "warning").upper(), logging.WARNING)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        logger_factory=structlog.PrintLoggerFactory(LOG_SINK),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )

_EXPORTS = {
    "KVStore": "ninfer_kv.engine.store",
    "StoreConfig": "ninfer_kv.engine.store",
    "KVStoreError": "ninfer_kv.errors",
    "Journal": "ninfer_kv.journal.log",
    "JournalReader": "ninfer_kv.journal.reader",
    "Profile": "ninfer_kv.engine.layout",
    "PoolKind": "ninfer_kv.engine.layout",
    "ModelGeometry": "ninfer_kv.engine.capacity",
    "ServingConfig": "ninfer_kv.engine.capacity",
    # kernels an engine calls around a GPU unit (shapes in their modules' docstrings)
    "append_kv": "ninfer_kv.kernels.append",
    "paged_decode": "ninfer_kv.kernels.attention",
    "paged_prefill": "ninfer_kv.kernels.attention",
    "paged_prefill_varlen": "ninfer_kv.kernels.prefill",
    "warmup": "ninfer_kv.kernels.warmup",
    # vLLM/FlashInfer forms of the same data (no copies)
    "slot_mapping": "ninfer_kv.engine.views",
    "typed_planes": "ninfer_kv.engine.views",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ninfer_kv' has no attribute {name!r}")
