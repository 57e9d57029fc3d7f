"""bench/gpu_session.py's clock, stop rules and derived tables, in process and fast: each call's allowances fit
its budget with Sol-RL's headline first and nothing NVFP4 below sm_100, a stage past its allowance is cut and
keeps what it wrote, a failed preflight stops the call with a message, a short budget skips the later stages,
the record is written atomically, the iteration table and the trainer prediction add up. The whole session,
every stage as the device runs it, is rehearsed in tests/test_gpu_rehearsal.py."""

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def session():
    return load_bench("gpu_session")


@pytest.fixture(scope="module")
def forwards():
    return load_bench("session_forwards")


def test_each_call_fits_its_budget_and_puts_the_headline_first(session):
    gpu = session.ALLOWANCE["gpu"]
    for call, stages in session.CALLS.items():
        total = sum(session._allowance(s, gpu) for s in stages)
        assert total < session.BUDGET, f"call {call}: allowances {total} s against a {session.BUDGET} s budget"
    # the GPU tests first, in their own process (a poisoned CUDA context cannot skip them); then the whole iteration
    # of SANA and, in a call of its own, of FLUX.1-dev: what 15 minutes of device time hold
    assert session.CALLS[1][:3] == ("gpu-tests", "preflight", "trainer:sana-1.6b") and gpu["preflight"] <= 45
    assert session.CALLS[1][3:] == ("ceilings:producers",)  # half a minute after the headline, cut first
    assert session.CALLS[2] == ("trainer:flux-dev",) and session._allowance("trainer:flux-dev", gpu) > gpu["trainer"]
    assert {"forwards:sana-1.6b", "forwards:flux-dev", "forwards:sd35-large"} <= set(session.CALLS[3])
    assert session.TRAINER_FAMILIES[:2] == ("sol_rl", "naive_scaling")
    assert set(session.CALLS[4]) == {"ceilings:attention", "forwards:wan2.1-1.3b", "forwards:wan2.1-14b"}
    assert session.CALLS[5] == ("trainer:wan2.1-1.3b",)  # video's whole iteration, a call of its own


def test_the_video_trainer_stage_runs_the_wan_preset_at_its_published_clip(session):
    """trainer:wan2.1-1.3b's families run configs/wan.py's wan13b presets on the published transformer and VAE
    (random weights) at 480 x 832 and 81 frames, N = 16, K = 4, at 10 full and 6 preview steps."""
    e2e = load_bench("e2e")
    argv = ["--model", "wan2.1-1.3b", "--iterations", "1", "--warmup", "0", "--prompts", "1", "--preset",
            session.TRAINER_VIDEO["wan2.1-1.3b"], *session.VIDEO_TRAINER_SETTINGS, "--rollout-batch", "4", "--vae",
            "--reward", "pickscore"]  # fmt: skip
    args = e2e.build_parser().parse_args(argv)
    for fam in session.TRAINER_FAMILIES:
        c = e2e.family_config(fam, args, "/tmp/x")
        assert (c.family, c.model, c.model_path) == (fam, "wan", "random+vae")
        assert (c.resolution, c.width, c.frames, c.n, c.k, c.prompts_per_iter) == (480, 832, 81, 16, 4, 1)
        assert (c.full_steps, c.preview_steps, c.solver, c.rollout_batch_size) == (10, 6, "unipc", 4)
        assert c.reward == "pickscore" and c.iterations == 1


def test_a_stage_names_a_model_it_takes(session):
    assert session.stage_kind("forwards:wan2.1-14b") == "forwards"
    assert session.stage_kind("trainer:wan2.1-1.3b") == "trainer"
    with pytest.raises(ValueError, match="MODEL one of sana-1.6b, sd35-large, flux-dev, wan2.1-1.3b"):
        session.stage_kind("trainer:wan2.1-14b")  # a 14B video model's iteration does not fit a device call
    with pytest.raises(ValueError, match="unknown stage 'forward:sana-1.6b'"):
        session.stage_kind("forward:sana-1.6b")


