"""Triton kernels for NVFP4 and FP8 (quantize, dequantize, fake-quant).

Imported lazily by solrl_engine.kernels; importing this package requires Triton. On CPU the
kernels run under TRITON_INTERPRET=1 (set before the first import).
"""
