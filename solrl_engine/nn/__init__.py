"""Drop-in module API: quantize_model(), requantize_() and QuantLinear.

Never imports Triton or the extension directly: all numerics go through solrl_engine.kernels.
"""

from solrl_engine.nn.fast_path import FastPathRecord, fast_path, reset_fast_path
from solrl_engine.nn.quant_linear import QuantConv1x1, QuantLinear
from solrl_engine.nn.quantize import LayerDecision, QuantReport, plan_quantization, quantize_model, requantize_

__all__ = [
    "FastPathRecord",
    "fast_path",
    "reset_fast_path",
    "QuantConv1x1",
    "QuantLinear",
    "QuantReport",
    "LayerDecision",
    "plan_quantization",
    "quantize_model",
    "requantize_",
]
