"""The quantize where its input is made, behind the dispatch seam: `adaln_quantize` (an adaLN-Zero producer's
output and its 8-bit row-wise codes in one pass; quant.producers is the reference), `gelu_quantize` (an FFN's GELU
and the codes of the linear it feeds), `glu_quantize` (a gated FFN's gate, likewise), `rms_quantize` (a weighted RMS
norm times its modulation: Z-Image) and their custom ops.

Implementations: reference (the stock module's torch ops, then the format's row-wise quantize); triton (one pass
over each row: solrl_triton.producers), on a GPU (or a simulated one under TRITON_INTERPRET=1) for rows of at
most 16384 FP32/BF16 values. The op is opaque to torch.compile on purpose: the fusion is explicit, not left to
inductor's choice (which on the H200 kept the FP8 quantize as a standalone reduction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from solrl_engine.kernels._gemm import no_autocast
from solrl_engine.kernels.dispatch import choose, ran, ran_with, record_run, register, run, triton_module
from solrl_engine.quant import producers
from solrl_engine.quant.formats import rowwise_formats

MAX_K = 16384  # solrl_triton.producers.MAX_K: whole rows in one program (not imported: Triton is optional)
HINT = "the fused producer's Triton kernel runs on a GPU for FP8/INT8 rows of at most 16384 FP32/BF16 values"
GELU_HINT = "the fused GELU's Triton kernel runs on a GPU for FP8/INT8 rows of at most 16384 FP32/BF16 values"
RMS_HINT = "the fused RMS norm's Triton kernel runs on a GPU for FP8/INT8 rows of at most 16384 FP32/BF16 values"
GLU_HINT = "the fused gate's Triton kernel runs on a GPU for FP8/INT8 rows of at most 16384 FP32/BF16 gated values"


def _ref(x: torch.Tensor, onep: torch.Tensor, shift: torch.Tensor, eps: float, fmt: str, fp32_norm: bool,
         out_dtype: torch.dtype | None, keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ran("reference")
    return producers.adaln_quantize(x, onep, shift, eps, fmt, fp32_norm, out_dtype)


def _tr(x: torch.Tensor, onep: torch.Tensor, shift: torch.Tensor, eps: float, fmt: str, fp32_norm: bool,
        out_dtype: torch.dtype | None, keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    natural = producers.adaln_dtype(x.dtype, onep.dtype, fp32_norm)
    stage_bf16 = natural == torch.bfloat16  # the module's ops in BF16 (no autocast): each step rounded to BF16
    out = triton_module("producers").adaln_quantize(x, onep, shift, eps, fmt, stage_bf16, out_dtype or natural,
                                                    keep_y)  # fmt: skip
    ran("triton: layer norm, modulation and row-wise quantize in one pass")
    return out


def _fits(device: torch.device, k: int, x_dtype: torch.dtype, modulation_dtype: torch.dtype, fp32_norm: bool,
          fmt: str, out_dtype: torch.dtype | None = None, **_: object) -> str | None:  # fmt: skip
    natural = producers.adaln_dtype(x_dtype, modulation_dtype, fp32_norm)
    why = _rows_fit("producer", k, fmt, x_dtype, natural, out_dtype or natural)
    if why is None and natural == torch.bfloat16 and modulation_dtype != torch.bfloat16:
        return "a BF16 producer with a modulation in another dtype runs on the reference"
    return why


register("adaln_quantize", {"reference": _ref, "triton": _tr}, fits={"triton": _fits})


@torch.library.custom_op("solrl::adaln_quantize", mutates_args=())
def adaln_quantize(
    x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor, eps: float, fmt: str, fp32_norm: bool,
    tag: str = "", out_dtype: torch.dtype | None = None, keep_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, codes, scales) for x [B, T, K] and a modulation [B, K]: y = layer_norm(x) * one_plus_scale + shift (as
    the stock adaLN-Zero module computes it; `fp32_norm`: the norm in FP32, as under autocast; cast to `out_dtype`
    where given, as a block that casts its modulated norm) and `fmt`'s row-wise codes and [B, T, 1] FP32 scales of
    that y. Through dispatch's choice for x's device and row length; `tag` records what ran (dispatch.runs).
    `keep_y` False: no op reads y (every consumer takes the codes: nn.producers), so it is not written (all NaN on
    the reference). A custom op: torch.compile keeps it whole, so the fusion never depends on inductor."""
    if fmt not in rowwise_formats():
        raise ValueError(f"adaln_quantize emits row-wise codes of {rowwise_formats()}; got {fmt!r}")
    backend = choose("adaln_quantize", x.device, k=x.shape[-1], x_dtype=x.dtype, modulation_dtype=one_plus_scale.dtype,
                     fp32_norm=fp32_norm, fmt=fmt, out_dtype=out_dtype)[0]  # fmt: skip
    return _recorded("adaln_quantize", backend, (x, one_plus_scale, shift, eps, fmt, fp32_norm, out_dtype, keep_y),
                     tag, HINT)  # fmt: skip


