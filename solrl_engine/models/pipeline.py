"""The FlowModel over a real diffusers pipeline, shared by the SD3, FLUX and SANA adapters.

What is common to the three lives here: loading (`DiffusionPipeline.from_pretrained` with the
policy dtype, from a local directory or a hub id, with errors that say what to do), prompt
encoding through the pipeline's own `encode_prompt` with a per-prompt cache, the text encoders
offloaded to the CPU between encodes, the sigma schedule from the pipeline's own scheduler, and a
chunked VAE decode. Each family file says only what differs: how to call encode_prompt, the
transformer's inputs, the latent layout and the VAE's scaling.

`path="random"` builds the family's published transformer with random weights and stand-in text
encoder and VAE (deterministic random conditioning per prompt, a fixed projection to 32x32 RGB), for
speed benchmarks, which time the denoiser: that is where rollouts spend their time. `path="random+vae"` adds the
family's published VAE (its class and config, `RANDOM_VAE_CONFIG`) with random weights, so a benchmark also times
the decode a user's run makes (Sol-RL decodes every preview it scores).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from solrl_engine.models import pipeline_class
from solrl_engine.models.base import Conditioning, input_dtype

log = logging.getLogger("solrl_engine.models")

RANDOM = "random"
RANDOM_VAE = "random+vae"  # and the published VAE, random weights


def check_model_path(path: str | Path, what: str = "model_path") -> None:
    """Fail before any loading when `path` can be neither a local pipeline directory nor a hub id
    (or, offline, a hub id that is not in the local cache), naming the path and the fix."""
    import os

    p = Path(path)
    looks_local = p.is_absolute() or str(path).startswith((".", "~")) or p.exists() or str(path).count("/") != 1
    if looks_local:
        if not p.is_dir():
            raise FileNotFoundError(
                f"{what} {str(path)!r} does not exist or is not a directory: pass a diffusers pipeline directory "
                "(one with model_index.json, e.g. written by `hf download <hub id> --local-dir DIR`) "
                "or a hub id such as stabilityai/stable-diffusion-3.5-large"
            )
        if not (p / "model_index.json").exists():
            raise FileNotFoundError(
                f"{what} {str(path)!r} has no model_index.json: point it at the pipeline's top directory "
                "(the one holding transformer/, vae/, text_encoder/ and model_index.json)"
            )
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(str(path), "model_index.json"), str):
            raise FileNotFoundError(
                f"{what} {str(path)!r} is a hub id that is not in the local Hugging Face cache and HF_HUB_OFFLINE "
                f"is set: download it first (`hf download {path}`) or pass a local directory"
            )


class PipelineFlowModel(nn.Module):
    """A FlowModel over `pipe` (a diffusers pipeline of the family's class); see the module docstring.

    Subclasses set FULL_CONFIG (the published transformer config), TRANSFORMER_CLASS,
    TEXT_TOKENS (stand-in text length) and implement `_encode`, `_forward`, `_decode_latents`,
    `_latent_shape`, and optionally `_timestep_kwargs` (arguments of scheduler.set_timesteps).
    """

    MODEL: ClassVar[str] = ""  # its name in MODELS; "family" in this engine is the training method (RLConfig)
    FULL_CONFIG: ClassVar[dict[str, Any]] = {}
    TRANSFORMER_CLASS: ClassVar[str] = ""
    PIPELINE_CLASS: ClassVar[str] = ""
    TEXT_TOKENS: ClassVar[int] = 77
    # the published VAE as (its diffusers class, its config): what "random+vae" builds with random weights
    RANDOM_VAE_CONFIG: ClassVar[tuple[str, dict[str, Any]] | None] = None
    DEFAULT_RESOLUTION: ClassVar[int] = 1024
    # the text tokens a prompt is encoded to, as `pipe(prompt)` does it (its __call__'s max_sequence_length); None for
    # the families whose encoding the adapter fixes itself (no max_sequence_length option)
    MAX_SEQUENCE_LENGTH: ClassVar[int | None] = None

    def __init__(
        self,
        pipe: Any,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        resolution: int | None = None,
        offload_text_encoders: bool = True,
        decode_batch_size: int = 8,
        cache_size: int = 4096,
        guidance_scale: float | None = None,
        place: bool = True,
        max_sequence_length: int | None = None,
        transformer_on_cpu: bool = False,
    ) -> None:
        """place=False leaves every module where the caller put it (a wrapped stock pipeline); `max_sequence_length`:
        the text tokens a prompt keeps (None: MAX_SEQUENCE_LENGTH, what `pipe(prompt)` uses), where the family has
        one; `transformer_on_cpu`: a sharded start-up's (rl/sharding.py), the transformer left on the CPU, where
        the pipeline loads it, for sharding to move it to `device` a block at a time (no GPU ever holds it whole)."""
        if max_sequence_length is not None and self.MAX_SEQUENCE_LENGTH is None:
            raise TypeError(f"{type(self).__name__} takes no max_sequence_length: its prompts are encoded as its "
                            "pipeline encodes them by default")  # fmt: skip
        self.max_sequence_length = max_sequence_length or self.MAX_SEQUENCE_LENGTH
        super().__init__()
        self.pipe = pipe
        self.transformer = self._denoiser(pipe)  # registered as a submodule: .to() and LoRA see it
        self.device_ = torch.device(device)
        self.dtype = dtype
        self.resolution = resolution or self.DEFAULT_RESOLUTION
        self.offload = offload_text_encoders
        self.decode_batch_size = decode_batch_size
        self.guidance_scale = guidance_scale
        self._cache: OrderedDict[str, Conditioning] = OrderedDict()
        self._uncond: Conditioning | None = None
        self._cache_size = cache_size
        self.random = getattr(pipe, "random", False)
        factor = self.vae_factor
        if self.resolution % factor:
            raise ValueError(
                f"resolution {self.resolution} is not a multiple of {factor} (the {type(self).__name__} latent cell "
                "in pixels); pick a multiple"
            )
        self.latent_shape = self._latent_shape()
        self.integer_timesteps = self._integer_timesteps()
        if place:
            self.transformer.to("cpu" if transformer_on_cpu else self.device_)
            if getattr(pipe, "vae", None) is not None:
                pipe.vae.to(self.device_)
            for enc in self._text_encoders():
                enc.to("cpu" if self.offload else self.device_)

    # --- building -----------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path | None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
             **options: Any) -> PipelineFlowModel:  # fmt: skip
        """From a local pipeline directory or hub id (weights loaded directly in `dtype`), or "random"."""
        if path is None:
            raise ValueError(f"{cls.__name__}: set model_path to a pipeline directory or a hub id")
        if str(path) in (RANDOM, RANDOM_VAE):  # `arch` overrides the published config (tests build small ones)
            # `transformer`: one built beforehand (the memory plan's, on fake tensors)
            # `boundary_ratio`: two experts (Wan2.2-A14B's layout), the second `transformer_2` or built alike
            pipe = _RandomPipeline(cls, dtype, options.pop("arch", None), options.pop("transformer", None),
                                   vae=str(path) == RANDOM_VAE, boundary_ratio=options.pop("boundary_ratio", None),
                                   transformer_2=options.pop("transformer_2", None))  # fmt: skip
            return cls(pipe, device=device, dtype=dtype, **options)
        check_model_path(path)
        import diffusers

        try:
            with _quiet_progress():
                pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype)
        except (OSError, ValueError) as e:  # hub errors are OSErrors; a broken directory a ValueError
            raise FileNotFoundError(
                f"could not load a diffusers pipeline from {str(path)!r}: {e}\nPass a local pipeline directory "
                f"or a hub id that is downloaded (`hf download {path}`)"
            ) from e
        want = pipeline_class(cls.PIPELINE_CLASS)
        if not isinstance(pipe, want):
            from solrl_engine.models import MODELS, model_spec

            fits = [n for n in MODELS if model_spec(n).pipeline == type(pipe).__name__]
            known = ", ".join(f"{n} for {model_spec(n).pipeline}" for n in MODELS if n != "tiny")
            hint = f"set model={fits[0]}" if fits else f"no model family takes it (model={known})"
            raise ValueError(f"{path} holds a {type(pipe).__name__}, not a {cls.PIPELINE_CLASS}: {hint}")
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device=device, dtype=dtype, **options)

    @classmethod
    def pipeline_resolution(cls, pipe: Any) -> int:
        """The size a stock pipeline draws by default (`pipe(prompt)`): its sample size in latent cells x the VAE
        factor."""
        cells = getattr(pipe, "default_sample_size", None) or pipe.transformer.config.sample_size
        return int(cells) * int(pipe.vae_scale_factor)

    # --- FlowModel ----------------------------------------------------------------------------------

    @property
    def vae_factor(self) -> int:
        """Pixels per latent cell."""
        return int(self.pipe.vae_scale_factor)

    @property
    def tokens_per_sample(self) -> int:
        """Image tokens the transformer sees per sample: the latent's cells over its patch (an int: square; a
        tuple: (frames, h, w) for video). Sizes explore_precision=auto's timing (Rollouts.forward_rows)."""
        patch = self.transformer.config.patch_size
        area = math.prod(patch) if isinstance(patch, (tuple, list)) else int(patch) ** (len(self.latent_shape) - 1)
        return math.prod(self.latent_shape[1:]) // area

    def _text_encoders(self) -> list[nn.Module]:
        """The encoders a prompt runs through once (its text, and a conditioned prompt's image: Wan I2V's CLIP)."""
        return [
            getattr(self.pipe, n) for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
            if isinstance(getattr(self.pipe, n, None), nn.Module)
        ]  # fmt: skip

    @contextlib.contextmanager
    def _encoders_on_device(self) -> Iterator[None]:
        """The text encoders on the device while encoding, back on the CPU after it (with offload)."""
        encs = self._text_encoders() if self.offload and not self.random else []
        for enc in encs:
            enc.to(self.device_)
        try:
            yield
        finally:
            for enc in encs:
                enc.to("cpu")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Per-prompt conditioning, cached (the text encoders run once per new prompt)."""
        new = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if new:
            with self._encoders_on_device():
                cond = self._standin_encode(new) if self.random else self._encode(new)
            for i, p in enumerate(new):
                self._cache[p] = cond[i : i + 1].to("cpu")
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        rows = []
        for p in prompts:
            self._cache.move_to_end(p)
            rows.append(self._cache[p])
        return Conditioning.cat(rows).to(self.device_)

    @torch.no_grad()
    def encode_unconditional(self) -> Conditioning:
        """What classifier-free guidance contrasts against: the empty prompt, encoded as the family's stock pipeline
        encodes its default negative prompt (SANA's leaves out the instruction it puts before every prompt)."""
        if self._uncond is None:
            with self._encoders_on_device():
                cond = self._standin_encode([""]) if self.random else self._encode_negative()
            self._uncond = cond.to("cpu")
        return self._uncond.to(self.device_)

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: nn.Module | None = None
    ) -> torch.Tensor:
        """Velocity (noise - x0) at flow time t in [0, 1] (scalar or [B]), in the transformer's dtype:
        `x` is cast to it first, as the stock pipelines cast their latents (see `input_dtype`)."""
        net = transformer if transformer is not None else self.transformer  # a compiled module has no truth value
        x = x.to(input_dtype(net))
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        return self._forward(net, x, t, cond)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] (a video model: videos [B, F, 3, H, W]) in [0, 1], `decode_batch_size` at
        a time (VAE memory at 1024 px)."""
        if self.random and self.pipe.vae is None:
            return self._standin_decode(x)
        out = []
        for i in range(0, x.shape[0], self.decode_batch_size):
            img = self._decode_latents(x[i : i + self.decode_batch_size])
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)

    def _integer_timesteps(self) -> bool:
        """Whether the pipeline's scheduler hands the transformer integer timesteps (DPM-Solver's
        flow sigmas do: floor(1000 sigma)); the model then sees what the stock pipeline shows it."""
        sched = self.pipe.scheduler
        probe = type(sched).from_config(sched.config)
        probe.set_timesteps(**self._timestep_kwargs(2, probe))
        return not torch.as_tensor(probe.timesteps).is_floating_point()

    def model_timestep(self, t: torch.Tensor, scale: float = 1000.0) -> torch.Tensor:
        """Flow time t in [0, 1] -> the transformer's timestep input, as the pipeline computes it."""
        ts = t * scale
        return ts.floor() if self.integer_timesteps else ts

    def pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Our latents in the layout the pipeline's `latents=` argument takes (the same here)."""
        return x

    def sigmas(self, steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's own scheduler's sigmas for `steps` (as its `__call__` would use them)."""
        sched = self.pipe.scheduler
        over = {} if shift is None else self._shift_override(shift)
        sched = type(sched).from_config(sched.config, **over)
        kwargs = self._timestep_kwargs(steps, sched)
        sched.set_timesteps(**kwargs)
        self.integer_timesteps = not torch.as_tensor(sched.timesteps).is_floating_point()  # follows a swapped scheduler
        sig = torch.as_tensor(sched.sigmas, dtype=torch.float64).flatten().cpu()
        if len(sig) != steps + 1:
            raise ValueError(f"{type(sched).__name__} gave {len(sig)} sigmas for {steps} steps; expected {steps + 1}")
        return sig.float()

    # --- family hooks -------------------------------------------------------------------------------

    def pipeline_inputs(self, prompt: str, rows: int = 1) -> dict[str, Any]:
        """What the stock pipeline's call takes besides the prompt, noise and sizes for `rows` rows of `prompt` to
        sample as the engine samples it (a regeneration through the caller's pipeline): nothing for a text prompt;
        the conditioned families give the prompt's image (and what makes the pipeline encode it as the engine
        does): one for all rows, or one per row where the pipeline reads an image per prompt text."""
        return {}

    def _denoiser(self, pipe: Any) -> nn.Module:
        """The module the sampler and the update call: the pipeline's transformer (Wan: its two experts as one)."""
        return pipe.transformer

    def _shift_override(self, shift: float) -> dict[str, Any]:
        return {"shift": shift, "use_dynamic_shifting": False}

    def _timestep_kwargs(self, steps: int, sched: Any) -> dict[str, Any]:
        return {"num_inference_steps": steps}

    def _latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _encode(self, prompts: list[str]) -> Conditioning:
        raise NotImplementedError

    def _encode_negative(self) -> Conditioning:
        """The empty negative prompt as the stock pipeline encodes it: like any prompt, unless a family says not."""
        return self._encode([""])

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        raise NotImplementedError

    def _decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Through the pipeline's VAE with its scaling (and shift, where it has one: SD3's and FLUX's
        KL VAEs; SANA's DC-AE has none)."""
        vae = self.pipe.vae
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return vae.decode(x.to(vae.dtype) / vae.config.scaling_factor + shift, return_dict=False)[0]

    def _standin_dims(self) -> tuple[int, int | None]:
        """(hidden width, pooled width or None) of the conditioning the transformer expects."""
        raise NotImplementedError

    # --- stand-ins for "random" (benchmarks) --------------------------------------------------------

    def _standin_encode(self, prompts: list[str]) -> Conditioning:
        hidden_dim, pooled_dim = self._standin_dims()
        hs, ps = [], []
        for p in prompts:
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little") % 2**63
            g = torch.Generator().manual_seed(seed)
            hs.append(torch.randn(self.TEXT_TOKENS, hidden_dim, generator=g))
            ps.append(torch.randn(pooled_dim or 1, generator=g))
        hidden = torch.stack(hs).to(self.device_, self.dtype)
        pooled = torch.stack(ps).to(self.device_, self.dtype) if pooled_dim else None
        mask = torch.ones(len(prompts), self.TEXT_TOKENS, dtype=torch.long, device=self.device_)
        return Conditioning(hidden, pooled, mask if pooled_dim is None else None)

    def _standin_decode(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        proj = (torch.randn(3, x.shape[1], generator=g) * 0.3).to(x.device)
        rgb = torch.einsum("oc,bchw->bohw", proj, x.float())
        return torch.sigmoid(F.adaptive_avg_pool2d(rgb, 32))


def build_transformer(cls: type[PipelineFlowModel], dtype: torch.dtype, arch: dict[str, Any] | None = None
                      ) -> nn.Module:  # fmt: skip
    """The family's published transformer (`arch` overrides its config) with random weights, built in `dtype`
    directly: no FP32 copy of a 12B model (under FakeTensorMode, no memory at all)."""
    return _build(cls.TRANSFORMER_CLASS, {**cls.FULL_CONFIG, **(arch or {})}, dtype)


def build_vae(cls: type[PipelineFlowModel], dtype: torch.dtype) -> nn.Module:
    """The family's published VAE (RANDOM_VAE_CONFIG) with random weights, in `dtype`, in eval mode."""
    if cls.RANDOM_VAE_CONFIG is None:
        raise ValueError(f"model_path={RANDOM_VAE!r}: {cls.MODEL} declares no published VAE to build (its "
                         f"RANDOM_VAE_CONFIG); use model_path={RANDOM!r} (a stand-in decode)")  # fmt: skip
    name, config = cls.RANDOM_VAE_CONFIG
    return _build(name, config, dtype).eval().requires_grad_(False)


def _build(class_name: str, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    import diffusers

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return getattr(diffusers, class_name)(**config)
    finally:
        torch.set_default_dtype(default)


class _RandomPipeline:
    """The parts of a pipeline a benchmark needs: the published transformer with random weights and
    the family's default scheduler (no text encoders; the published VAE only when asked: see the module
    docstring)."""

    random = True

    def __init__(self, cls: type[PipelineFlowModel], dtype: torch.dtype, arch: dict[str, Any] | None = None,
                 transformer: nn.Module | None = None, vae: bool = False, boundary_ratio: float | None = None,
                 transformer_2: nn.Module | None = None) -> None:  # fmt: skip
        self.transformer = transformer if transformer is not None else build_transformer(cls, dtype, arch)
        if boundary_ratio is not None:  # two experts of one architecture (models/experts.py)
            self.transformer_2 = transformer_2 if transformer_2 is not None else build_transformer(cls, dtype, arch)
            self.config = SimpleNamespace(boundary_ratio=boundary_ratio)
        self.scheduler = cls.default_scheduler()  # type: ignore[attr-defined]
        self.vae = build_vae(cls, dtype) if vae else None
        # the published VAE's spatial factor for this architecture (a family with several VAEs says which)
        factor = getattr(cls, "random_vae_factor", None)
        self.vae_scale_factor = factor(arch or {}) if factor else cls.RANDOM_VAE_FACTOR  # type: ignore[attr-defined]


class _quiet_progress:
    """diffusers' loading progress bars off while loading (the trainer has its own)."""

    def __enter__(self) -> None:
        from diffusers.utils import logging as dlog

        self._level = dlog.get_verbosity()
        dlog.set_verbosity_error()
        dlog.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity(self._level)
        dlog.enable_progress_bar()


# The joint-attention projections of an MMDiT's two streams (image: to_q/k/v, to_out.0; text: add_q/k/v_proj,
# to_add_out), named alike by diffusers' SD3, FLUX.1 and Qwen-Image attention: their default LoRA targets.
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class PackedLatentFlowModel(PipelineFlowModel):
    """A family whose transformer takes 2x2-packed latents and whose scheduler shifts by the image's token count
    (FLUX.1, Qwen-Image): latents are kept unpacked, [C/4, H/8, W/8] for a C-feature token, and the schedule is
    the pipeline's sigmas linspace(1, 1/N) under the dynamic shift mu of (H/16) x (W/16) tokens (diffusers'
    calculate_shift, which both pipelines share)."""

    @property
    def vae_factor(self) -> int:
        return 2 * int(self.pipe.vae_scale_factor)  # 2x2 packing on top of the VAE's 8x

    @property
    def tokens_per_sample(self) -> int:
        """The packed tokens: one per 2x2 latent cells."""
        return math.prod(self.latent_shape[1:]) // 4

    def _latent_shape(self) -> tuple[int, ...]:
        side = 2 * (self.resolution // self.vae_factor)
        return (int(self.transformer.config.in_channels) // 4, side, side)

    def _timestep_kwargs(self, steps: int, sched: Any) -> dict[str, Any]:
        import numpy as np

        kw: dict[str, Any] = {"sigmas": np.linspace(1.0, 1 / steps, steps)}
        if sched.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            c = sched.config
            seq = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
            kw["mu"] = calculate_shift(seq, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.15))  # fmt: skip
        return kw

    def pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> the packed [B, h/2 * w/2, 4C] that the pipeline's `latents=` (and its transformer) take."""
        b, c, h, w = x.shape
        return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)

    @staticmethod
    def unpack(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The transformer's packed output back to our [B, C, h, w] latents (`shape`), `pipeline_latents` undone."""
        b, c, h, w = shape
        return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
