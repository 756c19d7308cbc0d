"""Findings of an outside review of the transformers drop-in (2026-12-03), each a use that
was served as a different attention or refused too late, untyped, or under the wrong name:
Llama4's chunked attention ran as full attention; a cache under another attention
implementation attended to the new tokens only; a hybrid model crashed untyped and left the
store frozen; autograd ran without attention gradients; deepcopy cloned the store;
output_attentions came back empty. Each is now refused, typed, before any row is admitted."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import transformers as T

from ninfer_kv import KVStore
from ninfer_kv.errors import InvalidArgument, UnsupportedOperation
from ninfer_kv.integrations.transformers import NinferKVCache, register, store_config_for

IDS = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(1))
SMALL = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def llama(attn: str = "ninfer_kv", layers: int = 2) -> tuple[Any, Any]:  # noqa: ANN401
    register()
    cfg = T.LlamaConfig(intermediate_size=128, num_hidden_layers=layers, **SMALL)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model, cfg


def untouched(store: KVStore, digest: str) -> None:
    """Nothing admitted, the store not frozen: another request runs."""
    assert store.digest() == digest and store.active() == []
    store.finish(store.activate(5, 5))
    store.check_invariants()


def llama4(chunk: int) -> Any:  # noqa: ANN401
    register()
    cfg = T.Llama4TextConfig(intermediate_size=128, intermediate_size_mlp=128,
                             num_hidden_layers=2, attention_chunk_size=chunk,
                             num_local_experts=2, interleave_moe_layer_step=2,
                             max_position_embeddings=512, **{**SMALL, "hidden_size": 128})
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(cfg).eval()
    model.set_attn_implementation("ninfer_kv")
    return model


def test_chunked_attention_is_refused_and_a_chunk_as_long_as_the_context_served() -> None:
    """Llama4 with attention_chunk_size=8 gave logits 0.83 off eager, unrefused."""
    served = llama4(512)
    store = KVStore.open(store_config_for(served.config, max_context=256, max_concurrency=2))
    with torch.no_grad():
        served(IDS, cache=NinferKVCache(store, max_new_tokens=4))   # chunk >= max_context
    with pytest.raises(UnsupportedOperation, match="attention_chunk_size=8 < max_context=256"):
        store_config_for(llama4(8).config, max_context=256, max_concurrency=2)
    chunked = llama4(8)          # a store sized by hand: the forward refuses, at layer 0
    digest = store.digest()
    with pytest.raises(UnsupportedOperation, match="chunked_attention"), torch.no_grad():
        chunked(IDS, cache=NinferKVCache(store, max_new_tokens=4))
    assert store.digest() == digest and len(store.active()) == 1  # the first forward's row


def test_a_cache_under_another_attention_implementation_is_refused() -> None:
    """With sdpa the cache's update returned only the new K/V: decode attended to itself."""
    model, cfg = llama(attn="sdpa")
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    digest = store.digest()
    cache = NinferKVCache(store, max_new_tokens=4)
    with pytest.raises(InvalidArgument, match="layer 0's K/V never reached the ninfer_kv "
                                              "attention"), torch.no_grad():
        model.generate(IDS, cache=cache, max_new_tokens=4, do_sample=False)
    untouched(store, digest)
    cache.abort()                # the cache is usable again, under the right attention
    model.set_attn_implementation("ninfer_kv")
    with torch.no_grad():
        model.generate(IDS, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.frontiers() == [23]


def test_a_hybrid_model_is_refused_before_admission() -> None:
    """LFM2 (attention + convolution layers) crashed with transformers' ValueError after
    layer 0 admitted the row, leaving the store frozen for every other request."""
    register()
    cfg = T.Lfm2Config(intermediate_size=128, num_hidden_layers=2,
                       layer_types=["full_attention", "conv"], **{**SMALL, "hidden_size": 128})
    with pytest.raises(UnsupportedOperation, match="layer 1 is 'conv'"):
        store_config_for(cfg, max_context=256, max_concurrency=2)
    plain = T.LlamaConfig(intermediate_size=128, num_hidden_layers=2,
                          **{**SMALL, "hidden_size": 128})
    store = KVStore.open(store_config_for(plain, max_context=256, max_concurrency=2))
    model = T.Lfm2ForCausalLM(cfg).eval()
    model.set_attn_implementation("ninfer_kv")
    digest = store.digest()
    with pytest.raises(UnsupportedOperation, match="layer 1 is 'conv'"), torch.no_grad():
        model(IDS, cache=NinferKVCache(store, max_new_tokens=4))
    untouched(store, digest)


def test_autograd_output_attentions_and_long_prompts_are_refused_by_name() -> None:
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=64, max_concurrency=2))
    digest = store.digest()
    with pytest.raises(UnsupportedOperation, match="no backward"):
        model(IDS, labels=IDS, cache=NinferKVCache(store))   # grads would skip attention
    with pytest.raises(UnsupportedOperation, match="output_attentions"), torch.no_grad():
        model(IDS, cache=NinferKVCache(store), output_attentions=True)
    with pytest.raises(InvalidArgument, match="prompt of 70 tokens is longer than the "
                                              "store's max_context=64"), torch.no_grad():
        model(torch.ones(1, 70, dtype=torch.long), cache=NinferKVCache(store))
    untouched(store, digest)


