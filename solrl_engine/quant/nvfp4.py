"""NVFP4 reference numerics (pure PyTorch): the oracle every kernel is tested against.

Follows NVIDIA Transformer Engine's NVFP4 recipe (docs/design.md section 4): 1x16 blocks along the last
dimension, E4M3 block scales, an FP32 tensor scale, E2M1 codes packed two per byte (low nibble
first). Every scalar step is written as the explicit float32 operation the spec names, in the same
order, so that kernels can be compared bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solrl_engine.quant.formats import Numerics

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
# Decoded value of each 3-bit E2M1 magnitude code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Thresholds of round-to-nearest-even onto the E2M1 grid: a magnitude a gets code
# sum(a > t for t in strict) + sum(a >= t for t in inclusive). At a tie the even code wins:
# 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0.
E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
E2M1_TIES_UP = (0.75, 1.75, 3.5)


def _f32(v: float, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


@dataclass
class NVFP4Tensor:
    """A tensor in NVFP4: packed E2M1 codes, per-16 E4M3 block scales and an FP32 decode scale.

    `qdata` is uint8 of shape [..., K/2]; `scale` is float8_e4m3fn of shape [..., K/16], row-major
    (not swizzled); `global_scale` is the 0-dim FP32 decode factor 1/S_enc.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    orig_dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape."""
        return torch.Size((*self.qdata.shape[:-1], self.qdata.shape[-1] * 2))

    def codes(self) -> torch.Tensor:
        """Unpacked 4-bit codes, uint8 of the logical shape."""
        return unpack_codes(self.qdata)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode to `dtype` (default: the dtype the tensor was quantized from)."""
        return dequantize(self, dtype or self.orig_dtype)


def check_input(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"NVFP4 quantizes 1x{BLOCK} blocks along the last dimension, so it must be a multiple of "
            f"{BLOCK}; got shape {tuple(x.shape)}. Pad the last dimension (e.g. with "
            f"torch.nn.functional.pad) before quantizing."
        )
    if not (x.is_floating_point()):
        raise TypeError(f"NVFP4 quantizes floating-point tensors; got dtype {x.dtype}.")


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute max over the finite elements (FP32 0-dim; 0 when none is finite).

    Non-finite values are excluded so that one Inf or NaN does not wreck the scale of every other
    block; their own blocks become NaN instead (see `quantize`).
    """
    a = x.detach().float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    return a.amax() if a.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448*6/amax in FP32, 1.0 when amax == 0, capped at the FP32 max."""
    amax = amax.float()
    s = _f32(E4M3_MAX * E2M1_MAX, amax.device) / amax
    s = torch.minimum(s, _f32(FP32_MAX, amax.device))
    return torch.where(amax == 0, _f32(1.0, amax.device), s)


