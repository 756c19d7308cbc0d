"""``PrefixIndex``: which retained checkpoint shares the longest prefix with a prompt, to the
token (``activate_from(ck, frontier, ...)`` can continue at any token, spec §9).

Keys are chained block hashes: ``h_1 = H(seed, block_0)``, ``h_k = H(h_{k-1}, block_{k-1})``
over blocks of ``block`` tokens (default 64 = P), so a key stands for a whole prefix.
``PrefixIndex.vllm()`` uses vLLM's own block hash (sha256), so keys match vLLM's. A
lookup hashes the query block by block and stops at the first key no checkpoint holds (cost
O(query blocks)); among the checkpoints holding the longest matched chain it compares the next,
partial block token by token. The answer is then checked token for token against the
checkpoint (a hash collision can cost a slower lookup, never a wrong answer).

Invariant: ``_holders[h_k]`` is exactly the set of indexed checkpoints whose first ``k`` blocks
hash to ``h_k``; ``_tokens[ck]`` are the tokens ``ck`` was indexed with (at most its committed
frontier — the engine's responsibility, checked by ``from_store``). An ``add`` or ``remove``
interrupted half way (Ctrl-C) may leave holders that are not indexed (not in ``_tokens``):
a lookup that meets one answers by the exact scan, and the next ``add`` or ``remove`` of that
checkpoint drops them.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.info import decode_metadata
from ninfer_kv.errors import InvalidArgument, StateError, UnknownHandle

if TYPE_CHECKING:
    from ninfer_kv.engine.state import StoreState
    from ninfer_kv.engine.store import KVStore

log = structlog.get_logger(__name__)

SEED = b"ninfer-kv prefix index v1"


def blake2b_chain(parent: bytes, block: bytes) -> bytes:
    """The default chain hash: BLAKE2b-128 of the parent key and the block's int32 bytes."""
    return hashlib.blake2b(parent + block, digest_size=16).digest()


