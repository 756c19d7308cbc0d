"""PrefixIndex against a brute-force oracle (hypothesis state machine), its refusals, its
collision fallback, and its rebuild from a restarted store's checkpoint metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ninfer_kv.cache import Match, PrefixIndex
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import InvalidArgument, UnknownHandle
from tests.engine.conftest import crash
from tests.engine.test_continuation import checkpoint_at, step
from tests.engine.test_host_tier import host_store

# few distinct tokens and short blocks: shared prefixes and partial-block ties are common
TOKENS = st.lists(st.integers(0, 2), max_size=40)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = PrefixIndex(block=4)
        self.model: dict[int, list[int]] = {}
        self.next = 0

    @rule(tokens=TOKENS)
    def add(self, tokens: list[int]) -> None:
        self.idx.add(self.next, tokens)
        self.model[self.next] = tokens
        self.next += 1

    @rule(data=st.data(), tokens=TOKENS)
    def replace(self, data: st.DataObject, tokens: list[int]) -> None:
        if self.model:
            ck = data.draw(st.sampled_from(sorted(self.model)))
            self.idx.add(ck, tokens)
            self.model[ck] = tokens

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.model:
            ck = data.draw(st.sampled_from(sorted(self.model)))
            self.idx.remove(ck)
            del self.model[ck]

    @rule(query=TOKENS)
    def lookup(self, query: list[int]) -> None:
        got = self.idx.lookup(query)
        best = max((lcp(t, query) for t in self.model.values()), default=0)
        if best == 0:
            assert got is None
        else:
            assert got is not None and got.tokens == best
            assert lcp(self.model[got.checkpoint], query) == best

    @invariant()
    def same_members(self) -> None:
        assert len(self.idx) == len(self.model)
        assert all(ck in self.idx for ck in self.model)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=list(HealthCheck))


def test_token_exact_across_a_partial_block() -> None:
    idx = PrefixIndex()  # block 64
    a = list(range(200))
    idx.add(7, a)
    assert idx.lookup(a[:150] + [-1] * 10) == Match(7, 150)  # 2 blocks + 22 tokens
    assert idx.lookup(a[:40]) == Match(7, 40)                # inside the first block
    assert idx.lookup([5, 6]) is None
    idx.add(8, a[:130])  # equal prefix length: the newest wins the tie
    assert idx.lookup(a[:100]) == Match(8, 100)
    assert idx.lookup(a) == Match(7, 200)


def test_a_removed_checkpoint_leaves_no_key_behind() -> None:
    idx = PrefixIndex(block=4)
    idx.add(1, [0, 0, 0, 0, 1, 1, 1, 1])
    idx.add(2, [0, 0, 0, 0, 2])
    idx.remove(1)
    assert idx.lookup([0, 0, 0, 0, 1, 1, 1, 1]) == Match(2, 4)
    assert len(idx._holders) == 1  # only the key of the first block, held by 2


def test_a_hash_collision_never_gives_a_wrong_answer() -> None:
    idx = PrefixIndex(block=2, chain=lambda parent, block: b"same")  # every key collides
    idx.add(1, [1, 2, 3, 4])
    idx.add(2, [9, 9, 9, 9, 9])
    assert idx.lookup([1, 2, 3, 0]) == Match(1, 3)
    assert idx.lookup([9, 9, 9]) == Match(2, 3)
    assert idx.lookup([0]) is None


def test_refusals() -> None:
    idx = PrefixIndex()
    with pytest.raises(UnknownHandle, match="not in the prefix index"):
        idx.remove(3)
    with pytest.raises(InvalidArgument, match="1-D sequence of integer"):
        idx.add(1, [[1, 2]])
    with pytest.raises(InvalidArgument, match="1-D sequence of integer"):
        idx.lookup([0.5])
    with pytest.raises(InvalidArgument, match="int32"):
        idx.add(1, [1 << 40])
    with pytest.raises(InvalidArgument, match="block=0 must be >= 1"):
        PrefixIndex(block=0)
    for ragged in ([1, [2, 3]], [[1], [2, 3]]):  # review finding: numpy's ValueError escaped
        with pytest.raises(InvalidArgument, match="1-D sequence of integer"):
            idx.lookup(ragged)
        with pytest.raises(InvalidArgument, match="1-D sequence of integer"):
            idx.add(1, ragged)
    assert len(idx) == 0


def test_rebuilt_from_a_restarted_store(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 64).tolist()
    live = PrefixIndex()
    for n in (100, 150, 70):
        ck = checkpoint_at(s, n)
        toks = (system + rng.integers(0, 1000, 200).tolist())[:n + 5]  # 5 beyond the frontier
        s.set_metadata(ck, {"tokens": toks})
        live.add(ck, toks[:n])
        s.offload(ck)
        step(s)
    gone = checkpoint_at(s, 80)  # device-only: a restart drops it
    s.set_metadata(gone, {"tokens": system + [1] * 16})
    step(s)
    crash(s)
    s2 = host_store(tmp_path)
    rebuilt = PrefixIndex.from_store(s2)
    assert gone not in rebuilt and len(rebuilt) == 3
    for q in (system + [3] * 10, live._tokens[max(live._tokens)].tolist(), [42]):
        assert rebuilt.lookup(q) == live.lookup(q)
    s2.close()


def test_from_store_skips_checkpoints_without_tokens(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 64)
    other = checkpoint_at(s, 64)
    s.set_metadata(other, {"model": "x"})
    s.set_metadata(ck, {"tokens": list(range(64))})
    idx = PrefixIndex.from_store(s)
    assert ck in idx and other not in idx
    assert idx.lookup(list(range(100))) == Match(ck, 64)
    s.close()


def test_vllm_compatible_keys() -> None:
    """Vectors printed by vLLM 0.33.0 itself (vllm.v1.core.kv_cache_utils: init_none_hash
    and hash_block_tokens with get_hash_fn_by_name("sha256"), PYTHONHASHSEED unset), for the
    tokens 100..227 in blocks of 64 (../shared/bench harness sources)."""
    idx = PrefixIndex.vllm(block=64, hash_seed="vllm-none-hash")
    assert idx._seed.hex() == ("066b1e8987e027138e98701c46128929"
                               "378935f9b6cd1549105ae6b4f0d71198")
    h1, h2 = idx.block_hashes(list(range(100, 228)))
    assert h1.hex() == "59a41b688f168cd9210428c6b255a2277c4e43da8075d87b248f26e36a11a2cd"
    assert h2.hex() == "87797cce40bc899a210c476279b129e46173c18a0fd31e8afa53f81c2c443d6d"
    idx.add(3, list(range(100, 228)))
    assert idx.lookup(list(range(100, 200))) == Match(3, 100)


def test_rebuilt_by_replay_equals_the_live_index(tmp_path: Path) -> None:
    """The index is derived state: built incrementally next to a live store (checkpoints
    retained, continued, shared from a running sequence, released), it equals the one
    ``from_state`` rebuilds from ``replay(journal).state`` — same entries, same answers."""
    from ninfer_kv.replay import replay
    from tests.engine.conftest import small_config
    from tests.engine.test_continuation import running

    s = KVStore.open(small_config(tmp_path, pages=64, concurrency=6))
    rng = np.random.default_rng(7)
    system = rng.integers(0, 500, 96).tolist()
    live = PrefixIndex()
    made: list[tuple[int, list[int]]] = []
    for n in (100, 130, 70, 200, 64):
        toks = (system if n % 20 == 0 else []) + rng.integers(0, 500, 250).tolist()
        ck = checkpoint_at(s, n)
        s.set_metadata(ck, {"tokens": toks[:n + 3]})    # tokens beyond the frontier too
        live.add(ck, toks[:n])
        made.append((ck, toks))
    child = s.activate_from(made[0][0], 90, 150, 10)     # continued, then retained
    s.ensure_mapped(child, "main", 150)
    step(s)
    s.commit(child, "main", 150)
    ck = s.finish(child, retain=True)
    toks = made[0][1][:90] + rng.integers(0, 500, 60).tolist()
    s.set_metadata(ck, {"tokens": toks})
    live.add(ck, toks[:150])
    owner = running(s, 300, 10)                          # a running sequence's shared prefix
    s.set_metadata(owner, {"tokens": system * 3})       # active: not an index entry
    shared = s.share_prefix(owner, 256)
    s.set_metadata(shared, {"tokens": system * 3})
    live.add(shared, (system * 3)[:256])
    for gone in (made[2][0], made[4][0]):
        s.release(gone)
        live.remove(gone)
    step(s)
    digest = s.digest()
    s.close()
    r = replay(str(tmp_path / "journal"))
    assert r.digest == digest
    rebuilt = PrefixIndex.from_state(r.state)
    assert len(rebuilt) == len(live) == 5
    assert all(c in rebuilt for c, _ in made if c in live)
    queries = [t[:k] for _, t in made for k in (1, 63, 64, 65, 99, 140, 250)]
    queries += [system + [9] * 30, (system * 3)[:300], toks, [501, 502]]
    for q in queries:
        assert rebuilt.lookup(q) == live.lookup(q), q[:5]


def test_rebuilt_with_the_hash_of_the_index_it_replaces(tmp_path: Path) -> None:
    """Regression: ``from_store`` rebuilt every index with the default BLAKE2b chain in blocks
    of 64, so an engine publishing vLLM block hashes to a router got other keys after a
    restart. ``like=`` rebuilds with the replaced index's block size, hash and seed."""
    s = host_store(tmp_path)
    live = PrefixIndex.vllm(block=16)
    toks = list(range(300, 400))
    ck = checkpoint_at(s, 90)
    s.set_metadata(ck, {"tokens": toks})
    live.add(ck, toks[:90])
    rebuilt = PrefixIndex.from_store(s, like=live)
    assert rebuilt.block == 16 and rebuilt._keys[ck] == live._keys[ck]
    assert len(rebuilt._keys[ck]) == 90 // 16
    assert rebuilt.lookup(toks[:50] + [1]) == live.lookup(toks[:50] + [1]) == Match(ck, 50)
    assert PrefixIndex.from_store(s)._keys[ck] != live._keys[ck]  # the default: other keys
    with pytest.raises(InvalidArgument, match="block=64 differs from like.block=16"):
        PrefixIndex.from_store(s, block=64, like=live)
    with pytest.raises(InvalidArgument, match="must be a PrefixIndex"):
        PrefixIndex.from_store(s, like="vllm")  # type: ignore[arg-type]
    s.close()


