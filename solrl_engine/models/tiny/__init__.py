"""The bundled default model (see MODEL_CARD.md beside this file)."""

from solrl_engine.models import ModelSpec
from solrl_engine.models.sd3 import SD3_BLOCKS, SD3_EXPLORE_RULE, SD3_LORA_TARGETS
from solrl_engine.models.sd3 import SPEC as SD3_SPEC
from solrl_engine.models.tiny.model import TinyConfig, TinyT2I, load_tiny

# The real SD3 class at a tiny size, so it takes SD3's LoRA targets and SD3's explore rule (the
# image-stream MLPs in NVFP4: Sol-RL's rule; 12 of its 88 linears). Its schedule is its own.
SPEC = ModelSpec(
    name="tiny",
    adapter="solrl_engine.models.tiny.model:load_tiny",
    pipeline="StableDiffusion3Pipeline",
    default_path=None,
    resolution=32,
    lora_targets=SD3_LORA_TARGETS,
    explore_rule=SD3_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=1.0,
    repeated_blocks=SD3_BLOCKS,
    producers=SD3_SPEC.producers,  # SD3's blocks: the same producers in an 8-bit explore copy
    producer_blocks=SD3_SPEC.producer_blocks,
)

__all__ = ["SPEC", "TinyConfig", "TinyT2I", "load_tiny"]