def resolve_amax(amax: float | torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if amax is None:
        return finite_amax(x)
    t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    if t.numel() != 1:
        raise ValueError(f"amax must be a scalar (one value per tensor); got shape {tuple(t.shape)}.")
    t = t.reshape(())
    if not bool(torch.isfinite(t)) or bool(t < 0):
        raise ValueError(f"amax must be finite and >= 0; got {t.item()}. Calibrate it on finite data.")
    return t


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round FP32 values (already clamped to [-6, 6]) to E2M1 codes, nearest-even; NaN -> 0."""
    a = v.abs()
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in E2M1_TIES_DOWN:
        mag += (a > t).to(torch.uint8)
    for t in E2M1_TIES_UP:
        mag += (a >= t).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes in pairs: element 2i in the low nibble, 2i+1 in the high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(qdata: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes`."""
    lo = qdata & 0x0F
    hi = qdata >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _block_scales(
    blocks: torch.Tensor, amax: float | torch.Tensor | None, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(finite-block mask, s_blk as FP32 [..., nb], multiplier [..., nb], g = 1/S_enc) per the spec."""
    dev = blocks.device
    s_enc = global_encode_scale(resolve_amax(amax, x))
    babs = blocks.abs()
    finite = torch.isfinite(babs).all(dim=-1)
    blk_amax = torch.where(finite, babs.amax(dim=-1), _f32(0.0, dev))
    s_blk_f = torch.minimum(blk_amax * (s_enc * _f32(1.0 / 6.0, dev)), _f32(E4M3_MAX, dev))
    s_blk = s_blk_f.to(torch.float8_e4m3fn).float()
    s_blk = torch.where(finite, s_blk, _f32(float("nan"), dev))
    g = _f32(1.0, dev) / s_enc
    mult = torch.minimum(_f32(1.0, dev) / (s_blk * g), _f32(FP32_MAX, dev))
    return finite, s_blk, mult, g


def _pair_tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum of the last dimension (16) by adjacent pairs, 16 -> 8 -> 4 -> 2 -> 1: one fixed order of
    FP32 additions that the Triton kernel repeats exactly."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _encode_blocks(blocks: torch.Tensor, s_blk: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    dev = blocks.device
    mult = torch.minimum(_f32(1.0, dev) / (s_blk * g), _f32(FP32_MAX, dev))
    return e2m1_encode(torch.clamp(blocks * mult.unsqueeze(-1), -E2M1_MAX, E2M1_MAX))


def _four_over_six(
    blocks: torch.Tensor, s6: torch.Tensor, codes6: torch.Tensor, g: torch.Tensor, amax: float | torch.Tensor | None,
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per block, the scale mapping its max to 4 instead of 6 where that decodes closer to the input.

    E2M1's grid is coarse at the top (4 -> 6 in one step): a block whose values sit near 4/6 and 5/6
    of its max loses less with the max on 4 (finer steps below it). The error is the sum of squared
    differences of the decoded block (summed in `_pair_tree_sum`'s order); ties keep 6, the TE recipe.
    """
    dev = blocks.device
    s_enc = global_encode_scale(resolve_amax(amax, x))
    babs = blocks.abs()
    finite = torch.isfinite(babs).all(dim=-1)
    blk_amax = torch.where(finite, babs.amax(dim=-1), _f32(0.0, dev))
    s4 = torch.minimum(blk_amax * (s_enc * _f32(0.25, dev)), _f32(E4M3_MAX, dev)).to(torch.float8_e4m3fn).float()
    s4 = torch.where(finite, s4, _f32(float("nan"), dev))
    codes4 = _encode_blocks(blocks, s4, g)

    def err(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        d = (e2m1_decode(codes) * s.unsqueeze(-1)) * g - blocks
        return _pair_tree_sum(d * d)

    use4 = err(codes4, s4) < err(codes6, s6)
    return torch.where(use4.unsqueeze(-1), codes4, codes6), torch.where(use4, s4, s6)


def quantize(x: torch.Tensor, amax: float | torch.Tensor | None = None, four_over_six: bool = False) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 along its last dimension (a multiple of 16).

    `amax` is the tensor's absolute max (computed over finite values when not given; pass a
    calibrated value for static scaling). A 16-block holding NaN or Inf gets a NaN scale so that
    it decodes to NaN: non-finite input never becomes finite output. `four_over_six` lets each block
    take the scale that maps its max to 4 where that is more accurate (`_four_over_six`); the format
    is unchanged, so every GEMM reads the result as it reads the TE recipe's.
    """
    check_input(x)
    xf = x.detach().float()
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
    _, s_blk, mult, g = _block_scales(blocks, amax, x)
    scaled = torch.clamp(blocks * mult.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    codes = e2m1_encode(scaled)
    if four_over_six:
        codes, s_blk = _four_over_six(blocks, s_blk, codes, g, amax, x)
    codes = codes.reshape(xf.shape)
    return NVFP4Tensor(
        qdata=pack_codes(codes),
        scale=s_blk.to(torch.float8_e4m3fn),
        global_scale=g,
        orig_dtype=x.dtype,
    )


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x' = e2m1(q) * s_blk * (1/S_enc), computed in FP32 in that order, then cast."""
    vals = e2m1_decode(unpack_codes(t.qdata))
    blocks = vals.reshape(*vals.shape[:-1], vals.shape[-1] // BLOCK, BLOCK)
    out = (blocks * t.scale.float().unsqueeze(-1)) * t.global_scale.float()
    return out.reshape(vals.shape).to(dtype)


def fake_quantize(x: torch.Tensor, amax: float | torch.Tensor | None = None, four_over_six: bool = False
                  ) -> torch.Tensor:  # fmt: skip
    """Quantize then dequantize; same shape and dtype as `x`."""
    return quantize(x, amax, four_over_six).dequantize(x.dtype)


def fake_quantize_unit(
    x: torch.Tensor, amax: float | torch.Tensor | None = None, four_over_six: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1(q) * s_blk as FP32, g): the decoded values without the global scale, and g = 1/S_enc.

    Equal to decoding `quantize(x)` with a global scale of 1 (tested bit for bit), but computed
    straight from the values in about half the tensor passes: finiteness and the tensor amax come
    from the per-block amax (a block is non-finite iff its amax is), and E2M1 rounding is round half
    to even on the grid's step (0.5 below 2, 1 below 4, 2 up to 6). The fast path for emulated GEMMs,
    which apply g in their epilogue.
    """
    check_input(x)
    dev = x.device
    xf = x.detach().float()
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
    a = blocks.abs()
    blk_amax = a.amax(dim=-1)
    finite = torch.isfinite(blk_amax)
    blk_amax = torch.where(finite, blk_amax, _f32(0.0, dev))
    if amax is None:  # the finite elements of non-finite blocks count too: rare, so the slow way
        amax = blk_amax.amax() if bool(finite.all()) and blk_amax.numel() else finite_amax(x)
    s_enc = global_encode_scale(resolve_amax(amax, x))
    s_blk = torch.minimum(blk_amax * (s_enc * _f32(1.0 / 6.0, dev)), _f32(E4M3_MAX, dev))
    s_blk = s_blk.to(torch.float8_e4m3fn).float()
    g = _f32(1.0, dev) / s_enc

    def decode(s: torch.Tensor) -> torch.Tensor:  # e2m1(q) * s for the block scales s
        mult = torch.minimum(_f32(1.0, dev) / (s * g), _f32(FP32_MAX, dev))
        mag = (a * mult.unsqueeze(-1)).clamp_(max=E2M1_MAX)
        inv_step = 2.0 - (mag >= 2).float() - 0.5 * (mag >= 4).float()  # 1/step: 2, 1, 0.5 (ends on both grids)
        q = torch.round(mag * inv_step).div_(inv_step)
        return torch.copysign(q, blocks).mul_(torch.where(finite, s, _f32(float("nan"), dev)).unsqueeze(-1))

    out = decode(s_blk)
    if four_over_six:  # as _four_over_six: the max on 4 where the block decodes closer, ties keep 6
        s4 = torch.minimum(blk_amax * (s_enc * _f32(0.25, dev)), _f32(E4M3_MAX, dev)).to(torch.float8_e4m3fn).float()
        out4 = decode(s4)
        d6, d4 = out * g - blocks, out4 * g - blocks
        use4 = _pair_tree_sum(d4 * d4) < _pair_tree_sum(d6 * d6)
        out = torch.where(use4.unsqueeze(-1), out4, out)
    return out.reshape(xf.shape), g


# --- swizzled scale layout for Blackwell block-scaled GEMMs -------------------------------------

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_offsets(rows: int, cols: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Flat byte offset of each (row, block-column) scale in the 128x4 tiled layout.

    Tiles of 128 rows x 4 columns (512 bytes) are laid out K-fastest; inside a tile,
    offset = (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4).
    """
    r = torch.arange(rows, device=device).unsqueeze(1)
    c = torch.arange(cols, device=device).unsqueeze(0)
    tiles_per_row = _ceil_to(cols, SWIZZLE_COLS) // SWIZZLE_COLS
    tile = (r // SWIZZLE_ROWS) * tiles_per_row + (c // SWIZZLE_COLS)
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzled_numel(rows: int, cols: int) -> int:
    """Bytes of a swizzled scale buffer: rows padded to 128, block-columns to 4."""
    return _ceil_to(rows, SWIZZLE_ROWS) * _ceil_to(cols, SWIZZLE_COLS)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row-major block scales [..., cols] -> flat 1-D buffer in the 128x4 tiled order.

    Leading dimensions are flattened into rows; padding is zero; the dtype is kept.
    """
    if scale.dim() < 1:
        raise ValueError("swizzle_scales needs at least a 1-D scale tensor [..., blocks].")
    s2 = scale.reshape(-1, scale.shape[-1])
    rows, cols = s2.shape
    raw = s2.view(torch.uint8) if s2.element_size() == 1 else None
    if raw is None:
        raise TypeError(f"scales must be 1-byte (float8_e4m3fn or uint8); got {scale.dtype}.")
    out = torch.zeros(swizzled_numel(rows, cols), dtype=torch.uint8, device=scale.device)
    out[swizzle_offsets(rows, cols, scale.device).reshape(-1)] = raw.reshape(-1)
    return out.view(scale.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales`: returns row-major [rows, cols] scales of the same dtype."""
    need = swizzled_numel(rows, cols)
    if swizzled.numel() != need:
        raise ValueError(
            f"a swizzled buffer for {rows}x{cols} scales holds {need} bytes (rows padded to 128, "
            f"columns to 4); got {swizzled.numel()}. Pass the unpadded rows and cols."
        )
    raw = swizzled.reshape(-1).view(torch.uint8)
    out = raw[swizzle_offsets(rows, cols, swizzled.device).reshape(-1)].reshape(rows, cols)
    return out.view(swizzled.dtype)


def stored_bytes(in_features: int, out_features: int) -> int:
    """Bytes of an NVFP4 weight: codes, block scales, the global scale, and the block scales' 128x4-tiled copy
    that the Blackwell GEMM reads (padded to whole tiles)."""
    n = in_features * out_features
    return n // 2 + n // 16 + 4 + _ceil_to(out_features, 128) * _ceil_to(in_features // BLOCK, 4)


NUMERICS = Numerics(
    "nvfp4", "NVFP4", 4, stored_bytes, k_multiple=BLOCK, options=("rht", "four_over_six", "lowrank"),
    # beyond the TE recipe (same format and GEMMs): a Hadamard rotation, 4-over-6 block scales
    recipes={"nvfp4_rht16": {"rht": 16}, "nvfp4_4o6": {"four_over_six": True},
             "nvfp4_rht16_4o6": {"rht": 16, "four_over_six": True}},
)  # fmt: skip
