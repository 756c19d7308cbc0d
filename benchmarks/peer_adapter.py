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

import dataclasses
import os
import shutil

import numpy as np
from ninfer_adapter import MAX_OUT, NinferAdapter  # type: ignore[import-not-found]
from peer_bench import VLLMAdapter  # type: ignore[import-not-found]

from ninfer_kv import KVStore
from ninfer_kv.errors import CapacityExhausted


class FirstAdmission:
    """Mixin: the prefix hit of each request's *first* admission only (``first_hit_frac``).
    The harness's hit% also counts the re-admissions of preempted requests (vLLM's recompute
    preemption hits the request's own cached blocks), so a policy that preempts more scores
    more; this one measures what the prefix cache itself reused."""

    hit_tokens: int
    prompt_tokens: int

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[call-arg]
        self._seen: set[int] = set()
        self.first_hit = self.first_prompt = 0

    def admit(self, request_id: int, prompt_len: int, prompt_tokens: object = None) -> bool:
        hit0 = self.hit_tokens
        ok = super().admit(request_id, prompt_len, prompt_tokens)  # type: ignore[misc]
        if ok and request_id not in self._seen:
            self._seen.add(request_id)
            self.first_hit += self.hit_tokens - hit0
            self.first_prompt += prompt_len
        return ok

    def stats(self) -> dict[str, object]:
        return {**super().stats(),  # type: ignore[misc]
                "first_hit_frac": self.first_hit / max(1, self.first_prompt),
                # what the engine prefills: every admission's prompt less its prefix hit
                "prefill_tokens": self.prompt_tokens - self.hit_tokens}


