"""solrl-engine: Sol-RL post-training of text-to-image diffusion models.

Explore a large rollout group cheaply in NVFP4 (or FP8), keep the most contrastive seeds,
regenerate only those in BF16, train on them. See docs/design.md for the layout.
"""

__version__ = "0.1.0"
