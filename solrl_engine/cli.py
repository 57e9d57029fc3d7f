"""`solrl` command line."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Sequence
from pathlib import Path


def _version(_: argparse.Namespace) -> int:
    import torch

    import solrl_engine
    from solrl_engine import hw
    from solrl_engine.explore.choice import explore_candidates, hardware_plan
    from solrl_engine.kernels import backend_report

    print(f"solrl-engine {solrl_engine.__version__}")
    print(f"python       {platform.python_version()}")
    print(f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    try:
        import triton

        print(f"triton       {triton.__version__}")
    except ImportError:
        print("triton       not installed (pip install triton)")
    cap = None
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"device       {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        print(f"device       cpu (no CUDA device; torch CPU kernels {torch.backends.cpu.get_cpu_capability()})")
    dtype, why = hw.auto_policy_dtype("cuda" if cap else "cpu")
    print(f"policy       {str(dtype).removeprefix('torch.')} (auto: {why})")
    if cap:
        plan = ", ".join(explore_candidates("cuda")) or "none (no NVFP4/FP8/INT8 tensor cores)"
        print(f"explore      auto: timed at start among {plan} and the policy, the fastest taken "
              f"(hardware plan: {hardware_plan('cuda')})")  # fmt: skip
        print("compile      torch.compile + CUDA graphs (compile family; other families unless compiled_sampler=false)")
    else:
        print("explore      auto: timed per model at start, the fastest precision faster than the policy's "
              "(NVFP4/FP8/INT8 on a CPU; the run log says which and why)")  # fmt: skip
        ok, why = hw.cpu_compile_available()
        how = "inductor: " + why if ok else "eager: " + why
        print(f"compile      {how} (compile family, and compiled_sampler=true; other families sample eagerly)")
    for name, state in backend_report().items():
        print(f"backend      {name:<9} {state}")
    return 0


def _pretrain_tiny(args: argparse.Namespace) -> int:
    from solrl_engine.pretrain import PretrainConfig, pretrain_tiny

    cfg = PretrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads)
    metrics = _checked(lambda: pretrain_tiny(args.output, cfg, resume=args.resume, device=args.device))
    print(json.dumps(metrics, indent=2))
    print(f"weights, loss.png and sample grids are in {args.output}")
    return 0


def _parse_seeds(spec: str) -> list[int]:
    """'0-15' or '1,5,9' or a mix: '0-3,10'."""
    seeds: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part.strip()[1:]:
                a, b = part.split("-", 1)
                seeds.extend(range(int(a), int(b) + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise SystemExit(f"--seeds {spec!r}: write a range like 0-15, a list like 1,5,9, or both") from None
    if not seeds or any(s < 0 for s in seeds):
        raise SystemExit(f"--seeds {spec!r} names no seed (a range runs upwards, e.g. 1-5) or a negative one: "
                         "seeds are whole numbers >= 0")  # fmt: skip
    return seeds


def _rollouts_from_args(args: argparse.Namespace):  # noqa: ANN202 - Rollouts, imported lazily
    """A Rollouts for `solrl sample`: from --config, or from --model/--model-path/--reward."""
    import dataclasses

    from solrl_engine.rl import RLConfig, apply_overrides
    from solrl_engine.rl.runtime import build_rollouts

    if args.config:
        cfg = _load_cfg(args)
    else:
        given = {"model": args.model, "reward": args.reward, "full_steps": args.steps, "solver": args.solver,
                 "preview_steps": min(6, args.steps), "model_path": args.model_path or None,
                 "resolution": args.resolution or None, "shift": args.shift}  # fmt: skip
        base = dataclasses.replace(RLConfig(family="naive_scaling"), **given)
        cfg = _checked(lambda: apply_overrides(base, args.set or []).validate())
    ro = _checked(lambda: build_rollouts(cfg))
    if args.lora:
        _checked(lambda: load_lora_into(ro.model.transformer, args.lora))
    return cfg, ro


def load_lora_into(transformer: object, directory: str) -> None:
    """Load a run's export into a transformer, checked against its manifest first: an adapter (OUT/lora,
    OUT/lora_ema, OUT/lora_best) as a pipeline would, or a full fine-tuning's OUT/transformer_ema (and the
    others) in place of the base weights (rl.export.load_trained)."""
    from solrl_engine.rl.export import load_trained

    load_trained(transformer, directory)


def _sample(args: argparse.Namespace) -> int:
    from solrl_engine.data import load_prompts
    from solrl_engine.evaluation import EvalResult
    from solrl_engine.viz import image_grid

    if (args.prompt is None) == (args.split is None):
        raise SystemExit("give exactly one of --prompt TEXT or --split PROMPT_SET (heldout, sample/test, a file)")
    seeds = _parse_seeds(args.seeds)
    for flag, path in (("--out", args.out), ("--json", args.json)):
        _file_destination(flag, path)  # before anything is sampled, not after
    split = args.split if args.split is None or "/" in args.split or ":" in args.split else f"shapes/{args.split}"
    base = [args.prompt] if args.prompt else _checked(lambda: load_prompts(split))[: args.max_prompts]
    prompts = [p for p in base for _ in seeds]
    all_seeds = [s for _ in base for s in seeds]
    cfg, ro = _rollouts_from_args(args)
    import torch

    _checked(lambda: ro.reward(torch.zeros(len(base), 3, 8, 8), base))  # validates the prompts before sampling
    scored = ro.generate(prompts, all_seeds)
    res = EvalResult(prompts, all_seeds, scored.images.cpu(), scored.rewards.cpu(), scored.components)
    rewards = res.rewards.tolist()
    head = f"{cfg.model}, {cfg.full_steps} steps, mean {cfg.reward} reward {res.mean:.3f}"
    captions = [f"{r:.2f}" if args.prompt else f"{r:.2f} {p}" for r, p in zip(rewards, prompts, strict=True)]
    image_grid(res.images, captions, ncol=min(len(seeds), 16), header=head).save(args.out)
    files = [None] * len(prompts)
    if args.save_dir:
        from PIL import Image

        d = Path(args.save_dir)
        d.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(res.images):
            name = d / f"{i:04d}_seed{all_seeds[i]}.png"
            Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(name)
            files[i] = str(name)
    if args.json:
        with open(args.json, "w") as f:
            for p, s, r, fn in zip(prompts, all_seeds, rewards, files, strict=True):
                f.write(json.dumps({"prompt": p, "seed": s, "reward": r, "file": fn}) + "\n")
    print(f"{head}; grid written to {args.out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Mean of each reward over a prompt set with a trained LoRA (or the base model), plus grids; with
    --compare-base also the base model on the same prompts and seeds, side by side (compare.png)."""
    from solrl_engine.data import load_prompts
    from solrl_engine.evaluation import (
        COMPARE_GIF,
        COMPARE_PNG,
        Comparison,
        compare_figure,
        compare_gif,
        eval_grid,
        evaluate_rollouts,
    )
    from solrl_engine.rl.runtime import build_rollouts
    from solrl_engine.store.safe import json_text, write_atomic
    from solrl_engine.viz import save_image

    for flag, value, what in (("--seeds", args.seeds, "seeds per prompt"),
                              ("--max-prompts", args.max_prompts, "how many prompts to evaluate")):  # fmt: skip
        if value < 1:
            raise SystemExit(f"error: {flag} {value}: must be >= 1 ({what})")
    _output_given(args.output)
    out = Path(args.output)
    _own_output(out)
    cfg = _load_cfg(args)
    if args.compare_base and not args.lora:
        raise SystemExit("error: --compare-base compares an adapter with the base model: give it with --lora "
                         "(a run's lora_ema/, lora/ or lora_best/)")  # fmt: skip
    prompts = _checked(lambda: load_prompts(args.prompts or cfg.eval_prompts))[: args.max_prompts]
    ro = _checked(lambda: build_rollouts(cfg))
    base = evaluate_rollouts(ro, prompts, args.seeds, tag="base") if args.compare_base else None
    if args.lora:
        _checked(lambda: load_lora_into(ro.model.transformer, args.lora))
    res = evaluate_rollouts(ro, prompts, args.seeds)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"config": cfg.name, "model": cfg.model, "lora": args.lora, "prompts": len(prompts),
               "seeds_per_prompt": args.seeds, **res.summary()}  # fmt: skip
    cmp = None if base is None else Comparison(base, res)
    if cmp is not None:
        summary.update(base_reward_mean=base.mean, base_reward_stderr=base.stderr, paired_gain=cmp.gain[0],
                       paired_gain_stderr=cmp.gain[1])  # fmt: skip
    write_atomic(out / "eval.json", json_text(summary))  # strict JSON: a NaN reward is written as null
    lines = []
    for i, (p, s, r) in enumerate(zip(res.prompts, res.seeds, res.rewards.tolist(), strict=True)):
        rec = {"prompt": p, "seed": s, "reward": r}
        if base is not None:
            rec["base_reward"] = base.rewards[i].item()
        lines.append(json_text(rec, indent=None) + "\n")
    write_atomic(out / "samples.jsonl", "".join(lines))
    head = f"{cfg.name}{' + ' + args.lora if args.lora else ''}: {cfg.reward} {res.mean:.3f} +- {res.stderr:.3f}"
    save_image(eval_grid(res, args.seeds, head), out / "grid.png")
    print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.summary().items()))
    print(f"wrote {out / 'eval.json'}, {out / 'samples.jsonl'} and {out / 'grid.png'}")
    if cmp is not None:
        g, se = cmp.gain
        head = f"{cfg.name}: base vs {args.lora}, paired gain {g:+.3f} +- {se:.3f} ({len(res.rewards)} images)"
        save_image(compare_figure(cmp, head, ("base", "with LoRA"), seeds_per_prompt=args.seeds), out / COMPARE_PNG)
        compare_gif(out / COMPARE_GIF, cmp, seeds_per_prompt=args.seeds)  # videos: the pairs as they play
        print(cmp.line(out / COMPARE_PNG, what=args.lora))
    bad = [f"{p!r} seed {s}" for p, s, r in zip(res.prompts, res.seeds, res.rewards.tolist(), strict=True)
           if not math.isfinite(r)]  # fmt: skip
    if bad:  # never a NaN mean with exit 0
        print(f"error: {len(bad)} of {len(res.rewards)} rewards are not finite (NaN or inf; written as null in "
              f"{out / 'samples.jsonl'}), first {', '.join(bad[:3])}: the adapter or the reward is broken (a run "
              "that diverged? check its metrics.jsonl), so this evaluation means nothing", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _own_output(out: Path) -> None:
    """`solrl eval` writes only into a folder of its own: a training run's directory (its marker, lock or
    checkpoints) is refused before anything loads, with the folder to use instead."""
    from solrl_engine.store import rundir

    if out.is_dir() and (rundir.is_run(out) or (out / rundir.LOCK).exists()):
        raise SystemExit(f"error: --output {out} is a training run's directory; `solrl eval` does not write into "
                         f"one (its compare.png and files are the run's): pass --output {out / 'eval'}")  # fmt: skip


def _file_destination(flag: str, path: str | None) -> None:
    """A file the command will write (`--out`, `--json`, `--output`): its folder must exist, checked before
    any work, so a typo does not cost the run's result."""
    if path is None:
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise SystemExit(f"error: {flag} {path}: the folder {folder} does not exist; create it or choose another "
                         "path (nothing was run)")  # fmt: skip
    if Path(path).is_dir():
        raise SystemExit(f"error: {flag} {path} is a directory; name a file in it (nothing was run)")


def _output_given(output: str | None) -> None:
    """An empty --output would mean the current directory (or the default): refused rather than guessed."""
    if output is not None and not output.strip():
        raise SystemExit("error: --output is empty: name a directory (or leave --output out for the default)")


def _checked(fn):  # noqa: ANN001, ANN202 - a thunk and its value
    """Run `fn`; a missing file or a bad value exits with its message, without a traceback."""
    try:
        return fn()
    except (OSError, ValueError, ImportError, TypeError) as e:
        from solrl_engine.rl import ConfigError

        prefix = "config error" if isinstance(e, ConfigError) else "error"
        raise SystemExit(f"{prefix}: {e}") from None


def _load_cfg(args: argparse.Namespace):  # noqa: ANN202 - RLConfig, imported lazily
    from solrl_engine.rl import ConfigError, load_config

    try:
        return load_config(args.config, args.set or [])
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def _train(args: argparse.Namespace) -> int:
    import contextlib
    import dataclasses
    import logging
    import os

    from solrl_engine.rewards.remote import RewardServerLost
    from solrl_engine.rl.guards import NonFiniteError
    from solrl_engine.rl.trainer import Trainer
    from solrl_engine.store import rundir
    from solrl_engine.store.checkpoint import DiskFull

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _output_given(args.output)
    mode = _checked(lambda: rundir.start_mode(args.resume, args.overwrite, args.auto_resume))
    cfg = _load_cfg(args)
    if args.output:
        cfg = dataclasses.replace(cfg, output=args.output)
    out = Path(cfg.output or f"runs/{cfg.name}")
    trainer = None
    with contextlib.ExitStack() as held:
        try:
            with rundir.start_up_signals():  # SIGTERM / SIGHUP while loading: one line, nothing changed
                if os.environ.get("RANK", "0") == "0":  # before any model loads: one writer, nothing clobbered
                    _checked(lambda: held.enter_context(rundir.hold(out)))
                    _checked(lambda: rundir.check_start(out, mode))
                trainer = _checked(lambda: Trainer(cfg))
                _start_banner(cfg, trainer)
            summary = trainer.run(resume=mode == "resume", overwrite=mode == "overwrite", auto_resume=mode == "auto")
        except (KeyboardInterrupt, rundir.Stopped) as e:
            return _stopped_at_once(e, out)
        except RewardServerLost as e:  # a reward server that stayed away: at start, run again; mid-run, resumable
            if trainer is None:
                again = "nothing was started: run the same command again once it answers"
                raise SystemExit(f"error: {e}\n{again}") from None
            raise SystemExit(f"error: {e}\ncontinue with: {_resume_command(args, out)}") from None
        except (NonFiniteError, ValueError, OSError) as e:
            if isinstance(e, DiskFull):  # a run that checkpointed before: say how to go on once space is freed
                again = _resume_command(args, out)
                raise SystemExit(f"error: {e}\nonce that is fixed, continue with: {again}") from None
            raise SystemExit(f"error: {e}") from None
    print(json.dumps(summary, indent=2))
    if summary.get("stopped_by") and summary["iterations"] >= cfg.iterations:  # the signal came as it finished
        print(f"{summary['stopped_by']} arrived during the last iteration: the run finished all {cfg.iterations} "
              "iterations and is complete (nothing to resume)")  # fmt: skip
    elif summary.get("stopped_by"):  # the last line says so, and how to go on; the exit code says which signal
        import signal

        again = _resume_command(args, out)
        where = " (under the same torchrun line)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"stopped by {summary['stopped_by']} at iteration {summary['iterations']} of {cfg.iterations}, with a "
              f"checkpoint; continue with{where}: {again}")  # fmt: skip
        return rundir.EXIT_CODES[signal.Signals[summary["stopped_by"]]]
    if summary.get("compare_png") and summary.get("heldout_gain_final") is not None:  # the line a run ends with
        what = "EMA adapter" if cfg.train_mode == "lora" else "EMA weights"
        print(f"before/after: {summary['compare_png']} (base vs {what}, same prompts and seeds); held-out "
              f"reward {summary['heldout_reward_start']:.3f} -> {summary['heldout_reward_final']:.3f}, paired gain "
              f"{summary['heldout_gain_final']:+.3f} +- {summary['heldout_gain_stderr_final']:.3f}")  # fmt: skip
    return 0


