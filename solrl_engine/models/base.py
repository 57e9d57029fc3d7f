"""The one interface every text-to-image flow model presents to the sampler and the trainer.

Flow-matching convention (SD3 / FLUX / SANA): x_t = (1 - t) x_0 + t * noise, t in [0, 1], the model
predicts the velocity v = noise - x_0; t = 1 is pure noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# A reward: images [B, 3, H, W] in [0, 1] and their prompts -> one score each, Tensor[B]. Here, beside the
# model interface, so the rollouts and the explorer can name it without importing the reward registry.
RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]


@dataclass
class Conditioning:
    """Encoded prompts, batch-first; sliceable so samplers can chunk a batch.

    hidden: per-token text states [B, L, D]; pooled: a pooled vector [B, P] (SD3, FLUX; None for
    SANA); mask: the text attention mask [B, L] (SANA; None where the model attends to every token);
    image: the encoded image a conditioned prompt carries, per row (an edit's source latents: FLUX.1 Kontext; an
    image-to-video's first frame as the model's condition channels: Wan I2V); image_states: that image's encoder
    states (Wan I2V's CLIP tokens). Classifier-free guidance keeps both (`against`). negative_hidden and
    negative_mask: each row's own unconditional text states, where a family encodes the negative prompt together with
    the prompt's image (Qwen-Image-Edit reads the source through its text encoder), so no one unconditional row
    serves every prompt; `against` takes them instead of the shared row. Rows of different text lengths, each with
    its mask, concatenate padded to the longest (`cat`).
    """

    hidden: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    image: torch.Tensor | None = None
    image_states: torch.Tensor | None = None
    negative_hidden: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Conditioning:
        """The same conditioning with `fn` applied to every tensor it holds."""
        return Conditioning(*(None if t is None else fn(t) for t in self._fields()))  # type: ignore[arg-type]

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._fields() if t is not None]

    def against(self, cond: Conditioning) -> Conditioning:
        """This unconditional row broadcast to `cond`'s rows, each with `cond`'s image: guidance drops the text,
        never the image an edit or a clip starts from (the stock editing and image-to-video pipelines guide so).
        Rows that carry their own negative (`negative_hidden`) guide against it instead of this row."""
        u = self.expand(len(cond))
        if cond.negative_hidden is not None:
            return Conditioning(cond.negative_hidden, u.pooled, cond.negative_mask, cond.image, cond.image_states)
        if cond.image is None and cond.image_states is None:
            return u
        return Conditioning(u.hidden, u.pooled, u.mask, cond.image, cond.image_states)

    def __getitem__(self, idx: slice | torch.Tensor) -> Conditioning:
        return self.map(lambda t: t[idx])

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def to(self, *args: object, **kw: object) -> Conditioning:
        """Moves/casts the float tensors; the masks keep their integer dtype."""
        dev = [a for a in args if not isinstance(a, torch.dtype)]
        dev_kw = {k: v for k, v in kw.items() if k != "dtype"}
        moved = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t = t.to(*dev, **dev_kw) if f.name.endswith("mask") else t.to(*args, **kw)  # masks stay integer
            moved[f.name] = t
        return Conditioning(**moved)

    def repeat_interleave(self, n: int) -> Conditioning:
        """Each row n times in a row (prompt-major order, as seeds are laid out)."""
        return self.map(lambda t: t.repeat_interleave(n, 0))

    def expand(self, b: int) -> Conditioning:
        """One row broadcast to b rows (the unconditional embedding for a batch)."""
        return self.map(lambda t: t.expand(b, *t.shape[1:]))

    @staticmethod
    def cat(items: list[Conditioning]) -> Conditioning:
        first = items[0]
        if first.image is not None and len({tuple(c.image.shape[1:]) for c in items}) > 1:  # type: ignore[union-attr]
            sizes = sorted({tuple(c.image.shape[1:]) for c in items})  # type: ignore[union-attr]
            raise ValueError(f"conditioned prompts of one batch encode to images of different sizes {sizes}: give "
                             "the images of a prompt set one size")  # fmt: skip
        items = _pad_text(items, "hidden", "mask") if first.mask is not None else items
        items = _pad_text(items, "negative_hidden", "negative_mask") if first.negative_mask is not None else items
        return Conditioning(*(None if f is None else torch.cat([c._fields()[i] for c in items])  # type: ignore[misc]
                              for i, f in enumerate(first._fields())))


def _pad_text(items: list[Conditioning], hidden: str, mask: str) -> list[Conditioning]:
    """Rows whose text states differ in length, zero-padded (states and mask) to the longest: a family that caches
    each prompt at its own length (Qwen-Image-Edit: its source's vision tokens make a fixed pad length costly)."""
    n = max(getattr(c, hidden).shape[1] for c in items)
    if all(getattr(c, hidden).shape[1] == n for c in items):
        return items
    out = []
    for c in items:
        h, m = getattr(c, hidden), getattr(c, mask)
        grow = n - h.shape[1]
        out.append(dataclasses.replace(c, **{hidden: torch.nn.functional.pad(h, (0, 0, 0, grow)),
                                             mask: torch.nn.functional.pad(m, (0, grow))}))  # fmt: skip
    return out


def input_dtype(net: torch.nn.Module) -> torch.dtype:
    """The dtype a denoiser's inputs are cast to: that of its frozen base weights (a LoRA's FP32
    weights, kept so for the optimizer, do not count). A stock diffusers pipeline casts its latents
    to the transformer's dtype the same way, so a BF16 model called with FP32 latents outside
    autocast computes in BF16 instead of failing in its first layer; under autocast the cast is the
    one autocast would make, so results are unchanged. Modules a diffusers model keeps in FP32 whatever its
    dtype (`_keep_in_fp32_modules`: Wan's time embedder and modulation tables) do not count either."""
    kept = tuple(getattr(net, "_keep_in_fp32_modules", None) or ())
    for name, p in net.named_parameters():
        if p.is_floating_point() and "lora_" not in name and not any(k in name.split(".") for k in kept):
            return p.dtype
    return torch.get_default_dtype()


@runtime_checkable
class FlowModel(Protocol):
    """What sampling and RL need from a model."""

    latent_shape: tuple[int, ...]

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

    def sigmas(self, steps: int, shift: float | None = None) -> torch.Tensor:
        """steps + 1 flow times from 1 (noise) to 0 (image): the model's own schedule (shift: override)."""
        ...


def sigma_schedule(steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """steps + 1 flow times from 1 (noise) to 0 (image), with SD3's shift t' = s t / (1 + (s - 1) t). Here,
    beside the flow convention it encodes, so a model's own `sigmas` can use it (sampling re-exports it)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    t = shift * t / (1 + (shift - 1) * t)
    return t.to(device=device, dtype=torch.float32)
