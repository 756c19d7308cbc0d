"""Plane schema (spec §4.3/§4.4) and capacity planner (spec §3.2/§3.3)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine.capacity import (
    Backend,
    ModelGeometry,
    ServingConfig,
    build_layout,
    capacity_curve,
    m_range,
    parse_bytes,
    plan_automatic,
    plan_explicit,
)
from ninfer_kv.engine.layout import (
    P,
    PlaneOrder,
    PoolKind,
    Profile,
    bytes_per_token_head,
    plane_inventory,
    pool_geometry,
)
from ninfer_kv.errors import CapacityError, ConfigError, KVStoreError, UnknownProfile
from ninfer_kv.tools.cli import main

# The seed's D256 table (spec §4.4): (K code + scale, V code + scale).
D256 = {
    Profile.BF16: ((512, 0), (512, 0)),
    Profile.INT8_G64: ((256, 8), (256, 8)),
    Profile.FP8_ROW256: ((256, 2), (256, 2)),
    Profile.NVFP4_G16: ((128, 16), (128, 16)),
    Profile.K8V4: ((256, 2), (128, 16)),
}


@pytest.mark.parametrize("profile", list(Profile))
def test_d256_table_exact(profile: Profile) -> None:
    (kc, ks), (vc, vs) = D256[profile]
    assert bytes_per_token_head(profile, 256) == (kc + ks, vc + vs)
    planes = plane_inventory(profile, 1, 256)
    by = {(p.side, p.role): p.bytes_per_token_head for p in planes}
    assert by[("k", "code")] == kc and by[("v", "code")] == vc
    assert by.get(("k", "scale"), 0) == ks and by.get(("v", "scale"), 0) == vs
    assert sum(by.values()) == {Profile.BF16: 1024, Profile.INT8_G64: 528,
                                Profile.FP8_ROW256: 516, Profile.NVFP4_G16: 288,
                                Profile.K8V4: 402}[profile]


def test_leading_extents_and_dtypes() -> None:
    k8v4 = {(p.side, p.role): p for p in plane_inventory(Profile.K8V4, 1, 128)}
    assert k8v4[("k", "scale")].x == 1 and k8v4[("k", "scale")].group == 128
    assert k8v4[("v", "code")].x == 64 and k8v4[("v", "code")].group == 2
    assert k8v4[("v", "scale")].x == 8
    int8 = {(p.side, p.role): p for p in plane_inventory(Profile.INT8_G64, 1, 128)}
    assert int8[("k", "scale")].x == 2 and int8[("k", "scale")].itemsize == 2


def test_page_bytes_sum_of_planes_not_twice_vector() -> None:
    g = pool_geometry(PoolKind.MAIN, Profile.K8V4, 3, 2, 256, 10)
    assert g.page_bytes == 3 * 2 * P * 402
    assert g.page_bytes != 3 * 2 * P * 2 * 258  # 2 * vector_bytes would be wrong
    assert g.total_bytes == 10 * g.page_bytes


def test_orders_shapes_strides() -> None:
    main = pool_geometry(PoolKind.MAIN, Profile.FP8_ROW256, 1, 4, 128, 7)
    code = main.layer_planes(0)["k_code"]
    assert main.order is PlaneOrder.PAGE_MAJOR
    assert main.shape(code) == (7, 4, 64, 128)
    assert main.strides(code) == (4 * 64 * 128, 64 * 128, 128, 1)
    draft = pool_geometry(PoolKind.DRAFT_FULL, Profile.BF16, 1, 2, 64, 5)
    dcode = draft.layer_planes(0)["v_code"]
    assert draft.order is PlaneOrder.HEAD_MAJOR
    assert draft.shape(dcode) == (2, 5, 64, 64)


def test_bad_layout_inputs() -> None:
    with pytest.raises(UnknownProfile, match="fp16"):
        Profile.parse("fp16")
    with pytest.raises(ConfigError, match="head_dim=96.*64"):
        plane_inventory(Profile.INT8_G64, 1, 96)
    with pytest.raises(ConfigError, match="head_dim=40.*16"):
        plane_inventory(Profile.NVFP4_G16, 1, 40)
    with pytest.raises(ConfigError, match="BF16"):
        pool_geometry(PoolKind.DRAFT_FULL, Profile.FP8_ROW256, 1, 1, 64, 4)
    with pytest.raises(ConfigError, match="capacity=0"):
        pool_geometry(PoolKind.MAIN, Profile.BF16, 1, 1, 64, 0)


# --- capacity ---------------------------------------------------------------------------------
M = ModelGeometry(layers=4, kv_heads=2, head_dim=128)


def test_m_range_worked() -> None:
    assert m_range(ServingConfig(max_context=8192, max_concurrency=8)) == (128, 1024)
    assert m_range(ServingConfig(max_context=100, max_concurrency=16)) == (16, 32)  # L=2
    assert m_range(ServingConfig(max_context=64, max_concurrency=1)) == (1, 1)


def test_explicit_policy() -> None:
    s = ServingConfig(max_context=8192, max_concurrency=8)
    assert plan_explicit(M, s, 8192 * 2 + 1).m == 257  # ceil(16385/64)
    assert plan_explicit(M, s, 8192).token_capacity == 8192
    with pytest.raises(CapacityError, match="K_main=8000.*S=8192"):
        plan_explicit(M, s, 8000)
    with pytest.raises(CapacityError, match="M=ceil.*1025.*M_max=1024"):
        plan_explicit(M, s, 1025 * 64)


def test_automatic_policy_worked() -> None:
    s = ServingConfig(max_context=8192, max_concurrency=8, allowance_bytes=1000)
    curve = capacity_curve(M, s)
    page = build_layout(M, s, 1).pools[PoolKind.MAIN].page_bytes
    assert curve.b_step == page == 4 * 2 * 64 * 512
    r = 1 << 20
    f = r + curve.b_min + 10 * curve.b_step + curve.b_step - 1
    plan = plan_automatic(M, s, f, r)
    assert plan.m == 128 + 10
    assert plan.layout.total_bytes == curve(plan.m)
    assert plan_automatic(M, s, 1 << 40, r).m == 1024  # capped at M_max
    with pytest.raises(CapacityError, match="B_min"):
        plan_automatic(M, s, r + curve.b_min - 1, r)


def test_backend_pages() -> None:
    mtp = ServingConfig(max_context=4096, max_concurrency=4, backend=Backend.MTP, draft_window=4)
    pools = plan_explicit(M, mtp, 64 * 100).layout.pools
    assert pools[PoolKind.MTP].capacity == 100 + 4 * 1  # ceil(3/64) = 1
    mtp_big = ServingConfig(max_context=4096, max_concurrency=4, backend=Backend.MTP,
                            draft_window=130)
    assert plan_explicit(M, mtp_big, 6400).layout.pools[PoolKind.MTP].capacity == 100 + 4 * 3
    mtp1 = ServingConfig(max_context=4096, max_concurrency=4, backend=Backend.MTP, draft_window=1)
    assert plan_explicit(M, mtp1, 6400).layout.pools[PoolKind.MTP].capacity == 100
    dfl = ServingConfig(max_context=4096, max_concurrency=4, backend=Backend.DFLASH)
    m_draft = ModelGeometry(layers=4, kv_heads=2, head_dim=128, draft_layers=2)
    pools = plan_explicit(m_draft, dfl, 6400).layout.pools
    assert pools[PoolKind.DRAFT_FULL].capacity == 100
    assert pools[PoolKind.DRAFT_FULL].order is PlaneOrder.HEAD_MAJOR
    assert set(plan_explicit(M, dfl, 6400).layout.pools) == {PoolKind.MAIN}  # DFlash2


def test_bad_capacity_inputs() -> None:
    with pytest.raises(ConfigError, match="max_concurrency=0"):
        plan_explicit(M, ServingConfig(max_concurrency=0), 8192)
    with pytest.raises(ConfigError, match="layers=-1"):
        plan_explicit(ModelGeometry(layers=-1), ServingConfig(), 8192)
    with pytest.raises(ConfigError):
        parse_bytes("lots")
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("4096") == 4096


def test_a_plan_the_journal_cannot_record_is_refused() -> None:
    """Review note: ``plan --max-context 99999999999999999999`` printed a plan. Frontiers
    (committed and provisional: up to L * P, a page-rounded S), rows and page-group ids are
    int32 in the journal's packed fields: a frontier past 2**31 wrapped there (a second
    review: S = 2**31 - 5 planned, and a valid provisional frontier of 2**31 failed the
    store when its event applied)."""
    top = (1 << 31) - 1
    last = top // P * P                               # the largest S whose L * P fits
    with pytest.raises(ConfigError, match="must stay below 2..31"):
        plan_explicit(M, ServingConfig(max_context=last + 1, max_concurrency=1), last + 1)
    with pytest.raises(ConfigError, match="must stay below 2..31"):
        plan_explicit(M, ServingConfig(max_context=64, max_concurrency=top + 1), 1 << 40)
    with pytest.raises(CapacityError, match="page-group ids are int32"):
        plan_explicit(M, ServingConfig(max_context=1 << 30, max_concurrency=256), 150 * 10**9)
    assert plan_explicit(M, ServingConfig(max_context=last, max_concurrency=1), last).L * P \
        == last <= top                                # the largest S still plans


geometries = st.builds(
    lambda layers, heads, prof, hd, s, c, backend, k, allow, dl: (
        ModelGeometry(layers, heads, hd, prof, 1, dl, 2, 64),
        ServingConfig(s, c, backend, k, allow)),
    st.integers(1, 6), st.integers(1, 8), st.sampled_from(list(Profile)),
    st.sampled_from([64, 128, 256]), st.integers(1, 40000), st.integers(1, 64),
    st.sampled_from(list(Backend)), st.integers(1, 200), st.integers(0, 1 << 20),
    st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(geometries, st.integers(0, 1 << 34), st.integers(0, 1 << 28))
def test_automatic_is_largest_fitting_m(geo, free: int, headroom: int) -> None:
    model, serving = geo
    m_min, m_max = m_range(serving)
    curve = capacity_curve(model, serving)
    if free < headroom + curve.b_min:
        with pytest.raises(CapacityError):
            plan_automatic(model, serving, free, headroom)
        return
    plan = plan_automatic(model, serving, free, headroom)
    assert m_min <= plan.m <= m_max
    assert build_layout(model, serving, plan.m).total_bytes == curve(plan.m) == \
        plan.layout.total_bytes
    assert curve(plan.m) <= free - headroom
    if plan.m < m_max:  # the next page no longer fits
        assert build_layout(model, serving, plan.m + 1).total_bytes > free - headroom


# --- CLI --------------------------------------------------------------------------------------
def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json", "--backend", "mtp", "--profile", "k8v4", "--head-dim", "256",
                 "--kv-tokens", "65536"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("S", "C", "P", "L", "M_min", "M_max", "M", "token_capacity"):
        assert isinstance(d[key], int)
    assert d["M"] == 1024 and d["token_capacity"] == 65536
    assert set(d["pools"]) == {"main", "mtp"}
    assert d["bytes_per_token_head"] == {"k": 258, "v": 144}


def test_cli_plan_auto_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json", "--free-bytes", "2GiB", "--headroom", "256MiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"] == "automatic" and d["total_bytes"] <= (2 << 30) - (256 << 20)
    assert main(["plan", "--profile", "int8-g64", "--head-dim", "96"]) == 2
    err = capsys.readouterr().err
    assert "head_dim=96" in err and "Traceback" not in err and err.count("\n") == 1
    assert main(["plan"]) == 0 and "capacity plan" in capsys.readouterr().out


def test_errors_share_one_base() -> None:
    assert issubclass(CapacityError, KVStoreError) and issubclass(UnknownProfile, KVStoreError)