def _resume_command(args: argparse.Namespace, out: Path) -> str:
    """The command that resumes this run where it stopped."""
    import shlex

    sets = [a for s in args.set or [] for a in ("--set", s)]
    return shlex.join(["solrl", "train", args.config, *sets, "--output", str(out), "--resume"])


def _start_banner(cfg, trainer) -> None:  # noqa: ANN001 - RLConfig and Trainer, imported lazily
    print(
        f"{cfg.name}: model {cfg.model}, family {cfg.family}, N={cfg.n} -> K={cfg.k}, {cfg.prompts_per_iter} "
        f"prompts/iter, {cfg.iterations} iterations, output {trainer.out}"
    )
    spec = trainer.explore_spec
    if spec is not None and trainer.dist.main:
        print(f"explore: {trainer.explorer.recipe_label} ({spec.reason})")
    if trainer.explore is not None and trainer.dist.main:
        print(trainer.explore.report.summary())
        if trainer.explore.producers is not None and trainer.explore.producers.summary():
            print(trainer.explore.producers.summary())
        print(f"(every layer's decision: {trainer.out / 'quantization.txt'})")


def _stopped_at_once(e: BaseException, out: Path) -> int:
    """Ctrl-C or SIGTERM / SIGHUP during start-up, or a second Ctrl-C during the run: one line, its code."""
    import signal

    from solrl_engine.store import rundir
    from solrl_engine.store.checkpoint import latest

    signum = e.signum if isinstance(e, rundir.Stopped) else signal.SIGINT
    name = signal.Signals(signum).name
    if isinstance(e, rundir.Stopped) and e.iteration is not None:
        ck = latest(out / "checkpoints")
        then = f"`--resume` continues from {ck}" if ck else "no checkpoint was written yet: start it again"
        print(f"stopped by a second {name} during iteration {e.iteration + 1}, without its checkpoint; {then}",
              file=sys.stderr)  # fmt: skip
    else:
        print(f"stopped by {name} during start-up, before training began: nothing in {out} was changed",
              file=sys.stderr)  # fmt: skip
    return rundir.EXIT_CODES[signum]


