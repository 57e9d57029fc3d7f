"""One handler per format: every format has its part in each layer (quant numerics, kernels row, nn handler,
models rule), the format tables derive from those parts, and a new format is added by its modules alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from solrl_engine import kernels
from solrl_engine.explore import choice, plan
from solrl_engine.kernels.capability import FormatKernels, format_kernels
from solrl_engine.models.formats import FormatRule, format_rules
from solrl_engine.nn import QuantLinear, quantize_model
from solrl_engine.nn.formats import LinearFormat, handlers
from solrl_engine.quant.formats import Numerics, all_numerics
from solrl_engine.quant.recipe import FORMATS, RECIPES

ROOT = Path(__file__).resolve().parents[1]


def test_every_format_has_every_part():
    names = set(all_numerics())
    assert names == {"nvfp4", "fp8", "int8", "bf16"}
    assert set(format_kernels()) == names, "a format without its kernels part (kernels/<fmt>.py KERNELS)"
    assert set(handlers()) == names, "a format without its nn handler (nn/formats/<fmt>.py HANDLER)"
    assert set(format_rules()) == names, "a format without its layer rule (models/formats/<fmt>.py RULE)"
    for name in names:
        assert isinstance(all_numerics()[name], Numerics) and all_numerics()[name].name == name
        k = format_kernels()[name]
        assert isinstance(k, FormatKernels) and k.format == name
        assert (k.tensor_cores is None) == (not all_numerics()[name].quantized)  # only BF16 has no row
        assert k.linear_op is None or k.linear_op in kernels.dispatch.ops()
        assert isinstance(handlers()[name], LinearFormat) and handlers()[name].format == name
        assert isinstance(format_rules()[name], FormatRule) and format_rules()[name].why


def test_the_format_tables_derive_from_the_parts():
    assert FORMATS == tuple(all_numerics()) == ("nvfp4", "fp8", "int8", "bf16")
    assert set(RECIPES) == {r for f in all_numerics().values() for r in f.recipe_names}
    assert list(kernels.TENSOR_CORES) == ["nvfp4", "fp8", "int8"]  # fastest first
    assert choice.EXPLORE_CANDIDATES == ("nvfp4", "nvfp4_weight_only", "fp8", "fp8_weight_only", "int8")
    assert plan.EXPLORE_PRECISIONS == ("auto", *choice.EXPLORE_CANDIDATES, "bf16", "te_nvfp4")
    rht = [p for p in plan.EXPLORE_PRECISIONS if plan.option_applies("rht", p)]
    assert rht == ["auto", "nvfp4", "nvfp4_weight_only"]  # NVFP4's options apply to NVFP4's recipes and auto
    rep = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 96)), "fp8")
    assert rep.weight_bytes() == (2 * 64 * 96, all_numerics()["fp8"].stored_bytes(64, 96))


def test_quant_linear_delegates_to_its_formats_handler(monkeypatch):
    """QuantLinear's set_weight_, weight and forward each go through the format's handler (counted), and a layer of
    every format matches nn.Linear within its format's error."""
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(5, 64)
    for name, h in handlers().items():
        calls: list[str] = []
        for meth in ("set_weight_", "weight", "linear"):
            orig = getattr(type(h), meth)

            def counted(self, *a, _orig=orig, _m=meth, _calls=calls, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
                _calls.append(_m)
                return _orig(self, *a, **kw)

            monkeypatch.setattr(type(h), meth, counted)
        q = QuantLinear.from_linear(lin, name)
        y = q(x)
        w = q.weight
        assert calls == ["set_weight_", "linear", "weight"], (name, calls)
        tol = {"nvfp4": 0.3, "fp8": 0.08, "int8": 0.05, "bf16": 0.01}[name]
        ref = lin(x)
        assert (y - ref).norm() / ref.norm() < tol, name
        assert (w - lin.weight).norm() / lin.weight.norm() < tol, name
        monkeypatch.undo()


# A whole format written as its four parts (an FP16-weight format with a reference GEMM), dropped into a copy of
# the package: nothing else is edited, and every table and path of the engine picks it up.
TOY = {
    "quant/fp16.py": '''
        from solrl_engine.quant.formats import Numerics
        NUMERICS = Numerics("fp16", "FP16", 16, lambda k, n: 2 * k * n)
    ''',
    "kernels/fp16.py": '''
        import torch
        from solrl_engine.kernels.capability import FormatKernels, TensorCores
        from solrl_engine.kernels.dispatch import ran, register

        def _ref(x, w, bias, out):
            ran("reference")
            y = x.float() @ w.float().t() + (0 if bias is None else bias.float())
            return y.to(out)

        register("fp16_linear", {"reference": _ref})
        KERNELS = FormatKernels("fp16", TensorCores("FP16", (7, 0), cpu_op=True, nominal_speedup=1.0), "fp16_linear")
    ''',
    "nn/formats/fp16.py": '''
        import torch
        from solrl_engine.kernels import dispatch
        from solrl_engine.nn.formats import LinearFormat

        class FP16Linear(LinearFormat):
            format = "fp16"
            def buffers(self, layer, device):
                layer.register_buffer("w_fp16", torch.zeros(layer.out_features, layer.in_features,
                                                            dtype=torch.float16, device=device))
            def stored(self, layer):
                return layer.w_fp16
            def set_weight_(self, layer, w):
                layer.w_fp16.copy_(w)
            def weight(self, layer):
                return layer.w_fp16.float()
            def linear(self, layer, x, backend, out):
                return dispatch.record_run(layer.kernel_tag, lambda: dispatch.run(
                    "fp16_linear", backend, x, layer.w_fp16, layer.bias, out), x)

        HANDLER = FP16Linear()
    ''',
    "models/formats/fp16.py": '''
        from solrl_engine.models.formats import FormatRule
        RULE = FormatRule("fp16", {"include": (), "skip_max_dim": 0}, "a toy: every eligible layer")
    ''',
}

CHECK = '''
import torch
from solrl_engine import kernels
from solrl_engine.explore import choice, plan
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import model_spec
from solrl_engine.nn import fast_path, quantize_model
from solrl_engine.quant.recipe import FORMATS, RECIPES

assert FORMATS == ("nvfp4", "fp8", "int8", "bf16", "fp16"), FORMATS
assert "fp16" in RECIPES and "fp16_weight_only" in RECIPES
assert list(kernels.TENSOR_CORES) == ["nvfp4", "fp8", "int8", "fp16"]
assert kernels.formats_with_tensor_cores((8, 0)) == ("int8", "fp16")
assert "fp16" in choice.EXPLORE_CANDIDATES and "fp16_weight_only" in plan.EXPLORE_PRECISIONS
assert model_spec("sana").explore_rule_by_format["fp16"] == {"include": (), "skip_max_dim": 0}
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
x = torch.randn(3, 64)
ref = m(x)
copy = ExploreCopy(m, "fp16")
rep = copy.report
assert rep.quantized == ["0", "2"] and rep.weight_bytes()[1] == 2 * (64 * 64 + 64 * 32), rep
y = copy.transformer(x)
assert (y - ref).abs().max() < 1e-2, (y - ref).abs().max()
assert {n: r.impl for n, r in fast_path(copy.transformer).layers.items()} == {"0": "reference", "2": "reference"}
print("toy format ok")
'''


def test_a_new_format_is_its_parts_and_nothing_else(tmp_path):
    pkg = tmp_path / "solrl_engine"
    shutil.copytree(ROOT / "solrl_engine", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.so"))
    for rel, src in TOY.items():
        (pkg / rel).write_text(textwrap.dedent(src))
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "toy format ok" in out.stdout


def test_attention_formats_are_the_formats_with_an_attention_rounding():
    from solrl_engine.explore.plan import ExploreSettings
    from solrl_engine.quant.formats import attention_formats

    assert attention_formats() == ("bf16", "fp8", "int8")
    assert {f: format_kernels()[f].attention_op for f in ("fp8", "int8")} == {"fp8": "fp8_attention",
                                                                              "int8": "int8_attention"}
    assert ExploreSettings(precision="fp8", attention="int8").problems() == []
    (field, why), = ExploreSettings(precision="fp8", attention="fp4").problems()
    assert field == "attention" and "fp8 or int8" in why
