"""transformers drop-in: ``generate`` with every K/V in a KVStore, attended by our kernels.

A tiny randomly initialised Llama (2 layers, GQA 4:2) generates for a left-padded batch of
prompts of different lengths through ``NinferKVCache``; the tokens equal transformers' own
``DynamicCache`` with K/V rounded to bf16 (what the bf16 profile stores). Then a new request
continues the first prompt's retained checkpoint at a mid-page frontier: only its new tokens
are computed, the shared pages are reused (Fork, §10).

    python examples/transformers_dropin.py
"""

import copy

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from ninfer_kv import KVStore
from ninfer_kv.integrations.transformers import NinferKVCache, register, store_config_for

register()  # attn_implementation="ninfer_kv"
cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
torch.manual_seed(0)
reference = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
model = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
model.load_state_dict(reference.state_dict())
model.set_attn_implementation("ninfer_kv")


class Bf16Layer(DynamicLayer):  # the reference keeps K/V as the bf16 profile stores them
    def update(self, k, v, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return super().update(k.bfloat16().float(), v.bfloat16().float(), *args, **kwargs)


def bf16_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = [Bf16Layer() for _ in range(2)], None
    return cache


def generate(m: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False)
    return out[:, ids.shape[1]:]


store = KVStore.open(store_config_for(cfg, max_context=512, max_concurrency=4, profile="bf16"))
lengths = [90, 33, 7]
ids = torch.zeros(3, 90, dtype=torch.long)
mask = torch.zeros_like(ids)
for i, n in enumerate(lengths):  # left padding, as generate expects for decoder-only models
    ids[i, 90 - n:] = torch.randint(1, 96, (n,))
    mask[i, 90 - n:] = 1
cache = NinferKVCache(store, max_new_tokens=8)
got = generate(model, ids, mask, cache)
assert torch.equal(got, generate(reference, ids, mask, bf16_cache())), got
print("batch of", lengths, "-> frontiers", cache.frontiers())
first, *_ = cache.finish(retain=True)  # each row is now an immutable checkpoint

# continue the first prompt at token 70 (mid-page) with a different ending
ids2 = torch.cat([ids[:1, :70], torch.randint(1, 96, (1, 20))], 1)
cont = NinferKVCache(store, max_new_tokens=8, prefix=(first, 70))
got = generate(model, ids2, torch.ones_like(ids2), cont)
assert torch.equal(got, generate(reference, ids2, torch.ones_like(ids2), bf16_cache())), got
info = store.checkpoint_info(cont.seqs[0])
print(f"continued checkpoint {first} at 70: parent {info.parent}, {info.frontier} tokens, "
      f"{store.metrics().cow_copies} tail copy")
store.close()
print("ok")
