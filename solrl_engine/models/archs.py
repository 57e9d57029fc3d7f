"""Full-size denoiser architectures (SD3.5-Large, FLUX.1-dev, SANA-1.6B) behind the FlowModel interface.

For speed benchmarks: the transformers are built from their published configs with random weights
(speed does not depend on trained weights) or loaded from a hub id / local path with `pretrained`.
Text encoding is a stand-in: a deterministic random conditioning of the right shape per prompt (no
T5/CLIP/Gemma here), and `decode` is a fixed random projection of the latents to a 32x32 RGB image
(no VAE), so a benchmark times the denoiser, which is where rollouts spend their time; the note of
any result says so. Training real models needs the real encoders and VAE: not this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from solrl_engine.models.base import Conditioning


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: its diffusers class, published config, latent layout and text shapes."""

    cls: str
    config: dict[str, Any]
    latent_channels: int
    downsample: int  # pixels per latent cell (VAE factor)
    text_tokens: int
    resolution: int  # the paper's resolution for it
    hub_id: str
    extra: dict[str, Any] = field(default_factory=dict)

    def text_dims(self, cfg: dict[str, Any]) -> tuple[int, int]:
        """(hidden width, pooled width) of the conditioning the transformer expects."""
        if self.cls == "SanaTransformer2DModel":
            return cfg["caption_channels"], 1
        return cfg["joint_attention_dim"], cfg["pooled_projection_dim"]


ARCHS: dict[str, ArchSpec] = {
    "sd35-large": ArchSpec(
        "SD3Transformer2DModel",
        dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
             num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
             pooled_projection_dim=2048, pos_embed_max_size=192, qk_norm="rms_norm"),
        latent_channels=16, downsample=8, text_tokens=333, resolution=1024,
        hub_id="stabilityai/stable-diffusion-3.5-large",
    ),
    "flux-dev": ArchSpec(
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        latent_channels=16, downsample=8, text_tokens=512, resolution=512,
        hub_id="black-forest-labs/FLUX.1-dev", extra={"guidance": 3.5},
    ),
    "sana-1.6b": ArchSpec(
        "SanaTransformer2DModel",
        dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
             num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
             caption_channels=2304, mlp_ratio=2.5, sample_size=32, patch_size=1, norm_elementwise_affine=False,
             norm_eps=1e-6),
        latent_channels=32, downsample=32, text_tokens=300, resolution=1024,
        hub_id="Efficient-Large-Model/Sana_1600M_1024px_diffusers",
    ),
}  # fmt: skip


class ArchModel(nn.Module):
    """A FlowModel over one of ARCHS (see the module docstring for what is real and what is not)."""

    def __init__(self, name: str, resolution: int | None = None, overrides: dict[str, Any] | None = None,
                 pretrained: str | None = None) -> None:  # fmt: skip
        super().__init__()
        if name not in ARCHS:
            raise ValueError(f"unknown architecture {name!r}; choose one of {sorted(ARCHS)}")
        import diffusers

        self.name, self.spec = name, ARCHS[name]
        self.cfg = {**self.spec.config, **(overrides or {})}
        cls = getattr(diffusers, self.spec.cls)
        if pretrained:  # a hub id or a local pipeline directory
            self.transformer = cls.from_pretrained(pretrained, subfolder="transformer")
        else:
            self.transformer = cls(**self.cfg)
        res = resolution or self.spec.resolution
        side = res // self.spec.downsample
        self.latent_shape = (self.spec.latent_channels, side, side)
        self.hidden_dim, self.pooled_dim = self.spec.text_dims(self.cfg)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("to_rgb", torch.randn(3, self.spec.latent_channels, generator=g) * 0.3)

    @property
    def _device(self) -> torch.device:
        return self.to_rgb.device

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """A stand-in text encoder: N(0, 1) conditioning seeded by each prompt's hash."""
        hs, ps = [], []
        for p in prompts:
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little") % 2**63
            g = torch.Generator().manual_seed(seed)
            hs.append(torch.randn(self.spec.text_tokens, self.hidden_dim, generator=g))
            ps.append(torch.randn(self.pooled_dim, generator=g))
        dtype = next(self.transformer.parameters()).dtype
        return Conditioning(torch.stack(hs).to(self._device, dtype), torch.stack(ps).to(self._device, dtype))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: nn.Module | None = None
                 ) -> torch.Tensor:  # fmt: skip
        net = transformer or self.transformer
        b = x.shape[0]
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(b)
        hidden = cond.hidden.to(x.dtype)
        if self.spec.cls == "SD3Transformer2DModel":
            return net(hidden_states=x, encoder_hidden_states=hidden, pooled_projections=cond.pooled.to(x.dtype),
                       timestep=t * 1000, return_dict=False)[0]  # fmt: skip
        if self.spec.cls == "SanaTransformer2DModel":
            return net(hidden_states=x, encoder_hidden_states=hidden, timestep=t * 1000, return_dict=False)[0]
        # FLUX: 2x2 patches packed into tokens, positional ids, distilled guidance as an input
        c, h, w = x.shape[1:]
        tokens = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
        ids[..., 1] = torch.arange(h // 2, device=x.device)[:, None]
        ids[..., 2] = torch.arange(w // 2, device=x.device)[None, :]
        txt_ids = torch.zeros(hidden.shape[1], 3, device=x.device)
        guidance = torch.full((b,), self.spec.extra["guidance"], device=x.device)
        pooled = cond.pooled.to(x.dtype)
        out = net(hidden_states=tokens, encoder_hidden_states=hidden, pooled_projections=pooled, timestep=t,
                  img_ids=ids.reshape(-1, 3), txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]  # fmt: skip
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A stand-in VAE: fixed projection to RGB, pooled to 32x32, in [0, 1]."""
        rgb = torch.einsum("oc,bchw->bohw", self.to_rgb.float(), x.float())
        return torch.sigmoid(F.adaptive_avg_pool2d(rgb, 32))


def load_arch(name: str, path: str | None = None, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16) -> ArchModel:  # fmt: skip
    """ARCHS[name] with random weights (or `path`: a hub id / local pipeline dir) on `device`."""
    with torch.device(device):
        m = ArchModel(name, pretrained=path)
    return m.to(device=device, dtype=dtype).eval()
