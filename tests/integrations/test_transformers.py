"""transformers drop-in: ``generate`` through ``NinferKVCache`` gives the tokens of a
``DynamicCache`` whose K/V are rounded by the same codec (tests/kernels/reference.py, the
independent numpy codecs), for every profile; padding, prefix continuation, refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # the [hf] extra
from transformers.cache_utils import DynamicLayer

from ninfer_kv import KVStore
from ninfer_kv.engine.layout import Profile
from ninfer_kv.errors import (
    CapacityExhausted,
    EntitlementExceeded,
    InvalidArgument,
    UnsupportedOperation,
)
from ninfer_kv.integrations.transformers import NinferKVCache, register, store_config_for
from tests.interrupts import Injector, lines_to_try
from tests.kernels import reference as ref

LAYERS, D = 2, 64
NEW = 10


def _rounded(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Each [D] row of ``x`` [B, H, T, D] through encode/decode of ``codec``."""
    rows = x.detach().float().reshape(-1, x.shape[-1]).numpy()
    out = np.stack([ref.decode_row(codec, *ref.encode_row(codec, r)) for r in rows])
    return torch.from_numpy(out).reshape(x.shape).to(x.dtype)


class RoundedLayer(DynamicLayer):
    """A DynamicLayer that keeps K/V as the profile's codecs would store them."""

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.k_codec, self.v_codec = (c.value for c in profile.codecs)

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return super().update(_rounded(key_states, self.k_codec),
                              _rounded(value_states, self.v_codec), *args, **kwargs)


def reference_cache(profile: Profile) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [RoundedLayer(profile) for _ in range(LAYERS)]
    cache.layer_class_to_replicate = None
    return cache


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM, LlamaConfig]:
    register()
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=D, max_position_embeddings=512, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    base = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    ours = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    ours.load_state_dict(base.state_dict())
    ours.set_attn_implementation("ninfer_kv")
    return base, ours, cfg


def batch(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, t - n:] = torch.randint(1, 96, (n,), generator=g)
        mask[i, t - n:] = 1
    return ids, mask


def generate(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW,
                             do_sample=False)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("profile", list(Profile), ids=[p.value for p in Profile])
def test_generate_equals_rounded_dynamic_cache(models, profile: Profile) -> None:  # noqa: ANN001
    base, ours, cfg = models
    ids, mask = batch(1, [37, 70, 5])              # different lengths, left padding
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4,
                                          profile=profile.value, checked=True))
    cache = NinferKVCache(store, max_new_tokens=NEW)
    got = generate(ours, ids, mask, cache)
    want = generate(base, ids, mask, reference_cache(profile))
    assert torch.equal(got, want), (got, want)
    # real tokens only: prompt + the NEW - 1 generated tokens fed back
    assert cache.frontiers() == [37 + NEW - 1, 70 + NEW - 1, 5 + NEW - 1]
    store.check_invariants()
    store.close()


def test_unrounded_reference_differs_for_a_lossy_profile(models) -> None:  # noqa: ANN001
    """The comparison can fail: NVFP4-rounded K/V change the logits the model sees."""
    base, ours, cfg = models
    ids, mask = batch(2, [40, 40])
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2,
                                          profile="nvfp4-g16"))
    with torch.no_grad():
        cache = NinferKVCache(store, max_new_tokens=1)
        a = ours(ids, attention_mask=mask, cache=cache).logits[:, -1]
        b = base(ids, attention_mask=mask).logits[:, -1]
    assert (a - b).abs().max() > 1e-3


