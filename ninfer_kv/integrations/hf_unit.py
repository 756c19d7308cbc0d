"""One forward of the transformers drop-in as a GPU unit of the store (spec §8.4): which
columns of each row are real tokens, where they go (table rows, positions), and each layer's
append + attention over the pages (``append_kv``, then ``paged_decode`` for one token per
row or ``paged_prefill_varlen``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.integrations.hf_served import refuse, unserved_call, unserved_layers
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from ninfer_kv.kernels.prefill import paged_prefill_varlen


class Unit:
    """One forward's plan: the real tokens of each row, flattened in row order."""

    def __init__(self, rows: torch.Tensor, real: torch.Tensor, flat_rows: torch.Tensor,
                 positions: torch.Tensor, cu: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor, active: torch.Tensor, ctx: torch.Tensor) -> None:
        self.rows, self.real, self.flat_rows, self.positions = rows, real, flat_rows, positions
        self.cu, self.active = cu, active
        self.start, self.end = start, end  # each row's frontier before and after (host)
        self.ctx = ctx  # the active rows' context lengths, for the kernels

    @classmethod
    def plan(cls, store: KVStore, pool: str, seqs: Sequence[int], real: torch.Tensor,
             start: torch.Tensor, end: torch.Tensor) -> Unit:
        rows = store.table_rows(pool, seqs)
        counts = end - start
        row_of = torch.arange(len(seqs)).unsqueeze(1).expand_as(real)[real]
        within = real.long().cumsum(1)[real] - 1
        active = torch.nonzero(counts > 0).flatten()   # rows with at least one new token
        cu = torch.zeros(len(active) + 1, dtype=torch.int32)
        cu[1:] = counts[active].cumsum(0)
        dev = rows.device  # the kernels take their index tensors on the planes' device
        return cls(rows, real, rows[row_of.to(dev)],
                   (start[row_of] + within).to(torch.int32).to(dev), cu.to(dev), start, end,
                   active.to(dev), end[active].to(torch.int32).to(dev))

    def attend(self, store: KVStore, pool: str, layer: int, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Append this layer's K/V of the real tokens, attend, and scatter back to
        [B, T, Hq, D] (padding queries get zeros: nothing reads them)."""
        view = store.batch_view(pool, layer)
        real = self.real
        k = key.transpose(1, 2)[real].float().contiguous()            # [N, Hkv, D]
        v = value.transpose(1, 2)[real].float().contiguous()
        q = query.transpose(1, 2)[real].float().contiguous()          # [N, Hq, D]
        append_kv(view, self.flat_rows, self.positions, k, v)
        rows, ctx = self.rows[self.active], self.ctx
        if q.shape[0] == len(self.active):                            # one token per row
            o = paged_decode(q, view, rows, ctx, sm_scale=scaling)
        else:
            o = paged_prefill_varlen(q, view, rows, self.cu, ctx, sm_scale=scaling)
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        out[real] = o.to(query.dtype)
        return out


def checked_unit(cache: Any, module: torch.nn.Module, layer: int,  # noqa: ANN401
                 query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float,
                 kwargs: dict[str, Any]) -> Unit:
    """The forward's unit for ``layer`` of a ``NinferKVCache`` (layer 0 begins it), after every
    refusal of what the attention does not serve (the caller rolls the cache back on one)."""
    max_context = cache.store.config.serving.max_context
    refuse("ninfer_kv attention", unserved_call(module, query, key, value, dropout, kwargs,
                                                max_context))
    if layer == 0:  # the model's layers, before the first one admits rows
        refuse("ninfer_kv attention", unserved_layers(getattr(module, "config", None),
                                                      max_context))
    n_layers = len(cache.layers)
    model_layers = getattr(getattr(module, "config", None), "num_hidden_layers", n_layers)
    if model_layers != n_layers:  # the unit completes after the last layer: it must be ours
        raise InvalidArgument(f"ninfer_kv attention: the model has {model_layers} layers, pool "
                              f"{cache.pool} of the store {n_layers}")
    g = cache.store.device.pools[cache.pool].geometry
    if key.dim() != 4 or (key.shape[1], key.shape[3]) != (g.num_kv_heads, g.head_dim):
        raise InvalidArgument(f"ninfer_kv attention: K/V of {tuple(key.shape)} [B, Hkv, T, D], "
                              f"pool {cache.pool} of the store holds {g.num_kv_heads} KV heads "
                              f"of {g.head_dim} (a store built for another model: "
                              "store_config_for(model.config))")
    unit = cache._unit
    if layer == 0:
        if unit is not None:
            raise InvalidArgument("ninfer_kv attention: layer 0 again before the last layer of "
                                  "the previous forward; call cache.abort() after a failed "
                                  "forward")
        return cache._begin(query, attention_mask)
    if unit is None:
        raise InvalidArgument(f"ninfer_kv attention: layer {layer} before layer 0")
    return unit
