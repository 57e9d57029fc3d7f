"""A sharded run's staged start-up (rl/runtime.staged): each rank loads the base on the CPU, builds the explore copy on
its device a layer at a time, and FSDP2 moves the base there a block at a time as it shards it, so no GPU holds the
whole base (Wan2.2-A14B's two experts on 8 x 80 GB; Qwen-Image's full fine-tuning on 32).

On a CPU the run's device is the CPU, so the staging moves nothing; these tests stand the meta device in for the GPU
(a device the CPU's tensors are not on, where every op runs on shapes alone) and check where each piece is made:
the pipeline's transformer stays on the CPU while the rest goes to the device, each layer of the copy is quantized on
the device from the CPU base without touching it, and what FSDP2 leaves behind is moved (or named, if anything is
still elsewhere). The 2- and 4-rank gloo runs of tests/test_distributed.py and tests/test_context_parallel.py take
the same path with sharding=fsdp and match one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_pipelines import MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_wan

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model
from solrl_engine.nn import QuantLinear
from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.runtime import staged
from solrl_engine.rl.sharding import elsewhere, settle_

SIDE = SIZES["wan"]
OPTS = dict(resolution=SIDE, width=SIDE, frames=WAN_FRAMES, max_sequence_length=MAX_SEQUENCE_LENGTH["wan"])
META = torch.device("meta")


@pytest.fixture(scope="module")
def wan22(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan(tmp_path_factory.mktemp("staged") / "wan", two_experts=True)


def test_only_sharded_multi_rank_runs_are_staged():
    assert staged(RLConfig(model="tiny", sharding="fsdp"), 2) and staged(RLConfig(model="tiny", sharding="hsdp"), 8)
    assert not staged(RLConfig(model="tiny", sharding="fsdp"), 1)  # one process: nothing to shard over
    assert not staged(RLConfig(model="tiny"), 8)  # replicated: every rank holds the whole base on its GPU anyway


def test_a_staged_pipeline_keeps_its_transformer_on_the_cpu_and_the_rest_on_the_device(wan22, monkeypatch):
    """Both experts of a saved two-expert WanPipeline stay on the CPU; the VAE goes to the run's device, as it would
    without staging (and the text encoder to the CPU, offloaded between encodes)."""
    m = load_model("wan", wan22, META, torch.float32, transformer_on_cpu=True, **OPTS)
    assert {p.device.type for p in m.transformer.parameters()} == {"cpu"}
    assert {n.split(".")[0] for n, _ in m.transformer.named_parameters()} == {"transformer", "transformer_2"}
    assert {p.device.type for p in m.pipe.vae.parameters()} == {"meta"}
    plain = load_model("wan", wan22, META, torch.float32, **OPTS)
    assert {p.device.type for p in plain.transformer.parameters()} == {"meta"}
    # the rollouts run on the model's device, not where its transformer waits: the explore copy, the noise and the
    # update are made there (the rollouts once read the device off the transformer's first weight: the CPU)
    from solrl_engine.models import model_spec
    from solrl_engine.sampling.rollouts import Rollouts, RolloutSettings

    ro = Rollouts(m, model_spec("wan"), lambda im, p: im.mean((1, 2, 3)), RolloutSettings(compiled=False))
    assert ro.device == META and ro.dtype == torch.float32
    # and the trainer's explorer builds its copy there, from the transformer on the CPU (the speed bound, a real
    # forward with the text encoder, is what the meta device cannot run: left out here)
    import solrl_engine.explore.explorer as explorer
    from solrl_engine.explore.plan import ExploreSettings, plan
    from solrl_engine.rl.runtime import build_explorer

    monkeypatch.setattr(explorer, "speed_bound", lambda *a: None)
    spec = plan(ExploreSettings(precision="fp8"), model_spec("wan"), ro.device, ro.dtype, m.transformer)
    ex = build_explorer(ro, spec, 4, 2, 2)
    assert ex.copy.report.quantized and not elsewhere([ex.copy.transformer], META)
    assert {p.device.type for p in m.transformer.parameters()} == {"cpu"}


@pytest.mark.parametrize("recipe", ["fp8", "int8", "nvfp4"])
def test_the_copy_is_quantized_on_the_device_a_layer_at_a_time_from_the_cpu_base(wan22, recipe, monkeypatch):
    """Each layer is moved to the device just before it is quantized (the device never holds the base whole; the
    CPU never quantizes), the layers left in high precision follow, and the policy's base is untouched: still on
    the CPU, on its own storage."""
    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    before = {n: (p.device, p.data_ptr()) for n, p in m.transformer.named_parameters()}
    seen: list[str] = []
    real = QuantLinear.from_linear.__func__

    def from_linear(cls, linear, *args, **kwargs):  # noqa: ANN001, ANN202 - records where each layer is quantized
        seen.append(linear.weight.device.type)
        return real(cls, linear, *args, **kwargs)

    monkeypatch.setattr(QuantLinear, "from_linear", classmethod(from_linear))
    copy = ExploreCopy(m.transformer, recipe, borrow=True, device=META)
    assert copy.report.quantized and len(seen) == len(copy.report.quantized) and set(seen) == {"meta"}
    assert not elsewhere([copy.transformer], META)  # every parameter and buffer of the copy is on the device
    assert {n: (p.device, p.data_ptr()) for n, p in m.transformer.named_parameters()} == before
    for expert in ("transformer", "transformer_2"):  # both experts' blocks quantized
        assert any(d.name.startswith(f"{expert}.blocks.") for d in copy.report.layers if d.quantized)


def test_settle_moves_what_fsdp_left_behind_keeping_each_parameter(wan22):
    """LoRA matrices (FSDP2's ignored parameters), buffers and the adapters' EMA tensors left on the CPU move to the
    device as the same Parameter objects (the optimizer and the copies hold them); `elsewhere` names anything that
    is still not there, which settle_ refuses with the fix."""
    from solrl_engine.rl.adapters import TRAIN, LoraAdapters

    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    adapters = LoraAdapters(m.transformer, 2, 2, ("to_q", "to_k"))
    ids = [id(p) for p in adapters.params(TRAIN)]
    ema = list(adapters.ema)
    n = sum(1 for _ in m.transformer.parameters()) + sum(1 for _ in m.transformer.buffers())
    assert settle_([m.transformer], META, ema) == n + len(ema)
    assert not elsewhere([m.transformer], META) and {e.device.type for e in ema} == {"meta"}
    assert [id(p) for p in adapters.params(TRAIN)] == ids
    assert settle_([m.transformer], META) == 0  # nothing left to move
    stray = torch.nn.Linear(2, 2)
    assert elsewhere([stray], META) == ["weight (cpu)", "bias (cpu)"]
    assert elsewhere([stray], torch.device("cpu")) == []


def test_the_plan_counts_each_ranks_host_memory_and_the_trainer_warns_where_a_node_lacks_it():
    """A staged start-up holds the base on the CPU on every rank of a node at once: the plan says how much per rank
    (and the offloaded text encoders beside it), and `host_shortfall` says what to do where MemAvailable is less."""
    from solrl_engine.hw import host_memory_available_gib
    from solrl_engine.models.tiny.model import load_tiny
    from solrl_engine.rl import memplan

    params = sum(p.numel() for p in load_tiny().transformer.parameters())
    cfg = dict(name="t", model="tiny", policy_dtype="bfloat16", train_batch_size=2, gradient_checkpointing=False)
    staged_plan = memplan.memory_plan(RLConfig(**cfg, sharding="fsdp"), gpus=4)
    assert staged_plan.host_gib == pytest.approx(2 * params / 2**30)  # the tiny model has no text encoder to offload
    assert "host memory per rank" in staged_plan.render() and "sharded start-up" in staged_plan.host_note
    assert memplan.memory_plan(RLConfig(**cfg), gpus=4).host_gib == 0.0  # replicated: loaded straight to the GPU
    need = staged_plan.host_gib * 8
    short = memplan.host_shortfall(staged_plan, 8, need / 2)
    assert short is not None and "--nproc_per_node" in short and f"{need:.0f} GiB" in short
    assert memplan.host_shortfall(staged_plan, 8, need * 2) is None
    assert memplan.host_shortfall(staged_plan, 8, None) is None  # not known: nothing said
    assert host_memory_available_gib("MemTotal: 100 kB\nMemAvailable:   2097152 kB\n") == pytest.approx(2.0)
    assert host_memory_available_gib("MemTotal: 100 kB\n") is None