def test_continuation_from_a_retained_checkpoint_mid_page(models) -> None:  # noqa: ANN001
    base, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))
    ids, mask = batch(3, [100])
    first = NinferKVCache(store, max_new_tokens=NEW)
    generate(ours, ids, mask, first)
    (ck,) = first.finish(retain=True)
    assert store.checkpoint_info(ck).frontier == 100 + NEW - 1
    f = 70                                          # page 1, column 6: a partial tail (Fork)
    tail = torch.randint(1, 96, (2, 25), generator=torch.Generator().manual_seed(4))
    ids2 = torch.cat([ids[:, :f].expand(2, f), tail], 1)    # two rows share the prefix
    mask2 = torch.ones_like(ids2)
    before = store.metrics()
    cache = NinferKVCache(store, max_new_tokens=NEW, prefix=(ck, f))
    got = generate(ours, ids2, mask2, cache)
    want = generate(base, ids2, mask2, reference_cache(Profile.BF16))
    assert torch.equal(got, want), (got, want)
    assert [store.checkpoint_info(s).parent for s in cache.seqs] == [ck, ck]
    assert store.metrics().cow_copies > before.cow_copies      # the partial tail was copied
    assert cache.frontiers() == [f + 25 + NEW - 1] * 2
    cache.finish()
    store.check_invariants()


def test_refusals_leave_the_store_unchanged(models) -> None:  # noqa: ANN001
    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    ids, mask = batch(5, [20])
    first = NinferKVCache(store, max_new_tokens=NEW)
    generate(ours, ids, mask, first)
    (ck,) = first.finish(retain=True)
    digest = store.digest()
    with pytest.raises(InvalidArgument, match="frontier 500"):
        NinferKVCache(store, prefix=(ck, 500))
    with pytest.raises(InvalidArgument, match="no NinferKVCache"):
        with torch.no_grad():
            ours(ids, attention_mask=mask)          # ninfer_kv attention without our cache
    with pytest.raises(UnsupportedOperation, match="beam"):
        NinferKVCache(store).reorder_cache(torch.tensor([0]))
    new = torch.randint(1, 96, (2, 10))
    pmask = torch.ones(2, 5 + 10, dtype=torch.long)
    pmask[1, :2] = 0                                # padding inside the reused prefix
    with pytest.raises(InvalidArgument, match="prefix columns must not be padding"):
        with torch.no_grad():
            ours(new, attention_mask=pmask,
                 cache=NinferKVCache(store, max_new_tokens=2, prefix=(ck, 5)))
    assert store.digest() == digest


def test_a_forward_without_the_cache_never_attaches_to_an_old_one(models) -> None:  # noqa: ANN001
    """Regression: the attention found the last-used cache through a stale context variable
    and admitted new sequences into its store (leaked rows and pages)."""
    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    ids, mask = batch(7, [9])
    cache = NinferKVCache(store, max_new_tokens=NEW)
    generate(ours, ids, mask, cache)
    cache.finish()
    before = (store.digest(), store.occupancy())
    with pytest.raises(InvalidArgument, match="no NinferKVCache"):
        with torch.no_grad():
            ours(ids, attention_mask=mask)
    assert (store.digest(), store.occupancy()) == before


def test_a_failed_forward_is_aborted_and_the_store_serves_on(models) -> None:  # noqa: ANN001
    """Regression: an exception between layer 0 and the last layer left the store frozen."""
    base, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))
    ids, mask = batch(8, [12, 7])
    cache = NinferKVCache(store, max_new_tokens=NEW)

    def boom(*_: object) -> None:
        raise RuntimeError("simulated failure in layer 0's MLP")

    hook = ours.model.layers[0].mlp.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="simulated"), torch.no_grad():
            ours(ids, attention_mask=mask, cache=cache)
    finally:
        hook.remove()
    cache.abort()                                   # the documented way out
    assert cache.get_seq_length() == 0 and cache.frontiers() == [0, 0]
    other = NinferKVCache(store, max_new_tokens=NEW)  # the store is not frozen
    assert torch.equal(generate(ours, ids, mask, other),
                       generate(base, ids, mask, reference_cache(Profile.BF16)))
    cache.finish()
    other.finish()
    store.check_invariants()


