"""Regenerate te_nvfp4_golden.safetensors: inputs and NVIDIA Transformer Engine's NVFP4 reference
quantizer outputs (codes, block scales) for every input family, to test our reference against in CI,
where TE cannot be installed.

    python tests/data/make_te_golden.py                    # with transformer_engine installed
    python tests/data/make_te_golden.py --te-src DIR       # DIR holds TE's reference_nvfp4.py
                                                           # importable on its own (imports stubbed)

The file in the repo was made with TE commit d0067d0da6cb01811b8072a7d304f0e00344ce2b,
transformer_engine/pytorch/custom_recipes/reference_nvfp4.py (NVFP4QuantizerRef), on CPU.
Nothing of TE is committed here: only its outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from families import families  # noqa: E402

SHAPES = [(16, 128), (5, 48)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
STATIC_AMAX = 2.5


def _te_reference(te_src: str | None):
    if te_src:
        sys.path.insert(0, te_src)
        import reference_nvfp4  # type: ignore[import-not-found]
        import reference_utils  # type: ignore[import-not-found]
    else:
        from transformer_engine.pytorch.custom_recipes import reference_nvfp4, reference_utils
    q = reference_nvfp4.NVFP4QuantizerRef(
        dtype=reference_utils.Fp4Formats.E2M1,
        rowwise=True,
        columnwise=False,
        pow_2_scales=False,
        eps=0.0,
        quant_tile_shape=(1, 16),
    )

    def quantize(x2d: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qx, sx = q._quantize_blockwise_reference(x2d, amax.view(1), 16, 1, pow_2_scales=False, eps=0.0)
        return qx.view(torch.uint8), sx.view(torch.uint8)

    return quantize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--te-src", help="directory with TE's reference_nvfp4.py and reference_utils.py")
    ap.add_argument("--out", default=str(HERE / "te_nvfp4_golden.safetensors"))
    args = ap.parse_args()
    quantize = _te_reference(args.te_src)
    tensors: dict[str, torch.Tensor] = {}
    for si, shape in enumerate(SHAPES):
        for kind, x in families(shape, seed=100 + si):
            for dn, dtype in DTYPES.items():
                xd = x.to(dtype)
                key = f"{kind}.{dn}.s{si}"
                tensors[f"{key}.x"] = xd
                for an, amax in (("dyn", xd.float().abs().amax()), ("static", torch.tensor(STATIC_AMAX))):
                    codes, scales = quantize(xd, amax.float())
                    tensors[f"{key}.{an}.codes"] = codes.contiguous()
                    tensors[f"{key}.{an}.scales"] = scales.contiguous()
    save_file(
        tensors,
        args.out,
        metadata={"te_commit": "d0067d0da6cb01811b8072a7d304f0e00344ce2b", "static_amax": str(STATIC_AMAX)},
    )
    print(f"wrote {len(tensors)} tensors to {args.out}")


if __name__ == "__main__":
    main()