def test_a_cache_is_not_copied() -> None:
    """deepcopy cloned the whole store (a second KV pool), under the same sequence ids."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=2))
    cache = NinferKVCache(store)
    with torch.no_grad():
        model(IDS, cache=cache)
    for how in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(UnsupportedOperation, match="cannot be copied"):
            how(cache)


def test_store_config_for_refuses_what_the_kernels_do_not_serve() -> None:
    """head_dim 16 was taken and refused only at the first forward, after admission; an MLA
    model got a head_dim that is not its key's."""
    for head_dim in (16, 288):
        with pytest.raises(UnsupportedOperation, match=f"head_dim={head_dim}"):
            store_config_for(T.LlamaConfig(**{**SMALL, "head_dim": head_dim}), max_context=64,
                             max_concurrency=1)
    mla = T.DeepseekV3Config(vocab_size=96, hidden_size=128, num_attention_heads=4,
                             kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
                             v_head_dim=32, num_hidden_layers=2)
    with pytest.raises(UnsupportedOperation, match="latent attention"):
        store_config_for(mla, max_context=64, max_concurrency=1)
    assert store_config_for(T.LlamaConfig(**SMALL), max_context=64,
                            max_concurrency=1).model.head_dim == 32
    mistral = T.MistralConfig(**SMALL, sliding_window=128)       # a later audit: taken here
    with pytest.raises(UnsupportedOperation, match="sliding_window=128 < max_context=512"):
        store_config_for(mistral, max_context=512, max_concurrency=1)
    assert store_config_for(mistral, max_context=128, max_concurrency=1).serving.max_context \
        == 128                                                    # a window as long: served


def test_a_key_changed_after_the_cache_is_named_and_abort_forgets_an_unused_update() -> None:
    """An MLA model's attention gets a key the cache never saw: it was refused as "no
    NinferKVCache updated this layer"; and a refusal before the key was taken must not
    leave it behind for the next forward's update."""
    from ninfer_kv.integrations.transformers import ninfer_kv_attention

    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=64, max_concurrency=2))
    attn = [layer.self_attn for layer in model.model.layers]
    cache = NinferKVCache(store)
    q, k = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    cache.update(k, k, 0)
    with pytest.raises(UnsupportedOperation, match="latent attention"):
        ninfer_kv_attention(attn[0], q, k.clone(), k, None)
    cache.update(k, k, 0)
    with pytest.raises(InvalidArgument, match="no NinferKVCache updated this layer"):
        ninfer_kv_attention(attn[1], q, k, k, None)   # layer 1's module: refused, key kept
    cache.abort()
    cache.update(k, k, 0)                             # no "never reached" refusal
    assert store.active() == []