def test_admission_is_all_rows_or_none(models) -> None:  # noqa: ANN001
    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    ids, mask = batch(9, [5, 6, 7])                 # 3 rows, 2 execution rows
    cache = NinferKVCache(store, max_new_tokens=2)
    before = (store.digest(), store.occupancy())
    with pytest.raises(CapacityExhausted), torch.no_grad():
        ours(ids, attention_mask=mask, cache=cache)
    assert cache.seqs == [] and cache.get_seq_length() == 0
    assert store.occupancy() == before[1]


def test_the_output_budget_is_exact_not_page_granular(models) -> None:  # noqa: ANN001
    """Regression: generating past max_new_tokens was accepted until the page ran out, and
    a refusal left transformers' column count ahead of the store's frontier."""
    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    ids, mask = batch(10, [9])
    cache = NinferKVCache(store, max_new_tokens=3)
    with pytest.raises(EntitlementExceeded, match="budget is 12"), torch.no_grad():
        ours.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False)
    assert cache.frontiers() == [12] and cache.get_seq_length() == 12
    cache.finish()
    store.check_invariants()


def test_softcap_and_sinks_are_refused(models) -> None:  # noqa: ANN001
    from ninfer_kv.integrations.transformers import ninfer_kv_attention

    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    cache = NinferKVCache(store, max_new_tokens=2)
    module = ours.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, D), torch.randn(1, 2, 3, D)
    for kw in ({"softcap": 30.0}, {"s_aux": torch.zeros(4)}):
        k2, v2 = cache.update(k, k, 0)
        with pytest.raises(UnsupportedOperation, match=next(iter(kw))):
            ninfer_kv_attention(module, q, k2, v2, None, **kw)
    assert store.active() == []


def test_every_unsupported_use_is_a_typed_refusal(models) -> None:  # noqa: ANN001
    from ninfer_kv.integrations.transformers import ninfer_kv_attention

    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))
    cache = NinferKVCache(store, max_new_tokens=4)
    for call in (lambda: cache.crop(1), lambda: cache.batch_repeat_interleave(2),
                 lambda: cache.batch_select_indices(torch.tensor([0])), cache.layers[0].reset):
        with pytest.raises(UnsupportedOperation):
            call()
    attn = [layer.self_attn for layer in ours.model.layers]
    q, k = torch.randn(2, 4, 3, D), torch.randn(2, 2, 3, D)
    cache.update(k, k, 0)
    with pytest.raises(UnsupportedOperation, match="dropout"):
        ninfer_kv_attention(attn[0], q, cache._key, k, None, dropout=0.1)
    cache.abort()
    cache.update(k, k, 1)
    with pytest.raises(InvalidArgument, match="layer 1 before layer 0"):
        ninfer_kv_attention(attn[1], q, cache._key, k, None)
    cache.abort()
    digest = store.digest()
    cache.update(k, k, 0)
    ninfer_kv_attention(attn[0], q, cache._key, k, None)        # layer 0 of a 2-row forward
    cache.update(k, k, 0)
    with pytest.raises(InvalidArgument, match="layer 0 again"):
        ninfer_kv_attention(attn[0], q, cache._key, k, None)
    cache.abort()
    assert cache.get_seq_length() == 0 and len(cache.seqs) == 2
    k3, q3 = torch.randn(3, 2, 1, D), torch.randn(3, 4, 1, D)
    cache.update(k3, k3, 0)
    with pytest.raises(InvalidArgument, match="batch of 3 rows, cache holds 2"):
        ninfer_kv_attention(attn[0], q3, cache._key, k3, None)
    cache.finish()
    assert store.active() == [] and store.digest() != digest  # admitted, then finished
    store.check_invariants()


