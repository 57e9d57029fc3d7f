"""Transformer Engine as a peer explore backend: the same layers through TE's NVFP4 recipe.

`to_te_(model, recipe)` swaps the layers `quantize_model` would quantize for `te.Linear` (same
weights) and `TEAutocast` runs the model under `te.fp8_autocast(NVFP4BlockScaling())`. TE quantizes
weights itself on every forward, so refreshing the copy after an update is a weight copy
(`refresh_te_`). Selected by `explore_precision="te_nvfp4"`; it exists to compare our kernels with
NVIDIA's on the same model (numerics: docs/design.md section 4 follows TE's recipe; TE applies 2D
weight scaling and Hadamard transforms where its recipe says so, so outputs are close, not equal).
Needs `pip install -e ".[te]"` and a GPU TE supports for NVFP4.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from solrl_engine.nn.quantize import LayerDecision, QuantReport, _decide
from solrl_engine.quant.recipe import QuantRecipe, get_recipe


def te_unavailable_reason() -> str | None:
    """None when TE's NVFP4 recipe can be used here, else why not (with the fix)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.common import recipe as te_recipe
    except Exception as e:  # noqa: BLE001 - any failure to import means unavailable, with its reason
        why = f"{type(e).__name__}: {e}"
        return f"transformer_engine is not importable ({why}); pip install -e '.[te]' on a GPU machine"
    if not hasattr(te_recipe, "NVFP4BlockScaling"):
        return "this transformer_engine has no NVFP4BlockScaling recipe; upgrade transformer-engine"
    if not torch.cuda.is_available():
        return "Transformer Engine runs on CUDA devices only"
    return None


class TEAutocast(nn.Module):
    """Runs the wrapped module under TE's NVFP4 block-scaling autocast."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        from transformer_engine.common import recipe as te_recipe

        self.module = module
        self.te_recipe = te_recipe.NVFP4BlockScaling()

    def forward(self, *args: object, **kw: object) -> object:
        import transformer_engine.pytorch as te

        with te.fp8_autocast(enabled=True, fp8_recipe=self.te_recipe):
            return self.module(*args, **kw)


@torch.no_grad()
def to_te_(model: nn.Module, recipe: str | QuantRecipe = "nvfp4") -> QuantReport:
    """Replace the eligible nn.Linear layers of `model` by te.Linear in place (same layer choice as
    quantize_model with `recipe`); returns the report of every decision."""
    reason = te_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"explore_precision 'te_nvfp4': {reason}")
    import transformer_engine.pytorch as te

    rec = get_recipe(recipe)
    report = QuantReport(rec)
    for name, lin in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        why = _decide(name, lin.in_features, lin.out_features, rec) or (
            None if lin.in_features % 32 == 0 else "in_features % 32 != 0 (TE NVFP4; 1x1 convolutions stay as they are)"
        )
        report.layers.append(LayerDecision(name, lin.in_features, lin.out_features, why is None, why or "te_nvfp4"))
        if why:
            continue
        new = te.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        params_dtype=lin.weight.dtype, device=lin.weight.device)  # fmt: skip
        new.weight.copy_(lin.weight)
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return report


@torch.no_grad()
def refresh_te_(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> int:
    """Copy updated weights ({"<layer>.weight": tensor}) into the model's layers in place."""
    params = dict(model.named_parameters())
    for key, w in weights.items():
        if key not in params:
            raise KeyError(f"{key} is not a parameter of the TE explore copy")
        if params[key].shape != w.shape:
            raise ValueError(f"{key}: shape {tuple(w.shape)} does not fit {tuple(params[key].shape)}")
    for key, w in weights.items():
        params[key].copy_(w)
    return len(weights)
