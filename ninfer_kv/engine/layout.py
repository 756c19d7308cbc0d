"""Closed KV profiles -> typed plane schema; the two closed plane orders; PageBytes.

Spec §3.1, §4.3, §4.4. A profile resolves into K and V *code* planes and optional *scale* planes,
each with its own storage dtype, leading extent X and group size. Everything that counts bytes
(PageBytes, the capacity curve, host page sizes) sums this typed inventory; nothing here ever
computes ``2 * vector_bytes`` (K8V4 is asymmetric).

Plane orders (spec §4.3 lists dims fastest-first, ``[X, P, H, N]``; torch lists them
slowest-first):

* page-major (Main, MTP):   torch shape ``[N_physical, H, P, X]``, contiguous
* head-major (Draft Full):  torch shape ``[H, N_physical, P, X]``, contiguous

so the spec's ``nb0..nb3`` are the torch strides read right to left.

Alignment: every plane's per-page slice is ``H * P * X * itemsize`` bytes with P = 64, so it is
always a multiple of 64 B; slabs are therefore 64-B aligned for any page count and the startup
layout is exactly affine in the page count (the capacity curve of spec §3.2 relies on this).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ninfer_kv.errors import ConfigError, UnknownProfile

P = 64
"""Page size in tokens for every growing pool (spec §2, §4.5)."""

ALIGN = 64
"""Slab alignment in bytes. Divides every per-page plane slice (P=64 rows of >= 1 B)."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Codec(enum.StrEnum):
    """Per-side (K or V) storage codec. The persistent format is in docs/codecs.md."""

    BF16 = "bf16"
    INT8_G64 = "int8-g64"
    FP8_ROW = "fp8-e4m3fn-row256"
    NVFP4_G16 = "nvfp4-g16"