def test_a_mask_short_of_the_reused_prefix_and_sliding_windows_are_refused(models) -> None:  # noqa: ANN001
    """With prefix=, generate given input_ids no longer than the frontier re-fed the prefix
    (transformers slices nothing then) and stored it twice; a sliding window would be ignored."""
    from ninfer_kv.integrations.transformers import ninfer_kv_attention

    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    ids, mask = batch(11, [30])
    first = NinferKVCache(store, max_new_tokens=NEW)
    generate(ours, ids, mask, first)
    (ck,) = first.finish(retain=True)
    digest = store.digest()
    cache = NinferKVCache(store, max_new_tokens=NEW, prefix=(ck, 20))
    with pytest.raises(InvalidArgument, match="attention mask covers 20 columns"), \
            torch.no_grad():
        ours(ids[:, :20], attention_mask=mask[:, :20], cache=cache)   # the prefix re-fed
    assert store.digest() == digest and cache.get_seq_length() == 20
    k, q = torch.randn(1, 2, 3, D), torch.randn(1, 4, 3, D)
    cache.update(k, k, 0)
    with pytest.raises(UnsupportedOperation, match="sliding_window=4 < max_context=256"):
        ninfer_kv_attention(ours.model.layers[0].self_attn, q, cache._key, k, None,
                            sliding_window=4)
    assert store.digest() == digest


def test_a_cache_over_another_pool_reads_that_pools_frontiers(models) -> None:  # noqa: ANN001
    """Review finding: ``frontiers()`` read the main pool's committed frontier, so a cache
    over pool "mtp" restarted every forward at position 0 of its pool (overwriting committed
    K/V) and the commit was refused. Each forward now continues the pool's own frontier."""
    from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig
    from ninfer_kv.engine.config import StoreConfig

    base, ours, _ = models
    geo = ModelGeometry(layers=LAYERS, kv_heads=2, head_dim=D, profile="bf16", mtp_layers=LAYERS)
    store = KVStore.open(StoreConfig(model=geo, serving=ServingConfig(
        max_context=256, max_concurrency=2, backend=Backend.MTP), kv_tokens=512))
    ids, mask = batch(5, [12])
    cache = NinferKVCache(store, max_new_tokens=NEW, pool="mtp")
    got = generate(ours, ids, mask, cache)
    assert torch.equal(got, generate(base, ids, mask, reference_cache(Profile.BF16)))
    assert cache.frontiers() == [12 + NEW - 1] == [store.space(s, "mtp").committed
                                                   for s in cache.seqs]
    with pytest.raises(InvalidArgument, match="pool='nope'"):
        NinferKVCache(store, pool="nope")
    cache.finish()
    store.check_invariants()


def test_a_cache_used_again_after_finish_starts_empty(models) -> None:  # noqa: ANN001
    """Review finding: after ``finish()`` transformers still saw the old columns as cached,
    so the next generate skipped that many columns of the new prompt (wrong tokens, no
    error). A finished cache is empty again: the next generate admits new rows."""
    base, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))
    cache = NinferKVCache(store, max_new_tokens=NEW)
    ids, mask = batch(12, [20])
    generate(ours, ids, mask, cache)
    cache.finish()
    assert cache.get_seq_length() == 0 and cache.seqs == []
    ids2, mask2 = batch(13, [40])
    got = generate(ours, ids2, mask2, cache)
    assert torch.equal(got, generate(base, ids2, mask2, reference_cache(Profile.BF16)))
    assert cache.frontiers() == [40 + NEW - 1]
    cache.finish()
    store.check_invariants()


def test_a_model_with_other_layers_than_the_pool_is_refused_unfrozen(models) -> None:  # noqa: ANN001
    """Review finding: a 1-layer model on a 2-layer store 'succeeded' and left the store
    frozen (the unit completes after the pool's last layer, which never ran)."""
    _, _, cfg = models
    cfg1 = copy.deepcopy(cfg)
    cfg1.num_hidden_layers = 1
    one = LlamaForCausalLM(cfg1).eval()
    one.set_attn_implementation("ninfer_kv")
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    digest = store.digest()
    cache = NinferKVCache(store, max_new_tokens=4)
    ids, mask = batch(14, [10])
    with pytest.raises(InvalidArgument, match="the model has 1 layers, pool main of the store 2"), \
            torch.no_grad():
        one(ids, attention_mask=mask, cache=cache)
    assert store.digest() == digest and cache.seqs == []
    store.finish(store.activate(10, 10))  # not frozen


