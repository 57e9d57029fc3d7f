"""The one interface every text-to-image flow model presents to the sampler and the trainer.

Flow-matching convention (SD3 / FLUX / SANA): x_t = (1 - t) x_0 + t * noise, t in [0, 1], the model
predicts the velocity v = noise - x_0; t = 1 is pure noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Conditioning:
    """Encoded prompts, batch-first; sliceable so samplers can chunk a batch."""

    hidden: torch.Tensor
    pooled: torch.Tensor

    def __getitem__(self, idx: slice | torch.Tensor) -> Conditioning:
        return Conditioning(self.hidden[idx], self.pooled[idx])

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def to(self, *args: object, **kw: object) -> Conditioning:
        return Conditioning(self.hidden.to(*args, **kw), self.pooled.to(*args, **kw))

    @staticmethod
    def cat(items: list[Conditioning]) -> Conditioning:
        return Conditioning(torch.cat([c.hidden for c in items]), torch.cat([c.pooled for c in items]))


@runtime_checkable
class FlowModel(Protocol):
    """What sampling and RL need from a model."""

    latent_shape: tuple[int, int, int]

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...

    transformer: torch.nn.Module

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Velocity at flow time t; `transformer` runs another copy of the denoiser (same I/O)."""
        ...

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1]."""
        ...
