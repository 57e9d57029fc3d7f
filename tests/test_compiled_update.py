"""The compiled update (compiled_update; rl/update.py, sampling.compile.CompiledBlocks): the policy's repeated blocks
compiled for the gradient micro-batches, forward and backward, LoRA inside.

- every real class's blocks (SD3.5, FLUX.1's two, SANA, Wan, Qwen-Image; tiny pipelines saved and reloaded) trace
  with no graph break, in BF16 weights with FP32 LoRA under autocast, as a GPU runs them;
- through inductor on the CPU the compiled update gives the eager one's loss and gradient norm, with and without
  recomputed blocks, and its census shows the graphs it compiled;
- where it is not built (sharded, full fine-tuning) setting it is refused, naming the key.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from tiny_pipelines import SIZES, build_flux, build_qwenimage, build_sana, build_sd3, build_wan

from solrl_engine.hw import cpu_compile_available
from solrl_engine.models import load_model, model_spec
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.config import ConfigError, load_config
from solrl_engine.rl.trainer import Trainer
from solrl_engine.sampling.compile import Census, CompiledBlocks, census_backend, repeated_blocks

pytestmark = pytest.mark.skipif(not cpu_compile_available()[0], reason="inductor needs a C++ compiler on a CPU")
ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes")
BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana, "wan": build_wan, "qwenimage": build_qwenimage}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_real_class_compiles_its_training_blocks_without_a_graph_break(name, tmp_path):
    """And the same LoRA gradients as the eager forward and backward."""
    from torch._dynamo.utils import counters

    path = BUILDERS[name](tmp_path / name)
    size = {"resolution": SIZES[name]} if name in SIZES else {}
    model = load_model(name, str(path), "cpu", torch.bfloat16, **size)
    spec, net = model_spec(name), model.transformer
    adapters = LoraAdapters(net, 4, 8, spec.lora_targets)
    for p in adapters.params(TRAIN) + adapters.params(OLD):
        p.data = p.data.float()
    blocks = repeated_blocks(net, spec.repeated_blocks)
    census = Census()
    compiled = CompiledBlocks(blocks, census_backend(census, inner="eager"))  # dynamo's tracing, no codegen
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red apple", "a blue cup"])

    def grads(ctx) -> list[torch.Tensor | None]:  # noqa: ANN001 - the LoRA's gradients of one forward and backward
        for p in adapters.params(TRAIN):
            p.grad = None
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                v = model.velocity(x, torch.tensor([0.7, 0.3]), cond)
            v.float().square().mean().backward()
        return [p.grad for p in adapters.params(TRAIN)]

    eager = grads(contextlib.nullcontext())
    counters.clear()
    got = grads(compiled.active())
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    kinds = {type(b).__name__ for b in blocks}
    assert len(blocks) >= 1 and 1 <= len(census.graphs) <= len(blocks), (kinds, len(census.graphs))
    assert any(g is not None and bool(g.abs().sum() > 0) for g in got)
    for g, e in zip(got, eager, strict=True):  # the same LoRA layers take gradients, of the same values
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _cfg(small_model: str, out: Path, **kw: object):
    base = dict(model_path=small_model, n=6, k=4, prompts_per_iter=2, iterations=1, preview_steps=2, full_steps=4,
                eval_every=1, eval_prompt_count=2, eval_seeds=1, save_every=1, lora_rank=4, lora_alpha=8, lr=1e-2,
                rollout_batch_size=16, train_batch_size=4, timestep_fraction=0.5, eval_train_prompt_count=0,
                explore_precision="nvfp4", policy_dtype="float32", device="cpu", output=str(out))  # fmt: skip
    base.update(kw)
    return load_config(SPEC, [f"{k}={v}" for k, v in base.items()])


def test_the_compiled_update_gives_the_eager_ones_loss_and_gradient(small_model, tmp_path):
    runs = {}
    for name, compiled, ckpt in (("eager", False, False), ("compiled", True, False), ("recompute", True, True)):
        tr = Trainer(_cfg(small_model, tmp_path / name, compiled_update=compiled, gradient_checkpointing=ckpt),
                     progress=False)  # fmt: skip
        assert (tr.compiled_update is not None) == compiled
        tr.run()
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][-1]
        if compiled:  # the update's graphs, compiled through inductor when its micro-batches first ran
            assert len(tr.update_census.graphs) >= 1
    for name in ("compiled", "recompute"):
        for key in ("loss", "policy_loss", "grad_norm"):
            assert runs[name][key] == pytest.approx(runs["eager"][key], rel=1e-5), (name, key)


@pytest.mark.parametrize(("sets", "match"), [
    (["sharding=fsdp"], "compiled_update = True: the compiled update is built for LoRA runs that are not sharded"),
    (["train_mode=full"], "compiled_update = True"),
])  # fmt: skip
def test_the_compiled_update_is_refused_where_it_is_not_built(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SPEC, ["compiled_update=true", *sets])