def test_nothing_nvfp4_runs_below_sm_100(session, monkeypatch):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    cpu = torch.device("cpu")
    assert "sm_100" in session.format_unavailable("nvfp4", cpu)
    assert session.format_unavailable("fp8", cpu) is None and session.format_unavailable("int8", cpu) is None
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "80")
    assert "sm_89" in session.format_unavailable("fp8", cpu)


def test_a_misspelt_stage_is_refused_before_anything_runs(session, tmp_path):
    with pytest.raises(ValueError, match="forwards:MODEL with MODEL one of sana-1.6b"):
        session.main(["--smoke", "--stages", "ceilings,forwards:sana", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown stage 'stage4'"):
        session.main(["--smoke", "--stages", "stage4", "--out", str(tmp_path)])
    assert not (tmp_path / "gpu_session.json").exists()


def test_a_stage_past_its_allowance_is_cut_and_the_next_one_runs(session, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(session.ALLOWANCE["smoke"], "gpu-tests", 0.5)

    def slow_tests(cfg, seconds):
        cfg["progress"]({"started": True})
        time.sleep(5)
        return {"never": "reached"}

    monkeypatch.setattr(session, "gpu_tests_stage", slow_tests)
    t0 = time.monotonic()
    rec = session.main(["--smoke", "--stages", "gpu-tests,ceilings", "--out", str(tmp_path)])
    assert time.monotonic() - t0 < 4.5  # the sleep was interrupted at the allowance
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    cut = saved["stages"]["gpu-tests"]
    assert "0 s allowance and was stopped" in cut["timed_out"] and cut["started"] and "partial" not in cut
    assert saved["stages"]["ceilings"]["copy"]["gb_per_s"] > 0 and rec["exit_code"] == 0
    assert "stage gpu-tests: stage gpu-tests ran past" in capsys.readouterr().out


def test_a_failed_preflight_stops_the_call_with_what_failed(session, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session.preflight_mod, "check_kernels", lambda device: 1 / 0)
    failed = {"ok": False, "fp8": {"ok": False, "ran": "0/1 on the fast path"}}
    monkeypatch.setattr(session.preflight_mod, "check_layers", lambda device, formats: failed)
    monkeypatch.setattr(session, "gpu_tests_stage", lambda cfg, seconds: {"returncode": 0})  # (they run first)
    rec = session.main(["--smoke", "--call", "1", "--out", str(tmp_path)])
    assert rec["exit_code"] == 2
    pre = rec["stages"]["preflight"]
    assert pre["failed"] == ["kernels", "layers"] and pre["census"]["ok"] and pre["capture"]["ok"]
    assert "kernels (ZeroDivisionError: division by zero)" in pre["message"]
    assert "layers (fp8: 0/1 on the fast path)" in pre["message"]
    assert set(rec["skipped"]) == {"trainer:sana-1.6b", "ceilings:producers"}
    assert rec["stages"]["gpu-tests"]["returncode"] == 0
    assert all(why.startswith("the preflight failed: kernels") for why in rec["skipped"].values())
    out = capsys.readouterr().out
    assert "preflight: kernels FAILED, layers FAILED, fast_path_small ok" in out and "STOPPED: the preflight" in out


def test_a_stage_that_fails_keeps_its_entries_and_a_broken_cuda_context_stops_the_call(session, tmp_path,
                                                                                     monkeypatch, capsys):  # fmt: skip
    """On the first lent GPU, FLUX.1's forwards stage hit an illegal address: its record kept only the error
    (every forward measured before it was lost), and the next CUDA call crashed the script. Now the entries
    and the step it was in stay, and a poisoned CUDA context skips the later stages with the reason."""

    def failing(cfg, seconds):
        cfg["progress"]({"eager_ms": 12.5, "step": "nft_update"})
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(session, "gpu_tests_stage", failing)
    broken = iter([None, "AcceleratorError: CUDA error: an illegal memory access was encountered"])
    monkeypatch.setattr(session, "cuda_broken", lambda device: next(broken))
    rec = session.main(["--smoke", "--stages", "ceilings,gpu-tests,forwards:sana-1.6b", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    failed = saved["stages"]["gpu-tests"]
    assert failed["eager_ms"] == 12.5 and failed["step"] == "nft_update" and "partial" not in failed
    assert "illegal memory access" in failed["error"] and "illegal memory access" in failed["cuda_broken"]
    assert rec["exit_code"] == 4 and "CUDA context is broken" in saved["skipped"]["forwards:sana-1.6b"]
    assert saved["stages"]["ceilings"]["copy"]["gb_per_s"] > 0
    assert "(during nft_update)" in capsys.readouterr().out

def test_a_forwards_stage_times_fp8_on_every_eligible_layer_and_with_fp8_attention_when_asked(session, tmp_path,
                                                                                            monkeypatch):  # fmt: skip
    """--formats fp8,fp8+every-layer,fp8+fp8-attention: beside the family's FP8 rule (SANA's keeps its self-attention
    in BF16), the FP8 copy on every eligible layer, as INT8's rule takes them (what a wider rule would buy), and the
    family's FP8 copy with explore_attention=fp8, on an image family as on video."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    formats = "fp8,fp8+every-layer,fp8+fp8-attention"
    rec = session.main(["--smoke", "--stages", "forwards:sana-1.6b", "--formats", formats, "--no-compile", "--no-train",
                        "--out", str(tmp_path)])  # fmt: skip
    p = rec["stages"]["forwards:sana-1.6b"]["precisions"]
    own, every = (set(p[f]["quantized_layers"]) for f in ("fp8", "fp8+every-layer"))
    assert own < every and any(".attn1.to_q" in n for n in every - own)
    assert p["fp8+every-layer"]["eager_ms"] > 0 and "attention_ran" not in p["fp8+every-layer"]
    # SANA's cross-attention carries the prompts' padding mask (a key bias): the kernel takes it (interpreted here)
    att = p["fp8+fp8-attention"]
    assert set(att["quantized_layers"]) == own and att["eager_ms"] > 0
    assert att["attention_ran"] == "triton: FP8 Q K^T, FP8 P V attention", att


def test_a_small_budget_skips_the_later_stages_and_says_so(session, tmp_path, capsys):
    small = session.ALLOWANCE["smoke"]
    budget = (small["ceilings"] + small["forwards"]) / 2  # ceilings fit; a forwards stage never does
    session.main(["--smoke", "--stages", "ceilings,forwards:sana-1.6b", "--budget", str(budget), "--out",
                  str(tmp_path)])  # fmt: skip
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    assert list(saved["stages"]) == ["ceilings"]
    assert "budget" in saved["skipped"]["forwards:sana-1.6b"]
    assert "stage forwards:sana-1.6b skipped" in capsys.readouterr().out


def test_the_record_is_written_whole_or_not_at_all(session, tmp_path, monkeypatch):
    path = tmp_path / "gpu_session.json"
    session.write_json(path, {"a": 1})
    monkeypatch.setattr(session.json, "dumps", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        session.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["gpu_session.json"]


def test_the_device_command_needs_out_and_names_it(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "bench/device_call.sh", "1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "OUT must name the folder" in proc.stderr


def test_the_docs_show_the_device_commands_the_rehearsal_runs(session):
    doc = (ROOT / "docs" / "gpu-session.md").read_text()
    for call, stages in session.CALLS.items():
        assert f"bash bench/device_call.sh {call}" in doc
        assert ", ".join(stages) in doc  # the stages the docs list are the script's
    assert "bench/device_call.sh" in (ROOT / "tests" / "test_gpu_rehearsal.py").read_text()


def test_iteration_table_adds_refresh_and_training_to_the_rollouts(forwards):
    """sol_rl = ceil(N P / b) x 6 x t_q + ceil(K P / b) x 10 x t_bf16 + refresh + training; naive_scaling =
    ceil(N P / b) x 10 x t_bf16 + training; training = n_t x ceil(K P / train batch) x t_update."""
    rec = {
        "precisions": {"bf16": {"eager_ms": 100.0}, "fp8": {"eager_ms": 60.0, "refresh_ms": 50.0}},
        "train_settings": {"batch": 12, "timestep_fraction": 0.4},
        "nft_update": {"ms": 900.0, "batch": 12, "checkpointing": True},
    }
    t = forwards.iteration_table(rec, 24)
    updates = 4 * math.ceil(24 * 6 / 12)
    assert t["training"]["update_batches"] == updates
    it = t["eager/fp8"]
    train = updates * 0.9
    assert it["train_s"] == pytest.approx(train)
    assert it["sol_rl_total_s"] == pytest.approx(24 * 6 * 0.06 + 6 * 10 * 0.1 + 0.05 + train)
    assert it["naive_scaling_total_s"] == pytest.approx(24 * 10 * 0.1 + train)
    rec.pop("nft_update")
    t = forwards.iteration_table(rec, 24)
    assert t["eager/fp8"]["train_s"] == 0.0 and "not measured" in t["training"]["left_out"]


def test_trainer_prediction_uses_the_models_forwards_at_the_trainers_settings(session):
    """iteration_seconds at the trainer's own settings from the forwards stage: the compiled (graph-replayed
    where measured) forwards for sol_rl and compile, the eager ones for naive_scaling, the refresh and the
    nft_update scaled to the train batch."""
    stage = {"model": "sana-1.6b", "nft_update": {"ms": 800.0, "batch": 16},
             "precisions": {"bf16": {"eager_ms": 900.0, "compiled": {"forward_ms": 700.0, "graphed_ms": 600.0}},
                            "fp8": {"eager_ms": 800.0, "compiled": {"forward_ms": 450.0}, "refresh_ms": 30.0}}}
    settings = {"n": 96, "k": 24, "prompts_per_iter": 1, "preview_steps": 6, "full_steps": 10,
                "rollout_batch_size": 48, "train_batch_size": 8, "timestep_fraction": 0.6}
    fams = {"compile": {"time_rollout_s": 14.0, "time_total_s": 24.0, "settings": settings},
            "naive_scaling": {"time_rollout_s": 20.0, "time_total_s": 30.0, "settings": settings},
            "sol_rl": {"time_rollout_s": 9.0, "time_total_s": 19.0, "settings": settings, "explore_recipe": "fp8"}}
    p = session.trainer_prediction({"stages": {"forwards:sana-1.6b": stage}}, fams, "sana-1.6b")
    assert p["explore_precision"] == "fp8" and p["sol_rl"]["forward_ms"] == {"bf16": 600.0, "explore": 450.0}
    assert p["sol_rl"]["update_ms_scaled"] == 400.0  # 800 ms at batch 16, at the trainer's batch 8
    # compile: ceil(96/48) = 2 chunks x 10 steps x 0.6 s; sol_rl: 2 x 6 x 0.45 + ceil(24/48) = 1 x 10 x 0.6 + 0.03
    assert p["compile"]["predicted_rollout_s"] == pytest.approx(12.0)
    assert p["naive_scaling"]["predicted_rollout_s"] == pytest.approx(18.0)  # eager: 2 x 10 x 0.9
    assert p["sol_rl"]["predicted_rollout_s"] == pytest.approx(5.4 + 6.0 + 0.03)
    train = 6 * 3 * 0.4  # int(10 x 0.6) timesteps x ceil(24 / 8) update batches x 0.4 s
    assert p["sol_rl"]["predicted_total_s"] == pytest.approx(5.4 + 6.0 + 0.03 + train)
    assert p["compile"]["measured_over_predicted_rollout"] == pytest.approx(14.0 / 12.0)
    assert "skipped" in session.trainer_prediction({"stages": {}}, fams, "sana-1.6b")
    assert "skipped" in session.trainer_prediction({"stages": {"forwards:sana-1.6b": stage}}, fams, "tiny")


def test_the_summary_reads_a_partial_record(session):
    """A call cut off mid-stage still prints: families not yet run, precisions not reached."""
    rec = {"call": 1, "elapsed_s": 100.0, "budget_s": 540.0, "info": {"name": "GPU"}, "skipped": {},
           "stages": {"trainer:sana-1.6b": {"argv": ["--model", "sana-1.6b"], "families": {
               "sol_rl": {"time_rollout_s": 5.0, "time_train_s": 3.0, "time_total_s": 8.0, "time_compile_s": 40.0,
                          "explore_recipe": "fp8"}, "naive_scaling": {"running": True}}, "partial": True},
               "forwards:sana-1.6b": {"model": "sana-1.6b",
                                      "precisions": {"bf16": {"eager_ms": 10.0}, "fp8": {}}}}}  # fmt: skip
    lines = session.summary.summary_lines(rec)
    text = "\n".join(lines)
    assert "sol_rl         rollout 5.00 s" in text and "naive_scaling  not run" in text
    assert "sana-1.6b   fp8    not run (cut off)" in text


def test_kernel_groups_of_the_names_an_h200_ran(session, forwards):
    """Kernel names from the first GPU session's profiles (H200, 2026-11-25): cuBLASLt's FP8 GEMM is named
    nvjet_sm90_qq... without its element type, and was counted as a BF16 GEMM."""
    ran = {
        "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT": "low_precision_gemm",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "bf16_gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_i16832gemm_s8_128x64_128x3_tn_align16>": "low_precision_gemm",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "bf16_gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
        "triton_red_fused__to_copy_add_mul_native_layer_norm_split_unsqueeze_view_0": "elementwise",
    }
    assert {name: forwards.kernel_group(name) for name in ran} == ran


def test_the_profile_says_whether_a_standalone_quantize_is_left_where_a_producer_exists(forwards):
    """Issue 40's item 2 read off a GPU profile: the producers' Triton kernels are their own group, and the check
    passes only where each producer launched and the standalone row-wise quantizes number at most the quantized
    layers no producer feeds; a CPU profile (ATen rows) is not counted."""
    for name in ("_adaln_quantize_kernel", "_gelu_quantize_kernel", "_glu_quantize_kernel"):
        assert forwards.kernel_group(name) == "producer", name
    assert forwards.kernel_group("_fp8_rowwise_kernel") == "quantize"
    cuda = torch.device("cuda")
    prof = {"launches": {"producer": 40, "quantize": 40}}  # SANA's FP8 copy: 80 layers, 40 fed by 40 producers
    got = forwards.quantize_where_made(prof, cuda, quantized=80, fed=40, producers=40)
    assert got["ok"] and got["verdict"] == "no standalone quantize where a producer exists"
    got = forwards.quantize_where_made({"launches": {"producer": 40, "quantize": 60}}, cuda, 80, 40, 40)
    assert not got["ok"] and got["verdict"].startswith("20 standalone quantize launch(es) beyond the unfed layers")
    assert not forwards.quantize_where_made({"launches": {"producer": 0, "quantize": 40}}, cuda, 80, 40, 40)["ok"]
    assert "skipped" in forwards.quantize_where_made(prof, torch.device("cpu"), 80, 40, 40)


def test_the_summary_says_when_sol_rl_explored_with_the_policy(session):
    """The H200's trainer stage (2026-11-25): `auto` chose the policy, so its sol_rl is not the 4/8-bit headline."""
    summary = load_bench("session_summary")
    rec = json.loads((ROOT / "bench/results/2026-11-25-NVIDIA_H200-gpu-session-1-trainer-gpu-tests.json").read_text())
    stage = rec["stages"]["trainer:sana-1.6b"]
    assert any(line.startswith("  NOTE: sol_rl explored with the policy") for line in summary.trainer_lines("t", stage))
    stage["families"]["sol_rl"]["explore_recipe"] = "fp8"
    assert not any("NOTE" in line for line in summary.trainer_lines("t", stage))


def test_update_forward_equivalents_use_the_compiled_explore_as_the_unit(session):
    """The update's cost per trained sample-step over the compile family's explore seconds per sample-step, from
    one trainer stage (the H200's 2026-11-26 stage read 11.2 this way)."""
    steps = {"explore": 960, "regenerate": 0, "trained": 144}
    fams = {"compile": {"time_explore_s": 6.0, "time_train_s": 10.8, "sample_steps": steps},
            "sol_rl": {"time_explore_s": 2.0, "time_train_s": 3.6, "sample_steps": {**steps, "explore": 576}},
            "naive_scaling": {"error": "RuntimeError: out of memory"}}
    fe = session.update_forward_equivalents(fams)
    assert fe == {"compile": pytest.approx(12.0), "sol_rl": pytest.approx(4.0)}  # 75 ms and 25 ms over 6.25 ms
    assert session.update_forward_equivalents({"sol_rl": fams["sol_rl"]}) == {}  # no compile family: no unit
