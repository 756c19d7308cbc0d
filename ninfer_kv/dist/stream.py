"""The TP record stream's three message kinds, on the wire (version 4).

Every message is a msgpack body followed by the CRC-32C of that body (4 bytes, little
endian). A message that fails its CRC, does not decode, or whose fields have the wrong types
is refused with ``RecordRefused`` and nothing of it is applied.

* **Hello** (once, when the leader attaches): a map ``{magic: "NKVH", version, salt, seq,
  chain, plan, state, digest}`` — the stream's salt, the leader's record seq and CRC chain
  value, its capacity plan, its (empty) state encoded as a snapshot, and that state's digest.
* **Boundary message** (one per leader boundary): an array ``[magic: "NKVB", version, salt,
  n, flags, note, digest, frames]`` — ``salt`` is the stream's (the hello's), so another
  leader's message is refused even when it carries no record; ``n`` counts the messages of
  the stream from 1, so a lost, repeated or reordered message is refused even when it carries
  no record (a FAILED message may come one number late: the message before it may have
  reached only some followers); ``flags`` holds END
  (the leader closed the stream), FAILED (the leader stopped, fail-stop) and ACK (a record in
  it changes what a reopen keeps: every standby acknowledges it once it is durable there,
  and the leader's boundary returns only then); ``note`` is the
  scheduler's output, opaque bytes; ``digest`` the leader's state digest after the frames, or
  ""; ``frames`` the records since the previous message, each framed exactly as in the journal
  (docs/journal-format.md, "Record frame").

* **Ack** (standby to leader): an array ``[magic: "NKVA", version, n, ok, error]`` — message
  ``n`` (flagged ACK) is applied and fsynced in the standby's journal (``ok``), or the standby
  stopped and why (``ok`` false; sent at once, read by the leader at its next ACK message).

Version 1 had no ``n`` and no CRC on the hello; version 2 no ACK flag and no Ack; version 3
no salt in the boundary message (a record-less message of another leader was applied).
"""

from __future__ import annotations

from typing import Any

import msgspec
from crc32c import crc32c

from ninfer_kv.dist.errors import RecordRefused
from ninfer_kv.errors import InvalidArgument

HELLO_MAGIC, MSG_MAGIC, ACK_MAGIC, VERSION = "NKVH", "NKVB", "NKVA", 4
END, FAILED, ACK = 1, 2, 4


class Hello(msgspec.Struct, frozen=True):
    magic: str
    version: int
    salt: int
    seq: int
    chain: int
    plan: dict[str, Any]
    state: bytes
    digest: str


class Message(msgspec.Struct, array_like=True, frozen=True):
    magic: str
    version: int
    salt: int
    n: int
    flags: int
    note: bytes
    digest: str
    frames: list[bytes]


class Ack(msgspec.Struct, array_like=True, frozen=True):
    magic: str
    version: int
    n: int
    ok: bool
    error: str


def seal(body: bytes) -> bytes:
    return body + crc32c(body).to_bytes(4, "little")


def unseal(data: bytes) -> bytes | None:
    """The body ``seal`` wrapped, or None when the CRC-32C does not match."""
    if len(data) < 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:], "little"):
        return None
    return data[:-4]


def encode_hello(h: Hello) -> bytes:
    return seal(msgspec.msgpack.encode(h))


def encode_message(m: Message) -> bytes:
    return seal(msgspec.msgpack.encode(m))


def _open(data: bytes, what: str, magic: str, kind: type[Any]) -> Any:
    """CRC, then every field's type; a refusal names a wrong magic or version first."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"{what} must be bytes (as the leader sent it), not "
                              f"{type(data).__name__}")
    body = unseal(data)
    if body is None:
        raise RecordRefused(f"{what} of {len(data)} bytes fails its CRC-32C: damaged in "
                            "transit; nothing applied")
    bad = None
    try:
        out = msgspec.msgpack.decode(body, type=kind)
        head: tuple[Any, ...] = (out.magic, out.version)
    except msgspec.ValidationError as exc:
        bad = exc  # a wrong field; or another kind or version, which names it better
        raw = msgspec.msgpack.decode(body)
        head = (raw.get("magic"), raw.get("version")) if isinstance(raw, dict) else (
            tuple(raw[:2]) if isinstance(raw, list) and len(raw) >= 2 else (None, None))
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise RecordRefused(f"{what} does not decode: {exc}") from None
    if head != (magic, VERSION):
        raise RecordRefused(f"{what} magic/version {head[0]!r}/{head[1]!r} != "
                            f"{magic!r}/{VERSION}")
    if bad is not None:
        raise RecordRefused(f"{what} has a malformed field: {bad}")
    return out


def decode_hello(data: bytes) -> Hello:
    return _open(data, "hello", HELLO_MAGIC, Hello)


def decode_message(data: bytes) -> Message:
    return _open(data, "message", MSG_MAGIC, Message)


def encode_ack(a: Ack) -> bytes:
    return seal(msgspec.msgpack.encode(a))


def decode_ack(data: bytes) -> Ack:
    return _open(data, "ack", ACK_MAGIC, Ack)
