"""What the transformers drop-in serves, checked before a forward touches the store.

The ``ninfer_kv`` attention is full causal attention over the store's pages, for inference:
the bundled kernels read every committed token of a row (no window, no chunk), have no
backward, return no attention weights, and take head dims the decode kernel takes (a
multiple of 32, at most 256). Anything else is refused with a typed error naming it —
never served as a different attention (silently wrong logits) and never refused only after
rows were admitted. Each check returns the refusal's reason, or None; ``store_config_for``
sizes a store for a model, refusing one it would not serve.
"""

from __future__ import annotations

from typing import Any

import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.errors import UnsupportedOperation

ATTENTION_LAYERS = ("full_attention", "attention")
"""``layer_types`` / ``layers_block_type`` entries that are plain causal attention."""


def unserved_layers(config: Any, max_context: int) -> str | None:  # noqa: ANN401
    """A model whose layers are not all causal attention that sees every earlier token within
    ``max_context``: a chunked attention (Llama4's ``attention_chunk_size``), or a layer that
    is no attention at all (convolution, linear attention, Mamba: hybrid models keep state
    this cache does not hold), or a sliding window shorter than ``max_context`` in the
    config (each call is judged again by its own window, ``unserved_call``)."""
    window = getattr(config, "sliding_window", None)  # what the per-layer check falls back to
    if window is not None and window < max_context:
        return (f"sliding_window={window} < max_context={max_context}; only full attention "
                "is served")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and chunk < max_context:
        return (f"attention_chunk_size={chunk} < max_context={max_context} (chunked_attention "
                "is not served)")
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    for i, kind in enumerate(types or ()):
        if kind == "chunked_attention" and chunk is not None:
            continue  # a chunk as long as the context: every earlier token is seen
        if kind not in (*ATTENTION_LAYERS, "sliding_attention"):
            return (f"layer {i} is {kind!r} (only full causal attention, or a window of at "
                    f"least max_context={max_context}, is served)")
    return None


def unserved_head_dim(head_dim: int) -> str | None:
    if head_dim % 32 or not 0 < head_dim <= 256:
        return (f"head_dim={head_dim}: the bundled attention kernels take a multiple of 32, "
                "at most 256")
    return None


def unserved_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, dropout: float, kwargs: dict[str, Any],
                  max_context: int) -> str | None:
    """What one attention call asks for that the store's attention does not do."""
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            return f"{name} (logit soft-capping / attention sinks) is not served"
    config = getattr(module, "config", None)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or \
        getattr(config, "sliding_window", None)
    if window is not None and window < max_context:
        return (f"sliding_window={window} < max_context={max_context}; only full attention "
                "is served")
    if dropout:
        return f"dropout={dropout} (inference only)"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return ("autograd is on and q/k/v require grad, but the store's attention has no "
                "backward (inference only: run under torch.no_grad() or "
                "torch.inference_mode())")
    if kwargs.get("output_attentions"):
        return "output_attentions=True: the paged kernels compute no attention weights"
    return unserved_head_dim(query.shape[-1])


def refuse(what: str, reason: str | None) -> None:
    if reason is not None:
        raise UnsupportedOperation(f"{what}: {reason}")


def store_config_for(model_config: Any, *, max_context: int, max_concurrency: int,
                     profile: str = "bf16", kv_tokens: int | None = None,
                     **store: Any) -> StoreConfig:
    """A ``StoreConfig`` whose geometry is the model's: layers, KV heads, head dim. Default
    ``kv_tokens``: room for every row at full context (``max_context * max_concurrency``).
    A model the ``ninfer_kv`` attention does not serve (the checks above) is refused here,
    before a store is sized for it."""
    if getattr(model_config, "kv_lora_rank", None) is not None:
        raise UnsupportedOperation("store_config_for: multi-head latent attention (kv_lora_rank"
                                   f"={model_config.kv_lora_rank}) is not served")
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    refuse("store_config_for", unserved_head_dim(head_dim))
    refuse("store_config_for", unserved_layers(model_config, max_context))
    geometry = ModelGeometry(layers=model_config.num_hidden_layers,
                             kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
                             head_dim=head_dim, profile=profile, mtp_layers=0)
    serving = ServingConfig(max_context=max_context, max_concurrency=max_concurrency)
    if kv_tokens is None:
        kv_tokens = max_context * max_concurrency
    return StoreConfig(model=geometry, serving=serving, kv_tokens=kv_tokens, **store)
