"""Flow-matching sampling: sigma schedules, per-seed initial noise, ODE solvers.

Initial noise comes from the integer seed alone (one generator per seed), so a seed gives the same
latent whatever the batch, device or precision: the BF16 regeneration of a seed is the twin of its
quantized preview.
"""

from solrl_engine.sampling.graphed import GraphedSampler
from solrl_engine.sampling.sampler import SOLVERS, sample, seeded_noise, sigma_schedule  # sigma_schedule: models.base

__all__ = ["SOLVERS", "GraphedSampler", "sample", "seeded_noise", "sigma_schedule"]