class Profile(enum.StrEnum):
    """The five closed KV profiles (spec §3.1)."""

    BF16 = "bf16"
    INT8_G64 = "int8-g64"
    FP8_ROW256 = "fp8-e4m3fn-row256"
    NVFP4_G16 = "nvfp4-g16"
    K8V4 = "k8v4"

    @classmethod
    def parse(cls, name: str | Profile) -> Profile:
        try:
            return cls(str(name).lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise UnknownProfile(f"unknown KV profile {name!r}; the closed set is {names}") from None

    @property
    def codecs(self) -> tuple[Codec, Codec]:
        """(K codec, V codec)."""
        return _PROFILE_CODECS[self]


_PROFILE_CODECS: dict[Profile, tuple[Codec, Codec]] = {
    Profile.BF16: (Codec.BF16, Codec.BF16),
    Profile.INT8_G64: (Codec.INT8_G64, Codec.INT8_G64),
    Profile.FP8_ROW256: (Codec.FP8_ROW, Codec.FP8_ROW),
    Profile.NVFP4_G16: (Codec.NVFP4_G16, Codec.NVFP4_G16),
    Profile.K8V4: (Codec.FP8_ROW, Codec.NVFP4_G16),
}


class PlaneOrder(enum.StrEnum):
    PAGE_MAJOR = "page-major"
    HEAD_MAJOR = "head-major"


class PoolKind(enum.StrEnum):
    MAIN = "main"
    MTP = "mtp"
    DRAFT_FULL = "draft_full"


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """One plane of one layer: ``layer``, side ``k``/``v``, role ``code``/``scale``."""

    layer: int
    side: str
    role: str
    dtype: torch.dtype
    x: int
    """Leading extent (elements of ``dtype`` per token per head)."""
    group: int
    """Source elements covered by one stored element (1 for codes, 2 for packed fp4, G for scales)."""

    @property
    def name(self) -> str:
        return f"L{self.layer}.{self.side}_{self.role}"

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_head(self) -> int:
        return self.x * self.itemsize


def codec_planes(codec: Codec, head_dim: int) -> tuple[tuple[str, torch.dtype, int, int], ...]:
    """(role, dtype, X, group) of the code plane and optional scale plane of one side (§4.3)."""
    d = head_dim
    if codec is Codec.BF16:
        return (("code", torch.uint16, d, 1),)
    if codec is Codec.INT8_G64:
        _require_divisible(d, 64, codec)
        return (("code", torch.int8, d, 1), ("scale", torch.uint16, d // 64, 64))
    if codec is Codec.FP8_ROW:
        return (("code", torch.uint8, d, 1), ("scale", torch.uint16, 1, d))
    if codec is Codec.NVFP4_G16:
        _require_divisible(d, 16, codec)
        return (("code", torch.uint8, d // 2, 2), ("scale", torch.uint8, d // 16, 16))
    raise AssertionError(codec)


def _require_divisible(d: int, g: int, codec: Codec) -> None:
    if d % g:
        raise ConfigError(f"head_dim={d} is not divisible by the {codec.value} group size {g} (§4.3)")


def bytes_per_token_head(profile: Profile, head_dim: int) -> tuple[int, int]:
    """(K bytes, V bytes) per token per head, codes plus scales (spec §4.4 table)."""
    k, v = profile.codecs
    return (
        sum(x * _itemsize(dt) for _, dt, x, _ in codec_planes(k, head_dim)),
        sum(x * _itemsize(dt) for _, dt, x, _ in codec_planes(v, head_dim)),
    )


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Exactly what the common pool needs (spec §3.1 last paragraph): the expanded plane
    inventory, the page size, the plane order, heads and the physical capacity. It does not
    interpret the storage mode."""

    kind: PoolKind
    order: PlaneOrder
    planes: tuple[PlaneSpec, ...]
    num_kv_heads: int
    head_dim: int
    layers: int
    capacity: int
    """Physical page groups N_physical."""
    page_size: int = P

    def shape(self, plane: PlaneSpec) -> tuple[int, int, int, int]:
        n, h = self.capacity, self.num_kv_heads
        if self.order is PlaneOrder.PAGE_MAJOR:
            return (n, h, self.page_size, plane.x)
        return (h, n, self.page_size, plane.x)

    def strides(self, plane: PlaneSpec) -> tuple[int, int, int, int]:
        """Element strides of the contiguous tensor (torch order)."""
        s = self.shape(plane)
        return (s[1] * s[2] * s[3], s[2] * s[3], s[3], 1)

    def plane_page_bytes(self, plane: PlaneSpec) -> int:
        return self.num_kv_heads * self.page_size * plane.bytes_per_token_head

    @property
    def page_bytes(self) -> int:
        """PageBytes = sum over every plane of every layer of PlaneBytesPerToken * P (§4.4)."""
        return sum(self.plane_page_bytes(pl) for pl in self.planes)

    def slab_bytes(self, plane: PlaneSpec) -> int:
        return align_up(self.capacity * self.plane_page_bytes(plane))

    @property
    def total_bytes(self) -> int:
        """Startup physical bytes of the plane slabs, each aligned (§4.4 last paragraph)."""
        return sum(self.slab_bytes(pl) for pl in self.planes)

    def layer_planes(self, layer: int) -> dict[str, PlaneSpec]:
        """``{'k_code': ..., 'k_scale': ..., 'v_code': ..., ...}`` for one layer."""
        return {f"{p.side}_{p.role}": p for p in self.planes if p.layer == layer}


def plane_inventory(profile: Profile, layers: int, head_dim: int) -> tuple[PlaneSpec, ...]:
    """Expand a profile's per-side schema over ``layers`` layers: the typed plane inventory."""
    k_codec, v_codec = profile.codecs
    out: list[PlaneSpec] = []
    for layer in range(layers):
        for side, codec in (("k", k_codec), ("v", v_codec)):
            for role, dt, x, g in codec_planes(codec, head_dim):
                out.append(PlaneSpec(layer, side, role, dt, x, g))
    return tuple(out)


def pool_geometry(kind: PoolKind, profile: Profile, layers: int, num_kv_heads: int,
                  head_dim: int, capacity: int) -> PoolGeometry:
    """Main and MTP are page-major in the engine's profile; Draft Full is head-major BF16."""
    for name, v in (("layers", layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("capacity", capacity)):
        if v <= 0:
            raise ConfigError(f"{kind.value} pool: {name}={v} must be positive")
    if kind is PoolKind.DRAFT_FULL:
        if profile is not Profile.BF16:
            raise ConfigError(f"Draft Full pool uses its own BF16 profile, got {profile.value} (§3.1)")
        order = PlaneOrder.HEAD_MAJOR
    else:
        order = PlaneOrder.PAGE_MAJOR
    return PoolGeometry(kind, order, plane_inventory(profile, layers, head_dim), num_kv_heads,
                        head_dim, layers, capacity)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "ALIGN", "P", "Codec", "PlaneOrder", "PlaneSpec", "PoolGeometry", "PoolKind", "Profile",
    "align_up", "bytes_per_token_head", "ceil_div", "codec_planes", "plane_inventory",
    "pool_geometry",
]
