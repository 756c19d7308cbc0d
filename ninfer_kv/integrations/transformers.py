"""transformers drop-in: a ``Cache`` backed by a ``KVStore`` and an attention backend over it.

    from ninfer_kv.integrations.transformers import NinferKVCache, register, store_config_for
    register()                                          # attn_implementation "ninfer_kv"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ninfer_kv")
    store = KVStore.open(store_config_for(cfg, max_context=4096, max_concurrency=8))
    cache = NinferKVCache(store, max_new_tokens=64)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)
    checkpoints = cache.finish(retain=True)             # one retained checkpoint per row

How it maps onto the store. One ``generate`` row is one sequence (``activate``, or
``activate_from`` a retained checkpoint with ``prefix=(checkpoint, frontier)``). One model
forward is one GPU unit (§8.4): at layer 0's attention the cache maps the row's new tokens
(``ensure_mapped_many``) and closes the boundary; every layer appends its K/V with
``append_kv`` and attends with ``paged_prefill_varlen`` / ``paged_decode``; after the last
layer the unit completes and ``commit_many`` advances the frontiers.

Padding. A token is stored iff its ``attention_mask`` bit is 1, at the position equal to the
number of real tokens of its row before it — exactly the ``position_ids`` that ``generate``
derives from the mask (cumsum - 1), so left-padded batches need nothing else. transformers'
own bookkeeping (``get_seq_length``, mask sizes) counts padded columns, like ``DynamicCache``;
the store's frontiers count real tokens only.

The attention function finds its cache through a context variable that ``Cache.update`` sets
(models call ``cache.update`` for a layer right before that layer's attention), and checks
that the layer and the batch match. What it does not serve (windows and chunks, hybrid and
MLA models, autograd, ...) is refused before a row is admitted (integrations/hf_served.py);
beam search and ``crop`` when transformers asks for them, after the first forward.
Tested with transformers 5.x (``pip install ninfer-kv[hf]``).
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

import structlog
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    EntitlementExceeded,
    InvalidArgument,
    KVStoreError,
    UnsupportedOperation,
)
from ninfer_kv.integrations.hf_served import store_config_for
from ninfer_kv.integrations.hf_unit import Unit as _Unit
from ninfer_kv.integrations.hf_unit import checked_unit

__all__ = ["ATTN_IMPLEMENTATION", "NinferKVCache", "ninfer_kv_attention", "register",
           "store_config_for"]

log = structlog.get_logger(__name__)

ATTN_IMPLEMENTATION = "ninfer_kv"
_CURRENT: contextvars.ContextVar[NinferKVCache | None] = contextvars.ContextVar(
    "ninfer_kv_cache", default=None)
_OPEN: weakref.WeakKeyDictionary[KVStore, tuple[weakref.ref[NinferKVCache], list[int]]] = \
    weakref.WeakKeyDictionary()
"""Per store, the unit a cache opened (layer 0) and has not completed: that cache, its rows."""


def _reclaim_orphaned_unit(store: KVStore) -> None:
    """A forward that failed mid-way leaves its unit open (the store answers ``FrozenUnit``)
    until its cache's ``abort()``; a caller that dropped the cache instead froze the store
    for good. The next forward of another cache completes such a unit as ``abort()`` does
    (no commit, §8.4); the dropped cache's rows stay active (``store.finish`` them)."""
    held = _OPEN.get(store)
    if held is None or held[0]() is not None:
        return  # none open, or its cache lives: its abort() is its owner's to call
    del _OPEN[store]
    store.unit_complete()
    log.warning("hf_orphaned_unit_completed", rows_left_active=held[1])


def _closed(cache: NinferKVCache) -> None:
    held = _OPEN.get(cache.store)
    if held is not None and held[0]() is cache:
        del _OPEN[cache.store]


def register() -> None:
    """Register ``attn_implementation="ninfer_kv"``: our attention function, and the 2D
    padding mask (FlashAttention's mask function) instead of a 4D additive mask."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ninfer_kv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


class _Columns(CacheLayerMixin):
    """transformers' view of one layer: how many columns (padding included) were seen. The
    K/V themselves live in the store's pages."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, seen: int = 0) -> None:
        super().__init__()
        self.seen = seen
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise UnsupportedOperation("NinferKVCache.reset: finish() the sequences and make a new "
                                   "cache instead")