class VllmFirstAdmission(FirstAdmission, VLLMAdapter):
    """vLLM's KVCacheManager (the harness's ``vllm`` peer), with ``first_hit_frac``."""

    name = "vllm-first"


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
        self.holders: dict[int, list[int]] = {}  # block hash -> checkpoints holding it
        self._need = 0  # pages the admission being tried needs at most (0: not admitting)
        self._keep: int | None = None  # the checkpoint that admission continues: not a victim

    def _indexed(self, ck: int, hs: list[int]) -> None:
        """``ck`` holds blocks ``hs``: the newest holder serves lookups; older ones stay
        listed, so evicting the newest re-points the hash instead of forgetting the prefix."""
        self.lru[ck] = hs
        for h in hs:
            self.holders.setdefault(h, []).append(ck)
            self.index[h] = ck

    def _evict_one(self, short: int = 1) -> bool:
        """Free about ``short`` device pages (at least one): the least recently used
        checkpoint that is the only holder of some device page gives up that many pages of
        its tail (``release_tail``; all of them: it is released) — as vLLM frees a cached
        request's blocks tail first, so its prompt outlives its generated tail. Nothing is
        evicted when releasing every checkpoint could not make room for the admission being
        tried (the cache is kept and the request waits, instead of emptying the cache for
        nothing). A checkpoint whose pages running requests share frees nothing: it stays
        indexed, as vLLM keeps the hashes of blocks in use."""
        if not self.lru:
            return False
        store = self.store
        if self._need:
            occ = store.occupancy()["main"]
            if occ["available"] + occ["checkpoint_only"] < self._need:
                return False
            short = max(short, self._need - occ["available"])
        sole = store.sole_device_pages
        for _ in range(len(self.lru)):
            ck = next(iter(self.lru))
            n = sole(ck) if ck != self._keep else 0
            if n:
                break
            self.lru.move_to_end(ck)  # in use by running requests: as vLLM re-queues a block
        else:                         # when its last user frees it, it counts as used now
            # pages only checkpoints hold, each by two or more: releasing one is a step
            info = store.checkpoint_info
            ck = next((c for c in self.lru if c != self._keep
                       and info(c).pools["main"].idle_device_pages), None)
            if ck is None:
                return False
            n = 0
        sp = store.space(ck)
        keep = min(sp.committed // 64, len(sp.members) - short) if n > short else 0
        hs = self.lru.pop(ck)
        new = store.release_tail(ck, keep * 64)
        if new is not None:       # its prefix stays first in line, under a new id
            self.lru[new] = hs[:keep]
            self.lru.move_to_end(new, last=False)
        for i, h in enumerate(hs):
            held = self.holders[h]
            if i < keep:
                held[held.index(ck)] = new  # same place: not the newest holder now
            else:
                held.remove(ck)
            if held:
                self.index[h] = held[-1]
            else:
                del self.holders[h]
                self.index.pop(h, None)
        self.renamed(ck, new)
        self.evictions += 1
        return True

    def renamed(self, ck: int, new: int | None) -> None:
        """``ck`` gave up its tail: ``new`` holds its prefix (None: nothing kept)."""

    def free(self, request_id: int) -> None:
        super().free(request_id)  # finish(retain=True): indexed by the harness adapter ...
        if self.prefix:
            ck, hs = next(reversed(self.lru.items()))
            del self.lru[ck]
            self._indexed(ck, hs)  # ... and listed as a holder here

    def admit(self, request_id: int, prompt_len: int, prompt_tokens: object = None) -> bool:
        hit0 = self.hit_tokens
        hs = self._pending_hashes.get(request_id)  # hashed once, as the harness adapter does
        if hs is None or hs[0] != prompt_len:
            hs = (prompt_len, self._block_hashes(prompt_tokens, (prompt_len - 1) // 64))
            self._pending_hashes[request_id] = hs
        self._keep, k = self._lookup(hs[1])    # the source is no victim of its own admission
        self._need = self.store.entitlement_pages("main", prompt_len, prompt_len + MAX_OUT) - k
        try:
            if not super().admit(request_id, prompt_len, prompt_tokens):
                return False
        finally:
            self._need, self._keep = 0, None
        store, seq = self.store, int(self.seq_of[request_id])
        store.close_boundary()     # the prefill unit ran between these two
        store.unit_complete()
        store.commit(seq, "main", prompt_len)
        hs = self.hashes[request_id]
        if len(hs) > (self.hit_tokens - hit0) // 64:  # adds blocks nobody indexed yet
            ck = store.share_prefix(seq, len(hs) * 64)
            self._indexed(ck, hs)
            self.shared += 1
        return True


class NinferGrowth(FirstAdmission, NinferSharing):
    """``NinferSharing`` with kv_lease_growth (spec §6.2) instead of reserving every request's
    whole prompt + max_tokens budget: a sequence is entitled its frontier + ``WINDOW`` +
    cushion, ``grow`` tops entitlements up every ``EVERY`` rounds (evicting retained or
    shared checkpoints, LRU, while a sequence is short), and a sequence the pool still cannot
    extend is reported back to the harness as not stepped — which preempts the most recently
    admitted request, as vLLM does. A preempted request is finished *retained*:
    its KV stays as a checkpoint (LRU-evictable), and its re-admission (the harness's
    recompute preemption: prompt = prompt + generated) continues from its own checkpoint at
    the token-exact frontier prompt_len - 1 (a partial-tail COW; vLLM and SGLang resume at a
    whole block) — or, once that checkpoint was evicted, like any other request.

    Eviction gives up the least recently used checkpoint's tail first (``release_tail``, as
    many pages as ``CapacityExhausted.short`` / ``GrowResult.short`` say are missing), so a
    preempted request's prompt outlives its generated tail until it is re-admitted, as in
    vLLM's free-block queue; the checkpoint an admission continues is never its victim.

    Defaults (window 1, grow every round, cushion 0: a page when a sequence needs it, as vLLM
    allocates a block per step). Pool-frac 0.5, one run each (W/C: hit%, first-admission hit%,
    preemptions, prompt tokens prefilled): 1/0 17.30/13.07/61/2,108,642; 8/0
    14.7/13.07/30/2,111,434; 64/16 16.0/13.07/67/2,168,581; vLLM 17.29/13.07/61/2,108,841.
    With whole-checkpoint eviction 64/16 gave 13.3/13.07/12/2,117,418. A window ahead of the
    step holds pages no cache can use, so more of the preempted requests' KV is evicted
    before they return. Override with $NINFER_WINDOW, $NINFER_EVERY, $NINFER_CUSHION."""

    name = "ninfer-j-grow"
    WINDOW = int(os.environ.get("NINFER_WINDOW", 1))
    EVERY = int(os.environ.get("NINFER_EVERY", 1))  # rounds between grows (< WINDOW)
    CUSHION = int(os.environ.get("NINFER_CUSHION", 0))

    def __init__(self, pool_tokens: int, page_size: int, max_len: int) -> None:
        super().__init__(pool_tokens, page_size, max_len)
        cfg = self.store.config
        self.store.close()
        if self.jdir is not None:
            shutil.rmtree(self.jdir, ignore_errors=True)
            os.makedirs(self.jdir)
        self.store = KVStore.open(dataclasses.replace(
            cfg, lease_growth=True, lease_window=self.WINDOW,
            lease_cushion=self.CUSHION))
        self.rounds = 0
        self.own: dict[int, tuple[int, list[int]]] = {}  # rid -> (its last checkpoint, hashes)
        self.own_rid: dict[int, int] = {}                 # that checkpoint -> rid
        self.resumed = 0

    def free(self, request_id: int) -> None:
        hs = self.hashes[request_id]
        super().free(request_id)
        ck = next(reversed(self.lru))
        self.own[request_id] = (ck, hs)
        self.own_rid[ck] = request_id

    def renamed(self, ck: int, new: int | None) -> None:
        rid = self.own_rid.pop(ck, None)
        if rid is not None and new is not None:  # a preempted request's prompt lives on
            self.own[rid] = (new, self.own[rid][1])
            self.own_rid[new] = rid

    def admit(self, request_id: int, prompt_len: int, prompt_tokens: object = None) -> bool:
        ck, hs = self.own.get(request_id, (None, []))
        if ck is None or ck not in self.lru:
            return super().admit(request_id, prompt_len, prompt_tokens)
        store = self.store
        self.lru.move_to_end(ck)
        f = min(store.space(ck).committed, prompt_len - 1)
        self._need = store.entitlement_pages("main", prompt_len, prompt_len + MAX_OUT) - f // 64
        self._keep = ck           # not a victim of its own resumption
        try:
            while True:
                try:
                    seq = store.activate_from(ck, f, prompt_len, MAX_OUT)
                    break
                except CapacityExhausted:
                    if not self._evict_one():
                        self.refused += 1
                        return False
                    if ck not in self.lru:   # released at last: recompute like a new request
                        return super().admit(request_id, prompt_len, prompt_tokens)
        finally:
            self._need, self._keep = 0, None
        del self.own[request_id]
        self.own_rid.pop(ck, None)
        store.ensure_mapped(seq, "main", prompt_len)
        store.close_boundary()     # the prefill unit (one token) ran between these two
        store.unit_complete()
        store.commit(seq, "main", prompt_len)
        self.seq[request_id] = seq
        self.front[request_id] = prompt_len
        self.hashes[request_id] = hs
        self.seq_of[request_id] = seq
        self.front_of[request_id] = prompt_len
        self.n_admit += 1
        self.hit_tokens += f
        self.prompt_tokens += prompt_len
        self.resumed += 1
        return True

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "resumed": self.resumed}

    def step_batch(self, request_ids: list[int]) -> list[bool]:
        ok = [True] * len(request_ids)
        if self.rounds % self.EVERY == 0 or len(request_ids) == 1:  # 1: a retry after preemption
            res = self.store.grow(1)
            while res.exhausted and self._evict_one(res.short.get("main", 1)):  # cache first
                res = self.store.grow(1)
            if res.exhausted:
                seqs = self.seq_of[np.array(request_ids, dtype=np.int64)].tolist()
                ok = [s not in res.exhausted for s in seqs]
                request_ids = [r for r, k in zip(request_ids, ok, strict=True) if k]
        self.rounds += 1
        if request_ids:
            NinferArrays.step_batch(self, request_ids)
        return ok