@pytest.mark.parametrize("kw", [
    {"prefix": ("ck", 5.0)}, {"prefix": ("ck",)}, {"prefix": (None, 3)}, {"prefix": ("ck", True)},
    {"prefix": "ck"}, {"max_new_tokens": 2.5}, {"max_new_tokens": True},
    {"max_new_tokens": -1}, {"pool": 3},
], ids=str)
def test_bad_cache_arguments_are_typed_refusals(models, kw: dict) -> None:  # noqa: ANN001
    """Review finding: a bare ``operator.index`` let bools through and raised TypeError /
    ValueError for the rest; every argument now goes through ``as_int``."""
    _, ours, cfg = models
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    first = NinferKVCache(store, max_new_tokens=NEW)
    ids, mask = batch(15, [8])
    generate(ours, ids, mask, first)
    (ck,) = first.finish(retain=True)
    if "prefix" in kw:
        p = kw["prefix"]
        kw = {"prefix": ck if p == "ck" else tuple(ck if x == "ck" else x for x in p)}
    with pytest.raises(InvalidArgument):
        NinferKVCache(store, **kw)


def test_after_an_interrupted_forward_abort_agrees_with_the_store(models) -> None:  # noqa: ANN001
    """``KeyboardInterrupt`` at any line a decode forward runs in ninfer_kv code (every line
    from just before the commit on, a sample before): after ``abort()`` the cache's column
    count is the store's and the step is undone — also when the store had committed it (the
    commit happens at the last attention layer; the rest of the forward can still fail, a
    review found: its tokens are truncated back) — and continuing from
    ``get_seq_length()`` gives a clean run's next logits and frontiers, never writing a
    token's K/V twice. An interrupt at the forward's very first line cannot be told from one
    in the previous forward's tail, after its commit: that forward is undone too (fed again,
    same result)."""
    _, ours, cfg = models
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    nxt, nxt2 = torch.tensor([[7], [8]]), torch.tensor([[9], [10]])

    def prefilled() -> tuple[KVStore, NinferKVCache]:
        store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
        cache = NinferKVCache(store, max_new_tokens=10)
        ours(ids, cache=cache)
        return store, cache

    with torch.no_grad():
        store, cache = prefilled()
        dry = Injector(0, first="_end")
        assert dry.run(lambda: ours(nxt, cache=cache)) is None
        want = (ours(nxt2, cache=cache).logits[:, -1], cache.frontiers())
        store.close()
        seen = {"undone": 0, "the prefill too": 0, "store failed": 0}
        for at in lines_to_try(dry.lines, dry.first_emit, stride=41):
            store, cache = prefilled()
            err = Injector(at).run(lambda c=cache: ours(nxt, cache=c))
            assert isinstance(err, KeyboardInterrupt), (at, err)
            if store.failed is not None:  # inside a command or the boundary: stopped
                seen["store failed"] += 1
                store.close()
                continue
            cache.abort()
            n = cache.get_seq_length()
            assert [n, n] == cache.frontiers(), at  # no padding: columns = committed tokens
            assert n in (0, 20), at
            seen["undone" if n == 20 else "the prefill too"] += 1
            if n == 0:
                ours(ids, cache=cache)
            ours(nxt, cache=cache)
            logits = ours(nxt2, cache=cache).logits[:, -1]
            assert cache.frontiers() == want[1], at
            assert torch.equal(logits, want[0]), at
            store.check_invariants()
            store.close()
    assert seen["undone"] and seen["store failed"], seen
