"""Events as plain JSON values (``ninfer-kv dump``'s NDJSON, ``inspect --page`` history):
packed array fields as int lists of their declared element type, engine metadata as the value
it encodes."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ninfer_kv.journal.events import I32


def to_jsonable(event: Any) -> dict[str, Any]:
    """One event as a plain dict for NDJSON: tag first, packed arrays as int lists, engine
    metadata as the value it encodes. A packed field whose length is no multiple of its
    dtype raises ``ValueError`` (a hand-made record)."""
    out: dict[str, Any] = {"type": type(event).__struct_config__.tag}
    for name in event.__struct_fields__:
        v = getattr(event, name)
        if isinstance(v, bytes):
            if name in OPAQUE_FIELDS:
                v = metadata_jsonable(v)
            else:  # every other bytes field is a packed array (tests/tools/test_cli.py: each declared)
                v = np.frombuffer(v, dtype=PACKED_FIELDS[name]).tolist()
        out[name] = v
    return out


PACKED_FIELDS = {"bundles": I32, "slots": I32, "pages": I32, "frontiers": I32, "kept": I32,
                 "dropped": I32, "epochs": I32, "coverage": I32,
                 "offsets": np.dtype("<i8"), "checksums": np.dtype("<u4")}
"""The ``bytes`` fields of events that are packed arrays, and their element type."""
OPAQUE_FIELDS = frozenset({"meta"})
"""The ``bytes`` fields that are no array: ``SetMetadata.meta``, the engine's msgpack."""


def metadata_jsonable(meta: bytes) -> Any:
    """``SetMetadata.meta`` for NDJSON: the value it encodes (what ``checkpoint_info``
    returns; None for an empty one, a clear), or ``{"msgpack_hex": ...}`` when it does not
    decode, or when JSON would not give it back unchanged (bytes, which JSON writes as
    base64 text; NaN, written as null; a map with keys that are no strings)."""
    if not meta:
        return None
    try:
        value = msgspec.msgpack.decode(meta)
        same = msgspec.json.decode(msgspec.json.encode(value)) == value
    except (msgspec.MsgspecError, TypeError, ValueError):
        same = False
    return value if same else {"msgpack_hex": meta.hex()}