def test_rebuilt_entries_stop_at_the_lowest_pool_frontier(tmp_path: Path) -> None:
    """Review repro: with MTP the pools may commit different frontiers (§6.2); the rebuilt
    index cut the tokens at the main pool's, so a match could not be continued."""
    from ninfer_kv.engine.capacity import Backend
    from tests.engine.conftest import small_config

    s = KVStore.open(small_config(tmp_path, pages=40, backend=Backend.MTP))
    toks = list(range(1000, 1300))
    a = s.activate(300, 50)
    for pool in s.pools:
        s.ensure_mapped(a, pool, 300)
    step(s)
    s.commit(a, "main", 300)
    s.commit(a, "mtp", 299)                  # the MTP pool lags one token
    s.set_metadata(a, {"tokens": toks})
    ck = s.finish(a, retain=True)
    step(s)
    m = PrefixIndex.from_store(s).lookup(toks + [7, 8])
    assert m == Match(ck, 299)
    s.activate_from(m.checkpoint, m.tokens, 302, 10)   # continuable in every pool
    s.close()


def test_a_chain_repeating_a_key_is_removed_whole() -> None:
    """Review repro: a chain hash that collides inside one checkpoint's own chain (any weak
    user-supplied ``chain=``) made ``remove`` raise KeyError half way and leave the entry
    behind, answering later lookups with it."""
    idx = PrefixIndex(block=2, chain=lambda parent, block: b"\x00")   # every key collides
    idx.add(1, [1, 2, 3, 4])
    idx.remove(1)
    assert 1 not in idx and len(idx) == 0 and idx.lookup([1, 2, 3, 4]) is None
    idx.add(2, [1, 2, 3, 4])
    idx.add(2, [1, 2, 5, 6])                 # re-adding goes through remove too
    idx.add(3, [1, 2, 3, 4])
    assert idx.lookup([1, 2, 3, 4]) == Match(3, 4)
    assert idx.lookup([1, 2, 5, 6, 7]) == Match(2, 4)