def vllm_sha256_chain(parent: bytes, block: bytes) -> bytes:
    """vLLM's block hash with its default ``sha256`` algorithm (``hash_block_tokens``, v1):
    SHA-256 of the pickled ``(parent hash, tuple of token ids, None)``, no extra keys."""
    tokens = tuple(int(t) for t in np.frombuffer(block, dtype="<i4"))
    return hashlib.sha256(pickle.dumps((parent, tokens, None),
                                       protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_none_hash(seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH`` (the first block's parent) for ``sha256``: from
    ``$PYTHONHASHSEED`` if set, else the fixed seed ``"vllm-none-hash"``."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@dataclass(frozen=True, slots=True)
class Match:
    checkpoint: int
    tokens: int  # the common prefix length: continue with activate_from(checkpoint, tokens, ...)


def _as_tokens(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # a ragged or nested list
        raise InvalidArgument(f"{what}: want a 1-D sequence of integer token ids ({exc})"
                              ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):  # not timedelta64 ("m")
        raise InvalidArgument(f"{what}: want a 1-D sequence of integer token ids, got dtype "
                              f"{arr.dtype} shape {arr.shape}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise InvalidArgument(f"{what}: token ids must fit in int32")
    return arr.astype("<i4", copy=True)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixIndex:
    def __init__(self, block: int = 64, chain: Any = blake2b_chain, seed: bytes = SEED) -> None:
        self.block = as_int("block", block, lo=1)
        if not callable(chain):
            raise InvalidArgument(f"PrefixIndex: chain={chain!r} must be a callable "
                                  "(parent key, block tokens) -> key")
        if not isinstance(seed, bytes | bytearray | memoryview):  # bytes(5) is 5 zero bytes
            raise InvalidArgument(f"PrefixIndex: seed={seed!r} must be bytes")
        self._chain_fn = chain
        self._seed = bytes(seed)
        self._holders: dict[bytes, dict[int, None]] = {}  # ordered: newest holder last
        self._tokens: dict[int, np.ndarray] = {}
        self._keys: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, checkpoint: object) -> bool:
        return checkpoint in self._tokens

    @classmethod
    def vllm(cls, block: int = 16, hash_seed: str | None = None) -> PrefixIndex:
        """An index whose keys are vLLM's block hashes (sha256, no extra keys), so the KV
        events an engine publishes from ``block_hashes`` line up with vLLM-aware routers.
        ``hash_seed`` is vLLM's ``PYTHONHASHSEED`` string (an int would hash differently)."""
        if hash_seed is not None and type(hash_seed) is not str:
            raise InvalidArgument(f"PrefixIndex.vllm: hash_seed={hash_seed!r} must be a str "
                                  "(vLLM hashes the PYTHONHASHSEED string)")
        return cls(block, vllm_sha256_chain, vllm_none_hash(hash_seed))

    def block_hashes(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """The chained key of every full block of ``tokens`` (what ``add`` indexes)."""
        return self._chain(_as_tokens(tokens, "block_hashes"))

    def _chain(self, tokens: np.ndarray) -> list[bytes]:
        keys: list[bytes] = []
        h, b = self._seed, self.block
        for i in range(len(tokens) // b):
            h = self._chain_fn(h, tokens[i * b:(i + 1) * b].tobytes())
            keys.append(h)
        return keys

    def add(self, checkpoint: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Index ``checkpoint`` as holding ``tokens`` (its first ``len(tokens)`` tokens)."""
        checkpoint = as_int("checkpoint", checkpoint)
        arr = _as_tokens(tokens, f"add({checkpoint})")
        if checkpoint in self._tokens:
            self.remove(checkpoint)
        self._drop_keys(checkpoint)  # what an interrupted add or remove left
        keys = self._chain(arr)
        self._keys[checkpoint] = keys  # first: a remove after an interrupt finds every key
        for k in keys:
            self._holders.setdefault(k, {})[checkpoint] = None
        self._tokens[checkpoint] = arr  # last: indexed (``in``, ``len``) once whole

    def remove(self, checkpoint: int) -> None:
        checkpoint = as_int("checkpoint", checkpoint)
        if checkpoint not in self._tokens:
            if checkpoint in self._keys:  # an interrupted add or remove: finish removing
                self._drop_keys(checkpoint)
                return
            raise UnknownHandle(f"checkpoint {checkpoint} is not in the prefix index")
        del self._tokens[checkpoint]  # first: lookup skips a holder it does not know
        self._drop_keys(checkpoint)

    def _drop_keys(self, checkpoint: int) -> None:
        """Take ``checkpoint`` out of the holders of its keys (an interrupted ``add`` or
        ``remove`` may have left some: the next ``add`` of it drops them first)."""
        for k in dict.fromkeys(self._keys.get(checkpoint, ())):  # a chain may repeat a key
            holders = self._holders.get(k)
            if holders is not None:
                holders.pop(checkpoint, None)
                if not holders:
                    del self._holders[k]
        self._keys.pop(checkpoint, None)

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> Match | None:
        """The checkpoint sharing the longest prefix with ``tokens`` (the newest one among
        equals), or None when none shares a token."""
        q = _as_tokens(tokens, "lookup")
        b, h, k = self.block, self._seed, 0
        candidates: Any = self._tokens  # k == 0: every checkpoint
        for i in range(len(q) // b):
            key = self._chain_fn(h, q[i * b:(i + 1) * b].tobytes())
            nxt = self._holders.get(key)
            if not nxt:
                break
            h, k, candidates = key, i + 1, nxt
        start = k * b
        best: Match | None = None
        for ck in reversed(list(candidates)):  # newest first: it wins ties
            t = self._tokens.get(ck)
            if t is None:  # a holder an interrupted add or remove left: the walk may have
                return self._scan(q)  # gone deeper than any indexed checkpoint, so scan
            if not np.array_equal(t[:start], q[:start]):  # a hash collision: never trusted
                return self._scan(q)
            n = start + _common(t[start:start + b], q[start:start + b])
            if n > 0 and (best is None or n > best.tokens):
                best = Match(ck, n)
        return best

    def _scan(self, q: np.ndarray) -> Match | None:
        """Every checkpoint compared token by token (the answer when hashes disagree)."""
        best: Match | None = None
        for ck in reversed(list(self._tokens)):
            n = _common(self._tokens[ck], q)
            if n > 0 and (best is None or n > best.tokens):
                best = Match(ck, n)
        return best

    @classmethod
    def from_store(cls, store: KVStore, key: str = "tokens", block: int | None = None, *,
                   like: PrefixIndex | None = None) -> PrefixIndex:
        """Rebuild from a store's checkpoints and the token ids each carries in its metadata
        under ``key`` (``store.set_metadata(ck, {"tokens": ids, ...})``) — after a restart.
        Tokens beyond a checkpoint's committed frontier (the lowest of its pools') are not
        indexed (they have no KV there); checkpoints without tokens are skipped. The keys
        are hashed as ``like`` hashes them (its block size, chain hash and seed: pass the
        index being replaced, e.g. ``PrefixIndex.vllm()``, so rebuilt keys still match a
        router's); without it, the default BLAKE2b chain in blocks of ``block`` (64). A
        checkpoint whose tokens are not a 1-D list of int32 ids is skipped and logged (one bad
        entry does not cost the whole cache)."""
        state = getattr(store, "state", None)
        if state is None or not hasattr(state, "bundles"):
            raise InvalidArgument(f"from_store: {store!r} is not a KVStore")
        return cls.from_state(state, key, block, like=like)

    @classmethod
    def from_state(cls, state: StoreState, key: str = "tokens", block: int | None = None, *,
                   like: PrefixIndex | None = None) -> PrefixIndex:
        """``from_store`` over a bare store state — ``replay(journal).state``: the index is
        derived state, so a replayed journal rebuilds the live one."""
        if like is not None and not isinstance(like, PrefixIndex):
            raise InvalidArgument(f"from_state: like={like!r} must be a PrefixIndex")
        if not hasattr(state, "bundles") or not hasattr(state, "pools"):
            raise InvalidArgument(f"from_state: {state!r} is not a store state")
        if like is None:
            idx = cls(64 if block is None else block)
        elif block is not None and as_int("block", block) != like.block:
            raise InvalidArgument(f"from_state: block={block} differs from like.block="
                                  f"{like.block}; the keys are hashed as like hashes them")
        else:
            idx = cls(like.block, like._chain_fn, like._seed)
        for ck in sorted(b for b, x in state.bundles.items() if not x.active):
            bundle = state.bundles[ck]
            try:
                meta = decode_metadata(ck, bundle.meta)
            except StateError as exc:  # one undecodable value does not hide the others
                log.warning("prefix_index.skipped", checkpoint=ck, reason=str(exc))
                continue
            if isinstance(meta, dict) and key in meta:
                # every pool must hold the tokens a match continues (they may commit
                # different frontiers, §6.2: an MTP pool lagging the main one)
                frontier = min(state.pools[p].spaces[ck].committed for p in bundle.pools)
                try:
                    tokens = _as_tokens(meta[key], f"checkpoint {ck} metadata {key!r}")
                except InvalidArgument as exc:
                    log.warning("prefix_index.skipped", checkpoint=ck, reason=str(exc))
                    continue
                idx.add(ck, tokens[:frontier])
        return idx