def test_a_failed_forward_whose_cache_was_dropped_does_not_freeze_the_store() -> None:
    """An exception between layer 0 and the last layer leaves the unit open until the cache's
    abort(); a caller that dropped the cache instead froze the store for every request. The
    next forward of another cache completes it (no commit); while the failed cache lives,
    its abort() stays the way out and the store refuses, typed."""
    import gc

    from ninfer_kv.errors import FrozenUnit

    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))

    def boom(*_: object) -> None:
        raise RuntimeError("simulated failure in layer 0's MLP")

    def failed_forward() -> NinferKVCache:
        cache = NinferKVCache(store, max_new_tokens=4)
        hook = model.model.layers[0].mlp.register_forward_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="simulated"), torch.no_grad():
                model(IDS, cache=cache)
        finally:
            hook.remove()
        return cache

    kept = failed_forward()
    with pytest.raises(FrozenUnit), torch.no_grad():   # its cache lives: not reclaimed
        model(IDS, cache=NinferKVCache(store, max_new_tokens=4))
    kept.abort()
    kept.finish()
    failed_forward()                                  # dropped without abort()
    gc.collect()
    (orphan,) = store.active()
    other = NinferKVCache(store, max_new_tokens=4)
    with torch.no_grad():
        model.generate(IDS, cache=other, max_new_tokens=4, do_sample=False)
    assert other.frontiers() == [23] and store.space(orphan, "main").committed == 0
    store.finish(orphan)                              # its rows stay the caller's
    other.finish()
    assert store.active() == []
    store.check_invariants()


def _generate(model: Any, cache: NinferKVCache, ids: torch.Tensor = IDS) -> torch.Tensor:  # noqa: ANN401
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)


def test_a_refusal_in_the_attention_leaves_the_cache_as_before_the_forward() -> None:
    """Review finding: ``output_attentions`` (or autograd) refused at layer 0 after
    ``update()`` had counted the forward's columns: the cache said 8 columns with no row
    admitted, and the next ``generate`` on it skipped 8 prompt tokens (other tokens, no
    error). Every refusal in the attention now rolls the cache back."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=128, max_concurrency=2))
    clean = _generate(model, NinferKVCache(store))
    cache = NinferKVCache(store)
    with torch.no_grad(), pytest.raises(UnsupportedOperation):
        model(IDS[:, :8], cache=cache, output_attentions=True)
    with pytest.raises(UnsupportedOperation):
        model(IDS[:, :8], cache=cache)                         # autograd on
    assert cache.get_seq_length() == 0 and cache.seqs == []
    assert torch.equal(_generate(model, cache), clean)
    store.check_invariants()


@pytest.mark.parametrize("fail_at", [1, 3])
def test_an_exception_after_the_last_attention_layer_is_undone_by_abort(fail_at: int) -> None:
    """Review finding: the store commits a forward's tokens at its last attention layer; an
    exception after it (the head, an out-of-memory there) left them committed, and
    ``abort()`` kept them: the prefill's logits were lost and the same generate refused. Now
    ``abort()`` truncates them back: the forward fed again gives a clean run's tokens."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=128, max_concurrency=2))
    clean = _generate(model, NinferKVCache(store))
    cache, calls = NinferKVCache(store), [0]

    def head(*_: object) -> None:
        calls[0] += 1
        if calls[0] == fail_at:                                # the prefill, or a decode step
            raise RuntimeError("simulated out of memory in lm_head")

    hook = model.lm_head.register_forward_hook(head)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            _generate(model, cache)
    finally:
        hook.remove()
    cache.abort()
    done = 0 if fail_at == 1 else IDS.shape[1] + fail_at - 2  # the forwards before it
    assert cache.get_seq_length() == done and cache.frontiers() == [done]
    so_far = clean[:, :IDS.shape[1] + fail_at - 1]             # what the caller holds
    with torch.no_grad():
        out = model.generate(so_far, cache=cache, max_new_tokens=clean.shape[1] - so_far.shape[1],
                             do_sample=False)
    assert torch.equal(out, clean)
    store.check_invariants()