def test_an_interrupted_add_or_remove_never_gives_a_wrong_answer() -> None:
    """``KeyboardInterrupt`` at any line of ``add`` or ``remove``: every lookup still answers
    exactly (the oracle: the longest common prefix over what is indexed), the operation then
    runs again, and the index equals one built without the interrupt. Before, a lookup could
    raise ``KeyError`` (a holder not yet, or no longer, in ``_tokens``), and a second
    ``remove`` raised ``KeyError`` or left keys behind."""
    from tests.interrupts import Injector

    base = {1: [0, 0, 0, 0, 1, 1, 1, 1], 2: [0, 0, 0, 0, 2], 3: [0, 0, 0, 0, 1, 1, 1, 1, 2]}
    queries = [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 2, 2], [0, 0, 0, 0, 1, 1], [1]]

    def built(entries: dict[int, list[int]]) -> PrefixIndex:
        idx = PrefixIndex(block=4)
        for ck, t in entries.items():
            idx.add(ck, t)
        return idx

    def exact(idx: PrefixIndex, q: list[int]) -> None:
        got = idx.lookup(q)
        best = max((lcp(t.tolist(), q) for t in idx._tokens.values()), default=0)
        assert (got.tokens if got else 0) == best, (q, got)
        assert got is None or lcp(idx._tokens[got.checkpoint].tolist(), q) == got.tokens

    ops = {"add": (lambda idx: idx.add(4, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]),
                   {**base, 4: [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]}),
           "re-add": (lambda idx: idx.add(3, [0, 0, 0, 0, 2, 2]), {**base, 3: [0, 0, 0, 0, 2, 2]}),
           "remove": (lambda idx: idx.remove(3), {k: v for k, v in base.items() if k != 3})}
    for name, (op, after) in ops.items():
        dry = Injector(0)
        assert dry.run(lambda o=op: o(built(base))) is None
        clean = built(after)
        for at in range(1, dry.lines + 1):
            idx = built(base)
            err = Injector(at).run(lambda o=op, i=idx: o(i))
            if err is None:
                continue  # the line was in building, not in the operation
            assert isinstance(err, KeyboardInterrupt), (name, at, err)
            for q in queries:
                exact(idx, q)
            op(idx)  # again: it finishes what the interrupted one left
            assert idx._tokens.keys() == clean._tokens.keys(), (name, at)
            assert idx._holders == clean._holders and idx._keys == clean._keys, (name, at)
            for q in queries:
                exact(idx, q)
