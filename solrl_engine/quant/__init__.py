"""Number formats in pure PyTorch: the numerics spec and the oracle for every kernel.

Imports nothing from the rest of the engine.
"""

from solrl_engine.quant import fp8, int8, nvfp4
from solrl_engine.quant.formats import Numerics, all_numerics, numerics
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.int8 import Int8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor
from solrl_engine.quant.recipe import RECIPES, QuantRecipe, get_recipe

__all__ = ["fp8", "int8", "nvfp4", "Numerics", "all_numerics", "numerics", "FP8Tensor", "Int8Tensor", "NVFP4Tensor",
           "QuantRecipe", "RECIPES", "get_recipe"]