def test_a_store_of_another_geometry_is_refused_before_a_row_is_admitted() -> None:
    """Review note: a model whose KV heads or head dim differ from the store's was refused
    typed, but by the append kernel, after its rows were admitted (left active)."""
    model, _ = llama()
    _, other = llama()
    other = T.LlamaConfig(**{**other.to_dict(), "num_key_value_heads": 4})
    store = KVStore.open(store_config_for(other, max_context=128, max_concurrency=2))
    digest = store.digest()
    cache = NinferKVCache(store)
    with torch.no_grad(), pytest.raises(InvalidArgument, match="holds 4 KV heads of 32"):
        model(IDS, cache=cache)
    assert cache.get_seq_length() == 0 and cache.seqs == []
    untouched(store, digest)


def test_abort_keeps_a_commit_the_store_would_not_truncate_for_every_row() -> None:
    """``abort()`` truncates the last forward's tokens back only when every row may be: here
    a prefix shared after the forward protects one row's columns, so both keep the commit
    and the cache's column count stays the store's (rows never left apart)."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=128, max_concurrency=4))
    ids = torch.randint(1, 96, (2, 70), generator=torch.Generator().manual_seed(2))
    cache = NinferKVCache(store)
    with torch.no_grad():
        model(ids, cache=cache)
    store.share_prefix(cache.seqs[1])                      # protects its first page
    cache.abort()                                          # as after a failure in the head
    assert cache.get_seq_length() == 70 and cache.frontiers() == [70, 70]
    store.check_invariants()


def test_a_forward_without_a_cache_leaves_the_last_used_one_alone() -> None:
    """A forward without a cache finds the last-used cache in a stale context variable and
    is refused; that cache's last forward (undoable by ``abort()`` until its next one) must
    not be undone by the refusal: it continues as if nothing happened."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=128, max_concurrency=2))
    clean = _generate(model, NinferKVCache(store))
    cache = NinferKVCache(store)
    with torch.no_grad():
        first = model.generate(IDS, cache=cache, max_new_tokens=3, do_sample=False)
        n, front = cache.get_seq_length(), cache.frontiers()
        with pytest.raises(InvalidArgument, match="no NinferKVCache"):
            model(IDS)                                     # no cache given
        assert (cache.get_seq_length(), cache.frontiers()) == (n, front)
        out = model.generate(first, cache=cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, clean)
    store.check_invariants()


def test_abort_keeps_the_commit_when_a_page_it_would_drop_is_pinned() -> None:
    """Review finding: the pre-check copied only two of truncate's refusals; a forward that
    began on a page boundary drops the page above on truncate, and a ``fork_live`` queued
    after it pins that page, so row 0 was truncated, row 1 refused: the rows went apart
    ([64, 65]) under one column count of 65, and the next forward wrote row 0's token at 64
    with rotary position 65. ``truncate_many`` checks every row with truncate's own rules."""
    model, cfg = llama()
    store = KVStore.open(store_config_for(cfg, max_context=256, max_concurrency=4))
    ids = torch.randint(1, 96, (2, 64), generator=torch.Generator().manual_seed(2))
    cache = NinferKVCache(store)
    with torch.no_grad():
        model(ids, cache=cache)                            # one whole page
        model(torch.tensor([[5], [6]]), cache=cache)       # 65: began on a page boundary
    store.fork_live(cache.seqs[1], 4)                      # row 1's new page: COW queued
    cache.abort()                                          # as after a failure in the head
    assert cache.get_seq_length() == 65 and cache.frontiers() == [65, 65]
    with store.boundary():
        pass
    with torch.no_grad():
        model(torch.tensor([[7], [8]]), cache=cache)
    assert cache.get_seq_length() == 66 and cache.frontiers() == [66, 66]
    store.check_invariants()
