"""ninfer-kv on the peer harness (``../shared/bench``), driven with per-request arrays.

The harness's own ``ninfer_adapter.NinferAdapter`` keeps each request's sequence id and
frontier in dicts and rebuilds two Python lists every step. An engine keeps that state in
arrays indexed by request (vLLM's ``InputBatch``, SGLang's ``req_to_token_pool``); these
variants do the same and pass numpy arrays to ``ensure_mapped_many`` / ``commit_many``.
Everything else — admit (prefix lookup, Fork on a hit, activate, ensure_mapped), one journal
record per step, finish(retain) on free, the journal on — is the harness adapter's, unchanged.

Loaded by ``benchmarks/peer_harness.py`` (``--adapter peer_adapter:NinferArrays``); importable
only inside the harness venv (it imports ``peer_bench`` and ``ninfer_adapter``).
"""

from __future__ import annotations

import numpy as np
from ninfer_adapter import NinferAdapter  # type: ignore[import-not-found]


class NinferArrays(NinferAdapter):
    name = "ninfer-j-arr"

    def __init__(self, pool_tokens: int, page_size: int, max_len: int) -> None:
        super().__init__(pool_tokens, page_size, max_len)
        self.seq_of = np.full(1024, -1, np.int64)     # request id -> sequence (bundle) id
        self.front_of = np.zeros(1024, np.int64)      # request id -> committed KV tokens

    def admit(self, request_id: int, prompt_len: int, prompt_tokens: object = None) -> bool:
        if not super().admit(request_id, prompt_len, prompt_tokens):
            return False
        if request_id >= len(self.seq_of):
            n = 2 * request_id + 1
            self.seq_of = np.concatenate([self.seq_of, np.full(n - len(self.seq_of), -1)])
            self.front_of = np.concatenate([self.front_of, np.zeros(n - len(self.front_of),
                                                                    np.int64)])
        self.seq_of[request_id] = self.seq[request_id]
        self.front_of[request_id] = prompt_len
        return True

    def step_batch(self, request_ids: list[int]) -> list[bool]:
        store = self.store
        rids = np.array(request_ids, dtype=np.int64)
        seqs = self.seq_of[rids]
        nxt = self.front_of[rids] + 1
        store.ensure_mapped_many("main", seqs, nxt)
        store.close_boundary()
        store.unit_complete()      # the GPU unit ran between these two
        store.commit_many("main", seqs, nxt)
        self.front_of[rids] = nxt
        return [True] * len(request_ids)


class NinferArraysNoJournal(NinferArrays):
    name = "ninfer-nj-arr"
    journal = False


class NinferSharing(NinferArrays):
    """Live prefix sharing, as vLLM and SGLang cache the prompt blocks of *running* requests.
    The prompt is prefilled in its own unit at admission (a prefill step: boundary, unit,
    commit of the prompt), then its whole prompt pages become a checkpoint (``share_prefix``)
    indexed by their block hashes — so the next request of the same admission wave already
    Forks from it, as in vLLM, where blocks are cached when they are scheduled. Only prompts
    that add blocks beyond their own hit are shared; shared checkpoints are LRU-evicted on
    demand like the retained ones. The extra boundary per admission is charged to admit."""

    name = "ninfer-j-share"

    def __init__(self, pool_tokens: int, page_size: int, max_len: int) -> None:
        super().__init__(pool_tokens, page_size, max_len)
        self.shared = 0

    def admit(self, request_id: int, prompt_len: int, prompt_tokens: object = None) -> bool:
        hit0 = self.hit_tokens
        if not super().admit(request_id, prompt_len, prompt_tokens):
            return False
        store, seq = self.store, int(self.seq_of[request_id])
        store.close_boundary()     # the prefill unit ran between these two
        store.unit_complete()
        store.commit(seq, "main", prompt_len)
        hs = self.hashes[request_id]
        if len(hs) > (self.hit_tokens - hit0) // 64:  # adds blocks nobody indexed yet
            ck = store.share_prefix(seq, len(hs) * 64)
            self.lru[ck] = hs
            for h in hs:
                self.index[h] = ck
            self.shared += 1
        return True