def _recorded(op: str, backend: str, args: tuple, tag: str, hint: str) -> tuple[torch.Tensor, ...]:
    """`op` run through `backend` outside autocast, its run recorded under `tag` (dispatch.runs) where one is given.
    `args` end with keep_y: where it is False the Triton kernels do not write y, the record says so, and the
    reference's y is all NaN, so that a reader the plan missed shows in every CPU test instead of stale memory."""
    got: list[tuple[torch.Tensor, ...]] = []

    def produce() -> torch.Tensor:
        out = run(op, backend, *args)
        if not args[-1]:
            ran_with("; codes alone (y unwritten)")
            out = (torch.full_like(out[0], float("nan")), *out[1:]) if backend == "reference" else out
        got.append(out)
        return got[0][0]

    with no_autocast(args[0]):
        if tag:
            record_run(tag, produce, args[0], hint)
        else:
            produce()
    return got[0]


@adaln_quantize.register_fake
def _(x, one_plus_scale, shift, eps, fmt, fp32_norm, tag="", out_dtype=None, keep_y=True):  # noqa: ANN001, ANN202
    y = x.new_empty(x.shape, dtype=out_dtype or producers.adaln_dtype(x.dtype, one_plus_scale.dtype, fp32_norm))
    codes = x.new_empty(x.shape, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    return y, codes, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _gelu_ref(x: torch.Tensor, fmt: str, prefix: torch.Tensor | None, keep_y: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ran("reference")
    return producers.gelu_quantize(x, fmt, prefix)


def _gelu_tr(x: torch.Tensor, fmt: str, prefix: torch.Tensor | None, keep_y: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    out = triton_module("producers").gelu_quantize(x, fmt, prefix, keep_y)
    ran("triton: GELU and row-wise quantize in one pass")
    return out


def _rows_fit(kernel: str, k: int, fmt: str, *dtypes: torch.dtype) -> str | None:
    """Why the fused `kernel` (one program per row, solrl_triton.producers) cannot take rows of `k` values in
    `dtypes` for `fmt`, or None."""
    if fmt not in ("fp8", "int8"):
        return f"the fused {kernel} kernel emits FP8 or INT8 codes, not {fmt}"
    if k > MAX_K:
        return f"the fused {kernel} kernel holds rows of at most {MAX_K} values; got {k}"
    if set(dtypes) - {torch.float32, torch.bfloat16}:
        return f"the fused {kernel} kernel reads and writes FP32 or BF16; got {', '.join(map(str, dtypes))}"
    return None


def _prefixed_fits(kernel: str, what: str) -> Callable[..., str | None]:
    """The `fits` of an activation kernel that may join a prefix (and, the gate, a second) of x's dtype: `what`."""

    def fits(device: torch.device, k: int, x_dtype: torch.dtype, fmt: str, prefix_dtype: torch.dtype | None = None,
             **_: object) -> str | None:  # fmt: skip
        if prefix_dtype not in (None, x_dtype):
            return f"the fused {kernel} kernel takes {what} of its input's dtype; got {prefix_dtype} beside {x_dtype}"
        return _rows_fit(kernel, k, fmt, x_dtype)

    return fits


register("gelu_quantize", {"reference": _gelu_ref, "triton": _gelu_tr},
         fits={"triton": _prefixed_fits("GELU", "a prefix")})


@torch.library.custom_op("solrl::gelu_quantize", mutates_args=())
def gelu_quantize(x: torch.Tensor, fmt: str, tag: str = "", prefix: torch.Tensor | None = None, keep_y: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales) for an FFN's pre-activation x [..., K]: y = gelu(x, approximate="tanh") in x's dtype (after
    `prefix` [..., KP] along the last dimension where given) and `fmt`'s row-wise codes and [..., 1] FP32 scales of
    y, for the linear y feeds. Through dispatch's choice; `tag` records what ran; `keep_y` as adaln_quantize's. A
    custom op, like adaln_quantize: the fusion never depends on inductor."""
    if fmt not in rowwise_formats():
        raise ValueError(f"gelu_quantize emits row-wise codes of {rowwise_formats()}; got {fmt!r}")
    k = x.shape[-1] + (0 if prefix is None else prefix.shape[-1])
    backend = choose("gelu_quantize", x.device, k=k, x_dtype=x.dtype, fmt=fmt,
                     prefix_dtype=x.dtype if prefix is None else prefix.dtype)[0]  # fmt: skip
    return _recorded("gelu_quantize", backend, (x, fmt, prefix, keep_y), tag, GELU_HINT)


@gelu_quantize.register_fake
def _(x, fmt, tag="", prefix=None, keep_y=True):  # noqa: ANN001, ANN202
    shape = (*x.shape[:-1], x.shape[-1] + (0 if prefix is None else prefix.shape[-1]))
    codes = x.new_empty(shape, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    return x.new_empty(shape), codes, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _glu_ref(x: torch.Tensor, fmt: str, gate_first: bool, prefix: torch.Tensor | None, second: torch.Tensor | None,
             keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ran("reference")
    return producers.glu_quantize(x, fmt, gate_first, prefix, second)


def _glu_tr(x: torch.Tensor, fmt: str, gate_first: bool, prefix: torch.Tensor | None, second: torch.Tensor | None,
            keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    out = triton_module("producers").glu_quantize(x, fmt, gate_first, prefix, second, keep_y)
    ran("triton: gate (a * silu(g)) and row-wise quantize in one pass")
    return out


register("glu_quantize", {"reference": _glu_ref, "triton": _glu_tr},
         fits={"triton": _prefixed_fits("gate", "a prefix and a second")})


@torch.library.custom_op("solrl::glu_quantize", mutates_args=())
def glu_quantize(x: torch.Tensor, fmt: str, tag: str = "", gate_first: bool = False,
                 prefix: torch.Tensor | None = None, second: torch.Tensor | None = None, keep_y: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales) for a gated FFN's x [..., 2H] = cat([a, g]) (cat([g, a]) with `gate_first`; with
    `second`, the halves are x and `second`, each [..., H]): y = a * silu(g) in x's dtype [..., H] (SANA's GLUMBConv
    gate, rows = pixels; FLUX.2's and Z-Image's SwiGLUs), after `prefix` [..., KP] along the last dimension where
    given, and `fmt`'s row-wise codes and [..., 1] FP32 scales of y, for the linear y feeds. Through dispatch's
    choice; `tag` records what ran; `keep_y` as adaln_quantize's. A custom op, like adaln_quantize."""
    if fmt not in rowwise_formats():
        raise ValueError(f"glu_quantize emits row-wise codes of {rowwise_formats()}; got {fmt!r}")
    if second is None and x.shape[-1] % 2:
        raise ValueError(f"glu_quantize gates the two halves of the last dimension; got an odd {x.shape[-1]}")
    if second is not None and second.shape != x.shape:
        raise ValueError(f"glu_quantize gates x with a second of its shape; got {tuple(second.shape)} beside "
                         f"{tuple(x.shape)}")  # fmt: skip
    h = x.shape[-1] if second is not None else x.shape[-1] // 2
    k = h + (0 if prefix is None else prefix.shape[-1])
    others = [v.dtype for v in (prefix, second) if v is not None and v.dtype != x.dtype]
    backend = choose("glu_quantize", x.device, k=k, x_dtype=x.dtype, fmt=fmt,
                     prefix_dtype=others[0] if others else None)[0]  # fmt: skip
    return _recorded("glu_quantize", backend, (x, fmt, gate_first, prefix, second, keep_y), tag, GLU_HINT)


@glu_quantize.register_fake
def _(x, fmt, tag="", gate_first=False, prefix=None, second=None, keep_y=True):  # noqa: ANN001, ANN202
    h = x.shape[-1] if second is not None else x.shape[-1] // 2
    shape = (*x.shape[:-1], h + (0 if prefix is None else prefix.shape[-1]))
    codes = x.new_empty(shape, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    return x.new_empty(shape), codes, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _rms_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None, fmt: str,
             keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ran("reference")
    return producers.rms_quantize(x, weight, eps, scale, fmt)


def _rms_tr(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None, fmt: str,
            keep_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    out = triton_module("producers").rms_quantize(x, weight, eps, scale, fmt, producers.rms_dtype(x, weight, scale),
                                                  keep_y)  # fmt: skip
    ran("triton: RMS norm, modulation and row-wise quantize in one pass")
    return out


def _rms_fits(device: torch.device, k: int, dtypes: tuple[torch.dtype, ...], fmt: str, **_: object) -> str | None:
    return _rows_fit("RMS norm", k, fmt, *dtypes)


register("rms_quantize", {"reference": _rms_ref, "triton": _rms_tr}, fits={"triton": _rms_fits})


@torch.library.custom_op("solrl::rms_quantize", mutates_args=())
def rms_quantize(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None, fmt: str,
                 tag: str = "", keep_y: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales) for x [B, T, K], an RMS norm's weight [K] (or none) and a modulation scale [B, K] (or
    none): y = RMSNorm(x) * scale as diffusers' RMSNorm and Z-Image's block compute it, and `fmt`'s row-wise codes
    and [B, T, 1] FP32 scales of y. Through dispatch's choice; `tag` records what ran; `keep_y` as adaln_quantize's.
    A custom op, like adaln_quantize."""
    if fmt not in rowwise_formats():
        raise ValueError(f"rms_quantize emits row-wise codes of {rowwise_formats()}; got {fmt!r}")
    dtypes = (x.dtype, producers.rms_dtype(x, weight, scale), *(v.dtype for v in (weight, scale) if v is not None))
    backend = choose("rms_quantize", x.device, k=x.shape[-1], dtypes=dtypes, fmt=fmt)[0]
    return _recorded("rms_quantize", backend, (x, weight, eps, scale, fmt, keep_y), tag, RMS_HINT)


@rms_quantize.register_fake
def _(x, weight, eps, scale, fmt, tag="", keep_y=True):  # noqa: ANN001, ANN202
    codes = x.new_empty(x.shape, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    y = x.new_empty(x.shape, dtype=producers.rms_dtype(x, weight, scale))
    return y, codes, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
