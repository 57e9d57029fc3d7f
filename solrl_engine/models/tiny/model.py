"""The bundled tiny text-to-image model: a small diffusers SD3Transformer2DModel (the MMDiT of SD3.5)
in 32x32 RGB pixel space, with a small text encoder trained alongside. Because it is the real SD3
class, it goes through the same adapter, LoRA targets and quantization rules as SD3.5.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from solrl_engine.models.base import Conditioning, input_dtype, sigma_schedule
from solrl_engine.models.tiny.text import TinyTextEncoder, WordTokenizer

WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass
class TinyConfig:
    image_size: int = 32
    patch_size: int = 4
    num_layers: int = 6
    heads: int = 4
    head_dim: int = 32
    text_dim: int = 64
    text_layers: int = 2
    max_len: int = 16
    qk_norm: str | None = "rms_norm"


class TinyT2I(nn.Module):
    """Text encoder + SD3 transformer; pixel space in [-1, 1]."""

    MODEL = "tiny"  # its name in solrl_engine.models.MODELS (the config key `model`)

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.config = config or TinyConfig()
        c = self.config
        self.tokenizer = WordTokenizer(max_len=c.max_len)
        self.text_encoder = TinyTextEncoder(len(self.tokenizer), c.text_dim, c.text_layers, 4, c.max_len)
        self.transformer = SD3Transformer2DModel(
            sample_size=c.image_size,
            patch_size=c.patch_size,
            in_channels=3,
            num_layers=c.num_layers,
            attention_head_dim=c.head_dim,
            num_attention_heads=c.heads,
            joint_attention_dim=c.text_dim,
            caption_projection_dim=c.heads * c.head_dim,
            pooled_projection_dim=c.text_dim,
            out_channels=3,
            pos_embed_max_size=c.image_size // c.patch_size,
            qk_norm=c.qk_norm,
        )
        self.latent_shape = (3, c.image_size, c.image_size)

    @property
    def tokens_per_sample(self) -> int:
        """Image tokens per sample (patches), as PipelineFlowModel.tokens_per_sample."""
        return (self.config.image_size // self.config.patch_size) ** 2

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        ids = self.tokenizer(list(prompts)).to(self.device)
        hidden, pooled = self.text_encoder(ids)
        return Conditioning(hidden, pooled)

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: nn.Module | None = None
    ) -> torch.Tensor:
        """Predicted velocity (noise - x0) at flow time t in [0, 1] (scalar or [B]); `transformer`
        swaps in another copy of the denoiser (e.g. the quantized explore copy). `x` is cast to the
        denoiser's dtype first, as a stock diffusers pipeline casts its latents (see `input_dtype`)."""
        net = transformer or self.transformer
        x = x.to(input_dtype(net))
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        return net(
            hidden_states=x,
            encoder_hidden_states=cond.hidden.to(x.dtype),
            pooled_projections=cond.pooled.to(x.dtype),  # type: ignore[union-attr]
            timestep=t * 1000,
            return_dict=False,
        )[0]

    @staticmethod
    def sigmas(steps: int, shift: float | None = None) -> torch.Tensor:
        """The linear flow schedule (pretraining drew t uniformly), SD3's shift if one is given."""
        return sigma_schedule(steps, 1.0 if shift is None else shift)

    @staticmethod
    def decode(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() + 1) / 2).clamp(0, 1)

    @staticmethod
    def encode_images(images: torch.Tensor) -> torch.Tensor:
        return images * 2 - 1

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """Write config.json and model.safetensors (written to a temporary name, then renamed)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        tmp = d / "model.safetensors.tmp"
        save_file(state, tmp)
        tmp.replace(d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(asdict(self.config), indent=2))
        return d


def load_tiny(
    path: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    resolution: int | None = None,
    **_options: object,
) -> TinyT2I:
    """Load the tiny model from `path` (a directory with config.json + model.safetensors), by default
    the weights shipped in the package. No network. Options of the large models (text-encoder
    offload, decode batch) do not apply to it and are ignored."""
    from safetensors.torch import load_file

    d = Path(path) if path is not None else WEIGHTS_DIR
    cfg, weights = d / "config.json", d / "model.safetensors"
    if not cfg.exists() or not weights.exists():
        raise FileNotFoundError(
            f"no tiny model in {d} (need config.json and model.safetensors). Train one with "
            "`solrl pretrain-tiny --output DIR` and pass that directory."
        )
    model = TinyT2I(TinyConfig(**json.loads(cfg.read_text())))
    if resolution is not None and resolution != model.config.image_size:
        raise ValueError(
            f"the tiny model generates {model.config.image_size} px images only; got resolution={resolution} "
            "(leave resolution unset)"
        )
    missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(device=device, dtype=dtype).eval()