def _fidelity(args: argparse.Namespace) -> int:
    from solrl_engine.rl.fidelity import fidelity, search, write_report

    _file_destination("--output", args.output)
    cfg = _load_cfg(args)
    if args.tolerance is not None and not args.search:
        raise SystemExit("--tolerance applies to --search (the rule within that Spearman of the policy's previews)")
    if args.search:
        res = _checked(lambda: search(cfg, target=args.target, prompts=args.prompts, n=args.n, k=args.k,
                                      oracle_cache=args.oracle_cache, on_point=_print_point,
                                      tolerance=args.tolerance))  # fmt: skip
        path = write_report(res, args.output)
        snippet = Path(args.output).with_suffix(".snippet.py")
        snippet.write_text(f"# solrl fidelity --search: Spearman >= {res['target_spearman']:.4f} on {res['prompts']} "
                           f"prompts x {res['n']} seeds\n{res['config_snippet']}\n")  # fmt: skip
        ch = res["chosen"]
        if res["policy_previews"]:
            print(f"previews at the policy's precision: spearman_mean={res['policy_previews']['spearman_mean']:.3f}; "
                  f"target {res['target_spearman']:.3f} (tolerance {res['tolerance']})")
        if ch["include"]:
            print(f"chosen: {len(ch['include'])} layer group(s), "
                  f"quantized_flop_share={ch['quantized_flop_share']:.3f}, spearman_mean={ch['spearman_mean']:.3f}")
        else:
            print(f"{res['verdict']}; the table in {path} shows how close each came")
        print(f"use it: {res['set_arg']}\nwrote {path} and {snippet}")
        return 0
    res = _checked(lambda: fidelity(cfg, prompts=args.prompts, n=args.n, k=args.k, oracle_cache=args.oracle_cache))
    path = write_report(res, args.output)
    keys = ("spearman_mean", "kendall_mean", "top_overlap_mean", "bottom_overlap_mean", "quantized_flop_share",
            "time_proxy_s", "time_full_s")  # fmt: skip
    print("  ".join(f"{k}={res[k]:.3f}" for k in keys))
    print(f"explore ({res['explore_recipe']}): {res['fast_path']}")
    print(f"wrote {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from solrl_engine.rl.runtime import Target, resolve

    _file_destination("--json", args.json)
    cfg = _load_cfg(args)
    if args.gpus < 1 or not 0 < args.gpu_memory < 1e6:  # (inf and nan are not a GPU's memory either)
        raise SystemExit("--gpus must be >= 1 and --gpu-memory a size in GiB > 0 (e.g. 80 for an H100)")
    sm = None
    if args.sm is not None:  # 90, 9.0 (torch's spelling) or sm_90
        digits = args.sm.lower().removeprefix("sm_").replace(".", "")
        if not (digits.isdigit() and 2 <= len(digits) <= 3 and int(digits) >= 50 and args.sm.count(".") <= 1):
            raise SystemExit(f"--sm {args.sm!r}: a compute capability, e.g. 90 or 9.0 (H100/H200), 100 (B200), "
                             "80 (A100), 89 (L40S)")  # fmt: skip
        sm = (int(digits[:-1]), int(digits[-1]))
    run = _checked(lambda: resolve(cfg, Target.gpu(args.gpu_memory, args.gpus, sm), show=True))
    plan = run.memory
    print("\n".join(run.lines()))
    print(plan.render())
    if args.json:
        from solrl_engine.store.safe import write_atomic

        rec = {**plan.to_dict(), "run": {k: v for k, v in run.to_dict().items() if k != "memory"}}
        _checked(lambda: write_atomic(Path(args.json), json.dumps(rec, indent=2)))
        print(f"wrote {args.json}")
    return 0 if plan.fits else 3


def _reward_serve(args: argparse.Namespace) -> int:
    """Serve the named rewards until interrupted (solrl_engine.rewards.serve)."""
    import logging

    from solrl_engine.rewards import parse_reward_args

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from solrl_engine.rewards.serve import serve
    except ImportError as e:
        raise SystemExit(f'error: the reward server needs aiohttp ({e}): pip install -e ".[serve]"') from None
    if not 0 < args.port < 65536 or args.max_batch < 1:
        raise SystemExit("error: --port must be in 1-65535 and --max-batch at least 1")
    args_by_name = _checked(lambda: parse_reward_args(args.arg))
    _checked(lambda: serve(args.rewards, args_by_name, args.host, args.port, args.device, args.max_batch,
                           args.max_bytes))  # fmt: skip
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Check every checkpoint and exported adapter of a run directory against its manifest."""
    from solrl_engine.store.checkpoint import verify_run

    out = Path(args.output)
    if not out.is_dir():
        raise SystemExit(f"error: {out} is not a directory; pass a run directory (a `solrl train` --output)")
    found = verify_run(out)
    if not found:
        raise SystemExit(f"error: {out} holds no checkpoints/ and no exported lora*/ directory: is it a run directory?")
    width = max(len(str(v.path.relative_to(out))) for v in found)
    for v in found:
        print(f"{str(v.path.relative_to(out)):<{width}}  {v.status:<12}  {v.detail}")
    bad = [v for v in found if v.status in ("damaged", "refused")]
    if bad:
        print(f"{len(bad)} of {len(found)} damaged or refused: `solrl train ... --resume` skips damaged checkpoints "
              "(falling back to the newest one that verifies); restore damaged adapters from a copy")  # fmt: skip
        return 1
    old = sum(v.status in ("old", "unverifiable") for v in found)
    print(f"{len(found) - old} of {len(found)} verified" + (f"; {old} without checksums (written by an earlier "
          "version: the next checkpoint or export writes them with a manifest)" if old else ""))  # fmt: skip
    return 0


def _print_point(p: dict) -> None:
    print(f"  {p['groups']} group(s): quantized_flop_share={p['quantized_flop_share']:.3f} "
          f"spearman={p['spearman_mean']:.3f} kendall={p['kendall_mean']:.3f}", flush=True)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="solrl",
        description="Sol-RL: explore in NVFP4, regenerate the most contrastive seeds in BF16, train on them.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("version", help="versions, device, and which kernel backends are available")
    v.set_defaults(func=_version)

    pt = sub.add_parser("pretrain-tiny", help="train the bundled tiny model on the procedural shapes world")
    pt.add_argument("--output", required=True, help="directory for weights, checkpoints, loss.png, sample grids")
    pt.add_argument("--steps", type=int, default=6000)
    pt.add_argument("--batch-size", type=int, default=32)
    pt.add_argument("--lr", type=float, default=5e-4)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    pt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    pt.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in OUTPUT/checkpoints that verifies "
                         "(an old OUTPUT/checkpoint.pt too)")  # fmt: skip
    pt.set_defaults(func=_pretrain_tiny)

    sp = sub.add_parser("sample", help="sample images, score them, write a grid with each reward under its image")
    sp.add_argument("--config", default=None, help="CONFIG_SPEC: take model, reward, steps, solver from a config")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    sp.add_argument("--model", default="tiny", help="model family: tiny, sd3, flux, sana")
    sp.add_argument("--model-path", default=None, help="pipeline directory or hub id (default: the family's)")
    sp.add_argument("--resolution", type=int, default=None, help="pixels (default: the family's)")
    sp.add_argument("--lora", default=None, help="an exported adapter (a run's lora/, lora_ema/ or lora_best/), "
                    "or a full fine-tuning run's transformer/, transformer_ema/ or transformer_best/")
    sp.add_argument("--solver", default="dpm2", choices=["euler", "dpm2", "unipc"])
    sp.add_argument("--prompt", default=None)
    sp.add_argument("--split", default=None,
                    help="a prompt set instead: train, heldout (the shapes world), sample/test, a .txt/.jsonl file")
    sp.add_argument("--max-prompts", type=int, default=8, help="with --split: how many prompts")
    sp.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 1,5,9")
    sp.add_argument("--steps", type=int, default=10)
    sp.add_argument("--shift", type=float, default=None, help="override the model's schedule shift")
    sp.add_argument("--reward", default="shapes")
    sp.add_argument("--out", default="grid.png")
    sp.add_argument("--save-dir", default=None, help="also write each image as a PNG here")
    sp.add_argument("--json", default=None, help="write one JSON record per image (prompt, seed, reward, file)")
    sp.set_defaults(func=_sample)

    tr = sub.add_parser("train", help="Sol-RL post-training: solrl train configs/tiny.py:tiny_sol_rl_shapes")
    tr.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    tr.add_argument("--output", default=None, help="run directory (default: runs/<config name>)")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint that verifies (none: an error, nothing changed)")
    tr.add_argument("--overwrite", action="store_true",
                    help="start over in an output directory that holds a run: once the start is validated, the old "
                         "run is moved to OUTPUT/replaced-<time>/ (nothing is deleted)")
    tr.add_argument("--auto-resume", action="store_true",
                    help="resume when OUTPUT holds a checkpoint, else start (moving a run without one aside): for "
                         "job scripts that are requeued after preemption")  # fmt: skip
    tr.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="mean of each reward over a prompt set, with a trained LoRA: grids + JSON")
    ev.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function (model, reward, steps, solver)")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE")
    ev.add_argument("--lora", default=None, help="a run's lora/, lora_ema/ or lora_best/ (full fine-tuning: "
                    "transformer_ema/ ...); none: the base")
    ev.add_argument("--prompts", default=None, help="prompt set (default: the config's eval_prompts)")
    ev.add_argument("--max-prompts", type=int, default=10**9)
    ev.add_argument("--seeds", type=int, default=4, help="seeds per prompt (0 .. N-1)")
    ev.add_argument("--output", default="eval", help="directory for eval.json, samples.jsonl, grid.png")
    ev.add_argument("--compare-base", action="store_true",
                    help="also the base model on the same prompts and seeds: OUTPUT/compare.png side by side "
                         "and the paired gain (needs --lora)")  # fmt: skip
    ev.set_defaults(func=_eval)

    fi = sub.add_parser("fidelity", help="rank fidelity of quantized previews vs BF16 full-step rollouts")
    fi.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function")
    fi.add_argument("--set", action="append", metavar="KEY=VALUE")
    fi.add_argument("--prompts", type=int, default=32)
    fi.add_argument("--n", type=int, default=96)
    fi.add_argument("--k", type=int, default=24)
    fi.add_argument("--output", default="fidelity.json")
    fi.add_argument("--oracle-cache", default=None, metavar="FILE",
                    help="keep the full-step oracle rewards in FILE (JSON): later runs with the same weights "
                         "and settings measure the previews only")  # fmt: skip
    fi.add_argument("--search", action="store_true",
                    help="pick the layer groups to quantize: the largest FLOP share in the explore format (set it "
                         "with --set explore_precision=fp8|int8|nvfp4) at --target Spearman; "
                         "writes OUTPUT and OUTPUT's .snippet.py with the explore_layers rule")  # fmt: skip
    fi.add_argument("--target", type=float, default=0.93, help="Spearman the searched rule must keep (default 0.93)")
    fi.add_argument("--tolerance", type=float, default=None,
                    help="with --search: keep Spearman within this of the policy's own previews instead of --target "
                         "(e.g. 0.005 for an 8-bit format's rule); the policy's previews are measured first")
    fi.set_defaults(func=_fidelity)

    pl = sub.add_parser("plan", help="the memory each GPU needs for a config, by part, before renting one (exit 3 "
                                     "when it does not fit, with what to change)")  # fmt: skip
    pl.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE")
    pl.add_argument("--gpus", type=int, default=1,
                    help="GPUs per job (each holds everything unless --set sharding=fsdp)")
    pl.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB", help="memory per GPU in GiB (80)")
    pl.add_argument("--sm", default=None, metavar="CC",
                    help="the GPU's compute capability (90: H100/H200, 100: B200, 80: A100): explore_precision=auto "
                         "is planned over the formats its tensor cores run (default: every GPU format)")  # fmt: skip
    pl.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    pl.set_defaults(func=_plan)

    rs = sub.add_parser("reward-serve", help="serve rewards over HTTP for runs that name them in reward_url")
    rs.add_argument("rewards", help="reward names, comma-separated (solrl_engine.rewards.REWARDS), e.g. pickscore")
    rs.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    rs.add_argument("--port", type=int, default=8000, help="port (8000)")
    rs.add_argument("--device", default=None, help="the device the rewards run on (one per server process)")
    rs.add_argument("--arg", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="a reward's argument, as the config's reward_args (repeatable)")  # fmt: skip
    rs.add_argument("--max-batch", type=int, default=64, help="images scored at once from concurrent requests (64)")
    rs.add_argument("--max-bytes", type=int, default=256 * 2**20, help="the largest request accepted (256 MiB)")
    rs.set_defaults(func=_reward_serve)

    vf = sub.add_parser("verify", help="check a run's checkpoints and exported adapters against their checksums")
    vf.add_argument("output", help="run directory (a `solrl train` --output)")
    vf.set_defaults(func=_verify)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 1 an error (one line), 2 a usage error, 128 + N stopped by signal N (130 SIGINT,
    143 SIGTERM, 129 SIGHUP; a stopped `solrl train` has checkpointed and names the command that resumes)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"interrupted (Ctrl-C): `solrl {args.command}` stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