class NinferKVCache(Cache):
    """A transformers ``Cache`` whose K/V live in ``store`` (pool ``pool``), one active
    sequence per batch row, created at the first forward.

    ``max_new_tokens`` is each row's output budget (its entitlement, §6: prompt + output
    tokens); default: up to ``max_context``. ``prefix=(checkpoint, frontier)`` continues every
    row from a retained checkpoint's first ``frontier`` tokens (Fork or Move, §10): the
    ``input_ids`` given to ``generate`` must start with those tokens and be longer than
    ``frontier``, and only the rest is computed. (Given no more than ``frontier`` ids,
    transformers feeds them again as new tokens, as it does with a ``DynamicCache``; a forward
    with a 2-D attention mask narrower than the cache is refused, but ``generate`` hands an
    all-ones mask over as None, so there the cache cannot tell it from a continuation.)
    ``pool`` is the store's pool the model's layers live in (its layer count must be the
    model's). ``finish()`` empties the cache: the next ``generate`` admits new rows."""

    def __init__(self, store: KVStore, *, max_new_tokens: int | None = None,
                 prefix: tuple[int, int] | None = None, pool: str = "main") -> None:
        if type(pool) is not str or pool not in store.pools:
            raise InvalidArgument(f"NinferKVCache: pool={pool!r} is not one of the store's "
                                  f"{store.pools}")
        seen = 0
        if prefix is not None:
            if not isinstance(prefix, tuple) or len(prefix) != 2:
                raise InvalidArgument(f"NinferKVCache: prefix={prefix!r} must be a "
                                      "(checkpoint, frontier) pair")
            ck, frontier = as_int("prefix checkpoint", prefix[0]), as_int("prefix frontier",
                                                                          prefix[1])
            store.checkpoint_info(ck, metadata=False)  # a checkpoint, else a typed refusal
            have = store.space(ck, pool).committed  # this pool's frontier (§8.1)
            if not 0 < frontier <= have:
                raise InvalidArgument(f"NinferKVCache: prefix frontier {frontier} outside "
                                      f"checkpoint {ck}'s (0, {have}] in pool {pool}")
            prefix, seen = (ck, frontier), frontier
        self.store = store
        self.pool = pool
        self.prefix = prefix
        self.max_new_tokens = (None if max_new_tokens is None else
                               as_int("max_new_tokens", max_new_tokens, lo=0))
        self.seqs: list[int] = []
        self._budget: list[int] = []   # per row: most tokens it may hold (prompt + output)
        self._unit: _Unit | None = None
        # (unit, column count before it) from _end's first line until the next forward
        # begins (its layer 0 update): the unit's commit happens at the last attention layer,
        # before the model's last projections and head, so abort undoes it until then
        self._ending: tuple[_Unit, int] | None = None
        self._layer = -1
        self._key: torch.Tensor | None = None
        self._seen_before = seen
        self._start = seen             # the columns a new admission starts after
        layers = store.device.pools[pool].geometry.layers  # the pool's, not the main model's
        super().__init__(layers=[_Columns(seen) for _ in range(layers)])

    # --- transformers' Cache API ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0 and self._unit is None:
            self._ending = None       # a new forward: the last one ran to its end
        if self._key is not None:  # the last update's K/V never reached our attention
            layer, self._key = self._layer, None
            raise InvalidArgument(
                f"NinferKVCache: layer {layer}'s K/V never reached the ninfer_kv attention: the "
                "model attends with another implementation, which would read only the new "
                "tokens (set attn_implementation='ninfer_kv' after register()); after a failed "
                "forward call cache.abort()")
        self._layer = layer_idx
        self._key = key_states        # the attention call must receive exactly this tensor
        _CURRENT.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    _HELD = " (this cache's rows stay active until cache.finish())"

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedOperation("NinferKVCache: beam search reorders rows; fork sequences "
                                   "with store.activate_from instead" + self._HELD)

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedOperation("NinferKVCache.crop: use store.truncate on the sequences"
                                   + self._HELD)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedOperation("NinferKVCache: num_return_sequences > 1 / beams need one "
                                   "sequence per row; give generate the repeated batch"
                                   + self._HELD)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedOperation("NinferKVCache: selecting rows would drop sequences"
                                   + self._HELD)

    def __deepcopy__(self, memo: dict[int, Any]) -> NinferKVCache:
        raise UnsupportedOperation("NinferKVCache cannot be copied: its rows are sequences of "
                                   "one store (a copy would clone the store); reuse a prompt "
                                   "with finish(retain=True) and NinferKVCache(store, "
                                   "prefix=(checkpoint, frontier))")

    __copy__ = __reduce__ = lambda self: self.__deepcopy__({})  # noqa: E731

    # --- the store's side -------------------------------------------------------------------------
    def finish(self, retain: bool = False) -> list[int | None]:
        """Finish every row's sequence (§10); with ``retain`` each becomes an immutable
        checkpoint, returned in row order, that ``prefix=`` can continue later."""
        self._ending = None  # the last forward's commit stays (abort would undo it)
        self.abort()
        out = [self.store.finish(s, retain=retain) for s in self.seqs]
        self.seqs = []
        for layer in self.layers:  # empty again: the next forward admits new rows from the
            layer.seen = self._start  # prefix (transformers must not skip the old columns)
        self._seen_before = self._start
        return out

    def abort(self) -> None:
        """After a forward raised (an exception in the model, an interrupt) — anywhere, also
        after its last attention layer (its output projection, the head): undo it. Its unit
        completes without commit (the store unfreezes; columns written above the frontiers
        are not committed, §8.4); if the last attention layer had committed the forward's
        tokens already, they are truncated back (§8.2). Transformers' column counts then
        agree with the store: ``get_seq_length()`` says where the next forward continues,
        and the failed step is fed again. Call it only after a failure: after a forward that
        returned, it undoes that forward too (until the next one begins)."""
        ending, self._ending = self._ending, None
        self._key = None
        if self._unit is not None or ending is not None:
            self._unit = None
            self.store.unit_complete()  # idempotent: _end may have run it already
            _closed(self)
        if ending is not None:
            unit, before = ending
            try:
                committed = self.store.failed is None and bool(unit.real.any()) and \
                    self.frontiers() == unit.end.tolist()
            except KVStoreError:  # its rows were finished through the store meanwhile
                committed = False
            self._seen_before = before if not committed or self._uncommit(unit) \
                else self.layers[0].seen
        for layer in self.layers:
            layer.seen = self._seen_before

    def _uncommit(self, unit: _Unit) -> bool:
        """Truncate each row back to where ``unit`` started; False (the commit kept, every
        row) when the store would refuse one (a retained or shared prefix protects it now)."""
        rows = [(s, a) for s, a, b in zip(self.seqs, unit.start.tolist(), unit.end.tolist(),
                                          strict=True) if b > a]
        try:  # every row or none: a refusal changed nothing
            self.store.truncate_many(self.pool, [s for s, _ in rows], [a for _, a in rows])
        except KVStoreError as exc:
            if self.store.failed is not None:
                raise
            log.warning("hf_abort_kept_commit", reason=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def frontiers(self) -> list[int]:
        """Committed tokens of each row's sequence (real tokens; padding excluded)."""
        return [self.store.space(s, self.pool).committed for s in self.seqs]

    def _admit(self, new: torch.Tensor) -> None:
        limit = self.store.config.serving.max_context
        self._budget = []
        for n in new.tolist():
            prompt = n + (self.prefix[1] if self.prefix else 0)
            if prompt > limit:
                raise InvalidArgument(f"NinferKVCache: a row's prompt of {prompt} tokens is "
                                      f"longer than the store's max_context={limit}")
            out = limit - prompt if self.max_new_tokens is None else self.max_new_tokens
            self._budget.append(prompt + out)
            if self.prefix is None:
                self.seqs.append(self.store.activate(prompt, out))
            else:
                self.seqs.append(self.store.activate_from(self.prefix[0], self.prefix[1],
                                                          prompt, out))
        log.debug("hf_admit", rows=len(self.seqs), prefix=self.prefix)

    def _begin(self, query: torch.Tensor, mask: torch.Tensor | None) -> _Unit:
        """Layer 0: which columns are real, map them, close the boundary."""
        _reclaim_orphaned_unit(self.store)
        b, _, t, _ = query.shape
        real = torch.ones(b, t, dtype=torch.bool) if mask is None else mask[:, -t:].cpu().bool()
        new = real.sum(1)
        self._seen_before = self.layers[0].seen - t
        if mask is not None and self.prefix is not None and not self.seqs and \
                not bool(mask[:, :-t].all()):
            self.abort()
            raise InvalidArgument("NinferKVCache: the reused prefix columns must not be padding")
        if mask is not None and mask.shape[1] != self.layers[0].seen:
            self.abort()
            raise InvalidArgument(f"NinferKVCache: attention mask covers {mask.shape[1]} columns,"
                                  f" the cache {self._seen_before} + {t} new (with prefix=, give "
                                  "input_ids longer than the reused frontier)")
        try:
            if not self.seqs:
                self._admit(new)
        except BaseException:
            if self.store.failed is None:  # a failed store refuses: its reopen drops them
                for seq in self.seqs:      # all rows or none: no half-admitted batch
                    self.store.finish(seq)
            self.seqs = []
            self.abort()
            raise
        if len(self.seqs) != b:
            self.abort()
            raise InvalidArgument(f"NinferKVCache: batch of {b} rows, cache holds "
                                  f"{len(self.seqs)} sequences")
        start = torch.tensor(self.frontiers(), dtype=torch.int64)
        end = start + new
        over = [i for i, (e, cap) in enumerate(zip(end.tolist(), self._budget, strict=True)) if e > cap]
        if over:
            i = over[0]
            self.abort()
            raise EntitlementExceeded(
                f"NinferKVCache: row {i} would hold {int(end[i])} tokens, its budget is "
                f"{self._budget[i]} (first forward's tokens + max_new_tokens={self.max_new_tokens};"
                " for chunked prefill leave max_new_tokens=None: up to max_context)")
        try:
            self.store.ensure_mapped_many(self.pool, self.seqs, end.tolist())
        except BaseException:
            self.abort()
            raise
        self.store.close_boundary()
        try:
            unit = _Unit.plan(self.store, self.pool, self.seqs, real, start, end)
        except BaseException:
            self.store.unit_complete()
            self.abort()
            raise
        self._unit = unit
        _OPEN[self.store] = (weakref.ref(self), list(self.seqs))
        return unit

    def _end(self, unit: _Unit) -> None:
        self._ending = (unit, self._seen_before)  # first: from here on abort asks the store
        self._unit = None
        self.store.unit_complete()
        _closed(self)
        self.store.commit_many(self.pool, self.seqs, unit.end.tolist())
        self._seen_before = self.layers[0].seen


def ninfer_kv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention backend: ``query`` [B, Hq, T, D], ``key``/``value`` [B, Hkv, T, D]
    (this forward's new columns, as ``NinferKVCache.update`` returned them), ``attention_mask``
    the 2D padding mask or None. Returns [B, T, Hq, D]."""
    cache = _CURRENT.get()
    layer = getattr(module, "layer_idx", None)
    if cache is None or layer != cache._layer or key is not cache._key:
        pending = cache is not None and cache._key is not None  # this forward updated it
        if pending:  # a refusal leaves its column counts as before this forward (a stale
            cache.abort()  # cache, last used by an earlier forward, is left alone)
        if pending and layer == cache._layer:
            raise UnsupportedOperation(
                f"ninfer_kv attention (layer {layer}): the key is not the one the model gave "
                "NinferKVCache.update: a model that changes K/V after the cache (e.g. "
                "multi-head latent attention) is not served")
        raise InvalidArgument(f"ninfer_kv attention (layer {layer}): no NinferKVCache updated "
                              "this layer in this forward; pass cache=NinferKVCache(store) to the "
                              "model")
    cache._key = None                 # one attention call per update
    try:  # a refusal rolls the cache back: update() counted this forward's columns already
        unit = checked_unit(cache, module, layer, query, key, value, attention_mask, dropout,
                            kwargs)
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        out = unit.attend(cache.store, cache.pool, layer, query, key, value, scale)
    except BaseException:
        cache.abort()
        raise
    if layer == len(cache.layers) - 1:
        cache._end(unit)
    return out, None
