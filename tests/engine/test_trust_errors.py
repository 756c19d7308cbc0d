"""Regression tests for the trust issue's item 17: no raw Python error escapes the API. Each
bad input gets a typed ``KVStoreError`` subclass whose message names the value and the rule,
and a refused call leaves the state digest unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.pages import PageHandle
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import (
    ConfigError,
    InvalidArgument,
    KVStoreError,
    UnknownHandle,
    UnknownProfile,
)
from tests.engine.conftest import assert_refusals_change_nothing, small_config
from tests.engine.test_continuation import checkpoint_at, step


@pytest.fixture
def store(tmp_path: Path) -> KVStore:
    s = KVStore.open(small_config(tmp_path))
    yield s
    s.close()


def test_bad_calls_are_typed_and_change_nothing(store: KVStore) -> None:
    s = store
    a = s.activate(64, 64)
    s.ensure_mapped(a, "main", 64)
    step(s)
    ck = checkpoint_at(s, 100)
    cases = [
        (InvalidArgument, "differ in length", lambda: s.ensure_mapped_many("main", [a], [1, 2])),
        (InvalidArgument, "differ in length", lambda: s.commit_many("main", [a, ck], [64])),
        (InvalidArgument, "differ in length", lambda: s.set_provisional_many("main", [a], [])),
        (InvalidArgument, "missing \\['main'\\]", lambda: s.activate_from(ck, {}, 100, 10)),
        (InvalidArgument, "unknown \\['nopool'\\]",
         lambda: s.activate_from(ck, {"main": 10, "nopool": 3}, 100, 10)),
        (InvalidArgument, "mode='sideways'",
         lambda: s.activate_from(ck, 10, 100, 10, mode="sideways")),
        (InvalidArgument, "keep_source", lambda: s.activate_from(ck, 10, 100, 10,
                                                                 keep_source="yes")),
        (InvalidArgument, "layer=99 must be <= 1", lambda: s.layer_view(a, "main", 99)),
        (InvalidArgument, "layer=-1", lambda: s.batch_view("main", -1)),
        (UnknownHandle, "'nopool' is not enabled", lambda: s.batch_view("nopool", 0)),
        (UnknownHandle, "is not enabled", lambda: s.commit(a, ["main"], 1)),  # unhashable
        # a read-only query, refused too (it answered for any name: found by a review)
        (UnknownHandle, "'nopool' is not enabled", lambda: s.entitlement_pages("nopool", 0, 9)),
        (UnknownHandle, "is not enabled", lambda: s.entitlement_pages(["main"], 0, 9)),
        (InvalidArgument, "seq='1'", lambda: s.commit("1", "main", 1)),
        (InvalidArgument, "checkpoint=None", lambda: s.release(None)),
        (InvalidArgument, "retain", lambda: s.finish(a, retain="yes")),
        (InvalidArgument, "drop_device", lambda: s.offload(ck, drop_device=1)),
        (InvalidArgument, "step_tokens=0", lambda: s.grow(0)),
        (InvalidArgument, "PageHandle", lambda: s.page(("main", 0, 0))),
        (InvalidArgument, "integer array", lambda: s.table_rows("main", __import__(
            "numpy").array([1.0]))),
        (InvalidArgument, "sequence of integers", lambda: s.ensure_mapped_many("main", a, 3)),
    ]
    assert_refusals_change_nothing(s, cases)
    step(s)


@pytest.mark.parametrize("make,exc,pattern", [
    (lambda: ModelGeometry(profile="k9v9"), UnknownProfile, "unknown KV profile 'k9v9'"),
    (lambda: ModelGeometry(layers=2.5), ConfigError, "layers=2.5"),
    (lambda: ServingConfig(backend="eagle"), ConfigError, "backend 'eagle'"),
    (lambda: StoreConfig(host_bytes=-1), ConfigError, "host_bytes=-1 must be >= 0"),
    # past int64 (were TypeError / OverflowError / ValueError from torch and mmap)
    (lambda: StoreConfig(host_bytes=2**63), ConfigError, "host_bytes=9223372036854775808 does "
                                                         "not fit in 64 bits"),
    (lambda: StoreConfig(headroom=2**64), ConfigError, "headroom=18446744073709551616"),
    (lambda: StoreConfig(device=2**63), ConfigError, "device=9223372036854775808 is not a torch"),
    (lambda: StoreConfig(device="tpu9"), ConfigError, "tpu9"),
    (lambda: StoreConfig(device="xla"), ConfigError, "cpu or cuda"),
    (lambda: StoreConfig(kv_tokens="lots"), ConfigError, "kv_tokens='lots'"),
    (lambda: StoreConfig(lease_growth="on"), ConfigError, "lease_growth"),
    (lambda: StoreConfig(persist_dir=3.0), ConfigError, "not a path"),
    (lambda: KVStore.open({"kv_tokens": 4096}), InvalidArgument, "StoreConfig"),
    (lambda: KVStore.open(StoreConfig(journal_dir="/proc/ninfer-kv/journal")), ConfigError,
     "/proc/ninfer-kv"),
])
def test_bad_configuration_is_typed(make, exc: type[KVStoreError], pattern: str) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=pattern):
        make()


def test_a_profile_given_by_name_is_parsed() -> None:
    from ninfer_kv.engine.layout import Profile

    assert ModelGeometry(profile="K8V4").profile is Profile.K8V4


def test_stale_and_foreign_page_handles(store: KVStore) -> None:
    with pytest.raises(KVStoreError, match="stale"):
        store.page(PageHandle("main", 10**6, 0))
