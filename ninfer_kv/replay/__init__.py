"""Offline replay: rebuild the store's logical state from a journal with the engine's own
``apply`` — no GPU, no plane tensors. Verify invariants every N events, stop at a record or an
event, return the state and its digest; diff two journals.
"""

from ninfer_kv.replay.core import (
    DiffResult,
    ReplayResult,
    Violation,
    diff,
    replay,
    replay_start,
)

__all__ = ["DiffResult", "ReplayResult", "Violation", "diff", "replay", "replay_start"]
