"""Which retained checkpoints to keep: the retention policy, a layer above the store.

The store never selects a victim (spec §1: "the store never selects"); an engine's resource
manager does. This module is one it can use or replace: ``LruRetention`` indexes retained
checkpoints by the prefix blocks they hold (any hashable block keys: the trace's hash ids,
or ``PrefixIndex.block_hashes``) and, when admission needs device pages, frees them through
the store's public API (``make_room``).

Victim order (``victims``), first to go first:

1. lower ``priority(ck)`` first (a hook: e.g. keep system-prompt prefixes at a higher one);
2. leaves before parents: a checkpoint that another retained checkpoint continues from
   (``checkpoint_info(ck).parent``) holds the prefix they share, so it outlives its branches;
3. least recently used first (retained or looked up).

With a host tier, device room comes first from demoting a fully offloaded victim
(``drop_device``: its pages live on in host memory and a later continuation restores them),
then from releasing the sole holder of some device page — or, when the caller says how many
pages it lacks (``make_room(store, short)``, from ``CapacityExhausted.short``) and the policy
knows its keys' block size, from giving up only that many pages of the victim's tail
(``release_tail``: its prefix stays cached under a new id, ``renamed[old] = new``), as vLLM
evicts a cached request's blocks tail first. That pays when preempted requests come back to
their own prefix (the peer harness's adapter: 17.3% hit over all admissions against 13.3%
with whole releases); on the Mooncake simulator without preemption it does not (0.374 of
prompt tokens reused against 0.377), so ``simulate`` keeps whole releases; host room (``make_host_room``) from
dropping a device-resident victim's host replicas, else releasing a demoted victim. Either way
the least valuable checkpoint goes first, and nothing is released that frees nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from ninfer_kv.engine.args import a_store, as_int
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.state import MAX_BUNDLE
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import IdsExhausted, InvalidArgument, UnknownHandle

log = structlog.get_logger(__name__)


def _blocks(what: str, key: object) -> tuple[Hashable, ...]:
    """``key`` as a tuple of block keys, each hashable (checked before anything changes); a
    1-D numpy array is taken as its plain values."""
    if isinstance(key, np.ndarray) and key.ndim == 1:
        key = key.tolist()
    if isinstance(key, str | bytes) or not isinstance(key, Sequence):
        raise InvalidArgument(f"{what}: key={key!r} must be a sequence of block keys")
    out = tuple(key)
    for i, h in enumerate(out):
        try:
            hash(h)
        except TypeError:
            raise InvalidArgument(f"{what}: block key {i} ({h!r}) is not hashable") from None
    return out


@dataclass(slots=True)
class Entry:
    key: tuple[Hashable, ...]   # the prefix blocks the checkpoint holds, in order
    parent: int | None
    used: int = 0               # recency tick
    children: int = 0           # retained checkpoints continued from this one
    demoted: bool = False       # device pages dropped; lives in the host tier (until restored)


class LruRetention:
    """Retained checkpoints by recency, indexed by their prefix blocks. Invariants: every
    indexed checkpoint is retained in the store (``retain`` after ``finish(retain=True)``,
    ``forget`` after ``release``; ``forget_gone`` restores it when something came between);
    ``children[p]`` counts indexed entries whose parent is ``p``."""

    token_key = "tokens"
    """The metadata key holding a checkpoint's token ids (``PrefixIndex.from_store``'s): a
    tail trim gives the checkpoint holding the prefix the same metadata with the token ids
    cut to what it holds, so an index rebuilt after a restart still finds it."""

    def __init__(self, priority: Callable[[int], int] | None = None,
                 block_tokens: int | None = None) -> None:
        self.entries: dict[int, Entry] = {}
        self.by_block: dict[Hashable, set[int]] = {}
        if priority is not None and not callable(priority):
            raise InvalidArgument(f"LruRetention: priority={priority!r} must be a callable "
                                  "checkpoint -> int, or None")
        self.priority = priority or (lambda ck: 0)
        # tokens per key block; None: no tail-first trims
        self.block_tokens = None if block_tokens is None else as_int("block_tokens",
                                                                     block_tokens, lo=1)
        self.renamed: dict[int, int] = {}  # a trimmed checkpoint -> the one holding its prefix
        # a trim the store may have carried out and the policy not yet followed (_trim)
        self._trimming: tuple[int, int, int, Entry, list[int]] | None = None
        self._tick = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _touch(self, ck: int) -> None:
        self._tick += 1
        self.entries[ck].used = self._tick

    def retain(self, ck: int, key: Sequence[Hashable], parent: int | None = None) -> None:
        """Index retained checkpoint ``ck`` holding prefix blocks ``key``: chained keys (a
        block's key identifies its whole prefix, as vLLM's block hashes and the trace's hash
        ids do), so a key never matches at another position. Refused, with nothing changed,
        for a checkpoint indexed already (``forget`` it first: a second entry would leave its
        old keys answering lookups) or a key that is not a sequence of hashable blocks."""
        ck = as_int("checkpoint", ck)
        if parent is not None:
            parent = as_int("parent", parent)
        if ck in self.entries:
            raise InvalidArgument(f"retain: checkpoint {ck} is indexed already (forget it "
                                  "before indexing it again)")
        key = _blocks("retain", key)
        if parent not in self.entries:  # not indexed (released, or never retained): a root
            parent = None
        self.entries[ck] = Entry(key, parent)
        self._touch(ck)
        if parent is not None:
            self.entries[parent].children += 1
        for h in key:
            self.by_block.setdefault(h, set()).add(ck)

    def forget(self, ck: int) -> None:
        """Drop ``ck`` from the index: its keys first and its entry last, so every key's
        holders stay indexed entries even when an interrupt stops it half way (the next
        ``forget`` of ``ck`` finishes; a parent's child count may then stay one high)."""
        ck = as_int("checkpoint", ck)
        e = self.entries.get(ck)
        if e is None:
            raise UnknownHandle(f"forget: checkpoint {ck!r} is not indexed")
        for h in e.key:
            s = self.by_block.get(h)
            if s is not None:
                s.discard(ck)
                if not s:
                    del self.by_block[h]
        for c in self.entries.values():   # its children become roots
            if c.parent == ck:
                c.parent = None
        del self.entries[ck]
        if e.parent is not None and e.parent in self.entries:
            self.entries[e.parent].children -= 1

    def lookup(self, key: Sequence[Hashable]) -> tuple[int | None, int]:
        """(checkpoint, matched blocks) with the longest common prefix of ``key``; the most
        recently used wins a tie, and is touched."""
        key = _blocks("lookup", key)
        cands: set[int] = set()
        k = 0
        for i, h in enumerate(key):
            holders = self.by_block.get(h)
            narrowed = holders if i == 0 else (cands & holders if holders else set())
            if not narrowed:
                break
            cands, k = set(narrowed), i + 1
        if not cands:
            return None, 0
        best = max(cands, key=lambda c: self.entries[c].used)
        self._touch(best)
        return best, k

    def victims(self) -> Iterator[int]:
        """Every indexed checkpoint, first victim first (see the module docstring)."""
        yield from sorted(self.entries, key=lambda c: (
            self.priority(c), self.entries[c].children > 0, self.entries[c].used))

    def make_room(self, store: KVStore, short: int | None = None, keep: int | None = None
                  ) -> str | None:
        """Free device pages for one more admission attempt. With a host tier, demote
        (``drop_device``) the first victim whose every page has a published host replica;
        else release the first victim that is the only holder of some device page (a demoted
        one found holding device pages again is demoted again if it can be), else the first
        holding a page that only retained checkpoints hold (it frees when they all go).
        With ``short >= 1`` and ``block_tokens``, a victim whose every page is on the device
        and that holds more than ``short`` device pages alone gives up only its tail: sharing
        is always of a prefix (Fork, Share, Prefix), so its sole pages are its last ones.
        Returns "demote", "release", "trim" or None: releasing would free no device page —
        running sequences or checkpoints this policy does not hold map them — so the
        checkpoints stay and their prefixes stay findable. "Free" means at once: a page a
        queued copy pins (a COW tail's source, an offload's page) frees only at the boundary
        that runs the copy, so a victim whose pages all are pinned is passed over (releasing
        it now would free nothing for the admission that asked); after that boundary it is
        a victim like any other. ``keep``: a checkpoint that is no victim (the one the
        admission that asked for room continues), as ``make_host_room``'s."""
        a_store(store, "make_room")
        if short is not None:
            short = as_int("short", short, lo=0)
        if keep is not None:
            keep = as_int("keep", keep)
        self.forget_gone(store)
        victims = [ck for ck in self.victims() if ck != keep]
        if store.arena is not None:
            for ck in victims:
                if not self.entries[ck].demoted and self._demote(store, ck):
                    return "demote"
            # none frees a page of its own: a prefix shared with a checkpoint that is not
            # demoted (one this policy does not hold, e.g. a swapped-out sequence's; one whose
            # own pages left already) goes with the first victim holding it, before anything
            # is released (as every demotion did before shared prefixes were kept)
            for ck in victims:
                if not self.entries[ck].demoted and self._demote(store, ck, shared=True):
                    return "demote"
        # every victim, demoted ones too: a demotion can be partial (a page a running
        # sequence mapped stayed), and a sibling's continuation restores shared pages
        for ck in victims:
            sole = store.sole_device_pages(ck, now=True)
            if sole:
                e = self.entries[ck]
                if e.demoted:
                    e.demoted = False
                    if store.arena is not None and self._demote(store, ck):
                        return "demote"
                if short is not None and short >= 1 and self.block_tokens and sole > short:
                    pages, dev, _ = residency(store, ck)
                    # all on the device and none pinned: its sole pages are its tail, and
                    # each frees at once
                    if dev == pages and sole == store.sole_device_pages(ck):
                        return self._trim(store, ck, short)
                return self._release(store, ck)
        # pages only retained checkpoints hold, each page by two or more: releasing one of
        # them is a step (not a page another holder, e.g. an engine's own checkpoint, keeps)
        if victims:
            freed = store.reclaimable(victims, now=True)
            for ck in victims:
                if freed[ck]:
                    return self._release(store, ck)
        return None

    def forget_gone(self, store: KVStore) -> list[int]:
        """Forget the indexed checkpoints ``store`` no longer retains, and return them. The
        policy releases first and forgets after, so an interrupt between the two (Ctrl-C,
        a signal handler's ``SystemExit``) left an entry for a released checkpoint and every
        later ``make_room`` raised ``UnknownHandle`` on it; an engine that releases one of
        them itself is forgiven the same way, and a tail trim interrupted the same way is
        settled first (``_settle_trim``). ``make_room`` and ``make_host_room`` start here
        (O(entries), on the admission path that found no room)."""
        self._settle_trim(store)
        held = set(store.checkpoints())
        gone = [ck for ck in self.entries if ck not in held]
        for ck in gone:
            self.forget(ck)
            log.warning("retention.forgot_gone", checkpoint=ck)
        return gone

    def _demote(self, store: KVStore, ck: int, shared: bool = False) -> bool:
        """Drop ``ck``'s device pages if every page has a published host replica — but not a
        page a checkpoint that is not demoted holds too (unless ``shared``): a prefix it
        shares with a parent or a system prompt stays on the device for them (review
        finding: demoting a leaf demoted the higher-priority prefix it continued); that one
        drops it when its own turn comes. True when this drops some."""
        pages, dev, host = residency(store, ck)
        demoted = None if shared else [c for c, e in self.entries.items() if e.demoted]
        if dev and host == pages and store.drop_device(ck, shared_with=demoted):
            self.entries[ck].demoted = True
            log.debug("retention.demote", checkpoint=ck)
            return True
        return False

    def _trim(self, store: KVStore, ck: int, short: int) -> str:
        """``ck`` gives up at least ``short`` pages of its tail, down to a whole key block (a
        page above the last whole block no lookup could reach); its blocks below stay."""
        bt = self.block_tokens
        assert bt
        spaces = [store.space(ck, pool) for pool in store.pools]
        cap = min(min(sp.committed for sp in spaces) // P,       # pages it may keep: every
                  min(len(sp.members) for sp in spaces) - short)  # pool loses >= short pages
        blocks = max(0, cap) * P // bt                            # whole key blocks in them
        keep = -(-blocks * bt // P)                               # the pages those blocks span
        if blocks == 0 or store.state.next_bundle > MAX_BUNDLE:  # or no id left for the prefix
            return self._release(store, ck)                      # (release_tail makes one)
        e = self.entries[ck]
        kids = [c for c, x in self.entries.items() if x.parent == ck]
        # the store first (a refusal leaves the policy as it was), then the policy follows;
        # the plan is kept until it has, so an interrupt in between is settled later
        self._trimming = (ck, store.state.next_bundle, blocks, e, kids)
        meta = store.checkpoint_info(ck).metadata  # the release drops it with ck
        try:
            new = store.release_tail(ck, keep * P)
        except IdsExhausted:  # no id for the prefix now (the window of one step is spent)
            self._trimming = None
            return self._release(store, ck)
        assert new == self._trimming[1]
        if isinstance(meta, dict) and isinstance(meta.get(self.token_key), list):
            # never more ids than it holds: a continuation carrying this metadata (and an
            # index rebuilt from it) must not claim another's tokens past its frontier
            try:
                store.set_metadata(new, {**meta, self.token_key: meta[self.token_key][:keep * P]})
            except InvalidArgument as exc:  # no room left in this record (METADATA_PER_RECORD):
                log.warning("retention.trim_metadata_dropped", checkpoint=new,  # the trim
                            reason=str(exc))  # stands, the prefix unfindable after a restart
        self._settle_trim(store)
        log.debug("retention.trim", checkpoint=ck, kept=new, pages=keep)
        return "trim"

    def _settle_trim(self, store: KVStore) -> None:
        """Make the policy follow a ``_trim`` the store carried out: ``ck`` is forgotten and
        the checkpoint ``release_tail`` made holds its first blocks (``renamed[ck]``), its
        children continuing from it. Each step checks whether it is done, so a settling
        interrupted half way is finished by the next call (``forget_gone``); a trim the store
        did not carry out (refused, or interrupted before) is dropped."""
        t = self._trimming
        if t is None:
            return
        ck, new, blocks, e, kids = t
        held = set(store.checkpoints())
        if ck in held or new not in held:  # not carried out, or both released since
            self._trimming = None
            return
        if ck in self.entries:
            self.forget(ck)
        if new not in self.entries:
            parent = e.parent if e.parent in self.entries else None
            self.entries[new] = Entry(e.key[:blocks], parent, e.used, 0, e.demoted)
            if parent is not None:
                self.entries[parent].children += 1
        for h in e.key[:blocks]:
            self.by_block.setdefault(h, set()).add(new)
        for c in kids:        # they continue from its prefix: it still outlives them
            if c in self.entries:
                self.entries[c].parent = new
        self.entries[new].children = sum(x.parent == new for x in self.entries.values())
        self.renamed[ck] = new
        self._trimming = None

    def _release(self, store: KVStore, ck: int) -> str:
        store.release(ck)  # first: a refusal (e.g. FrozenUnit) leaves the policy as it was
        self.forget(ck)
        log.debug("retention.release", checkpoint=ck)
        return "release"

    def make_host_room(self, store: KVStore, keep: int | None = None) -> str | None:
        """Free host-arena space (for offloading ``keep``): the first victim other than
        ``keep`` that holds host replicas loses them — ``drop_host`` when every page is still
        on the device (the checkpoint stays cached there), else it is released, if that frees
        an extent (a page it holds alone). Returns "drop_host", "release" or None (nothing in
        the host tier to free)."""
        a_store(store, "make_host_room")
        if keep is not None:
            keep = as_int("keep", keep)
        self.forget_gone(store)
        for ck in self.victims():
            if ck == keep:
                continue
            pages, dev, _ = residency(store, ck)
            if dev == pages:  # cached on the device: it loses only its host replicas, valid
                if store.drop_host(ck):  # or stale (an extent all the same)
                    log.debug("retention.drop_host", checkpoint=ck)
                    return "drop_host"
                continue      # none, pinned by a queued copy, or every replica another's too
            pools = store.checkpoint_info(ck, metadata=False).pools.values()
            if not any(r.sole_host_pages_now for r in pools):
                continue      # its extents are other holders' too, or a queued copy's until
                #               the boundary: releasing frees nothing now
            store.release(ck)
            self.forget(ck)
            log.debug("retention.release_host", checkpoint=ck)
            return "release"
        return None

    def restored(self, ck: int) -> None:
        """``ck`` was continued: its pages are on the device again, and so are the prefixes of
        the checkpoints it continues (its ancestors here), which a demotion of ``ck`` may not
        take along as demoted ones' any more (review finding)."""
        ck = as_int("checkpoint", ck)
        seen: set[int] = set()
        while ck in self.entries and ck not in seen:
            seen.add(ck)
            self.entries[ck].demoted = False
            ck = self.entries[ck].parent  # type: ignore[assignment]


def residency(store: KVStore, ck: int) -> tuple[int, int, int]:
    """(pages, device pages, pages with a published host replica) of checkpoint ``ck``,
    summed over its pools."""
    pools = store.checkpoint_info(ck, metadata=False).pools.values()
    return (sum(r.pages for r in pools), sum(r.device_pages for r in pools),
            sum(r.host_pages for r in pools))
