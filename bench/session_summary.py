"""bench/gpu_session.py's one-screen summary, printed after every stage (a call cut off at its limit has
printed what finished) and kept in the JSON as `summary`.

Why its own file: the session script measures; this reads its record. Sol-RL's headline (the real trainer
iterations) comes first, then the preflight, the GPU tests, the ceilings and each model's forwards table.
"""

from __future__ import annotations

from typing import Any


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(entry: dict[str, Any], mode: str) -> float | None:
    """A precision's forward in ms: eager, or compiled (the compiled forward, not its graph replay)."""
    if mode == "eager":
        return entry.get("eager_ms")
    return (entry.get("compiled") or {}).get("forward_ms")


def _why(d: dict[str, Any]) -> str:
    """The first line of why an entry has no result (skipped, error, cut off), or ""."""
    text = str(d.get("skipped") or d.get("error") or d.get("timed_out") or "") if d else ""
    return text.splitlines()[0][:100] if text else ""


def trainer_lines(key: str, s: dict[str, Any]) -> list[str]:
    """A trainer stage in a few lines: each family's measured seconds per iteration, Sol-RL's ratios, and
    measured over predicted (1.0: the iteration table's formula accounts for the whole iteration)."""
    argv = s.get("argv", [])
    cold = "--warmup" in argv and argv[argv.index("--warmup") + 1 :][:1] == ["0"]  # (a video stage: no warm-up)
    lines = [f"{key} ({' '.join(argv[2:])}): one iteration" + ("" if cold else " after a warm-up")]
    pred = s.get("predicted_from_forwards", {})
    for fam, m in s.get("families", {}).items():
        if "time_rollout_s" not in m:
            lines.append(f"  {fam:<14} {_why(m) or 'not run'}")
            continue
        p = pred.get(fam, {})
        vs = (f"; measured / predicted: rollout {_f(p.get('measured_over_predicted_rollout'), 2)}, total "
              f"{_f(p.get('measured_over_predicted_total'), 2)}") if p else ""  # fmt: skip
        peak = f", peak {m['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in m else ""
        lines.append(f"  {fam:<14} rollout {m['time_rollout_s']:.2f} s, train {m['time_train_s']:.2f} s, total "
                     f"{m['time_total_s']:.2f} s, compile {m['time_compile_s']:.0f} s{peak} "
                     f"({m['explore_recipe']}){vs}")  # fmt: skip
    for base, r in s.get("sol_rl_vs", {}).items():
        lines.append(f"  sol_rl vs {base}: rollout {r['time_rollout_s']:.2f}x, iteration {r['time_total_s']:.2f}x")
    fe = s.get("update_forward_equivalents") or {}
    if fe:
        sizes = (s.get("families", {}).get("sol_rl") or {}).get("update_sizes") or {}
        lines.append("  update per trained sample-step, in compiled forwards at rollout batch: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in fe.items())
                     + (f" (micro-batch {sizes.get('train_batch_size')}, recompute "
                        f"{sizes.get('gradient_checkpointing')})" if sizes else ""))  # fmt: skip
    sol = s.get("families", {}).get("sol_rl", {})
    if str(sol.get("explore_recipe", "")).startswith("policy"):  # the headline without its quantized copy
        why = sol.get("explore_choice_reason")
        lines.append(f"  NOTE: sol_rl explored with the policy, not a quantized copy: {why}")
    if "skipped" in pred:
        lines.append(f"  no prediction: {pred['skipped']}")
    return lines


def train_line(s: dict[str, Any]) -> str:
    """One model's training: the measured nft_update, and the seconds per iteration it adds."""
    upd, tr = s.get("nft_update") or {}, (s.get("iteration") or {}).get("training") or {}
    head = f"{s['model']:<12}train "
    if "ms" not in upd:
        return head + f"nft_update not measured: {_why(upd) or 'not run'}"
    pred = ((s.get("predicted") or {}).get("update_ms") or {}).get("predicted")
    peak = f", peak {upd['peak_gib']:.1f} GiB" if "peak_gib" in upd else ""
    return (head + f"nft_update {upd['ms']:.1f} ms per update batch of {upd['batch']} (pred {_f(pred)}), "
            f"checkpointing {'on' if upd['checkpointing'] else 'off'}{peak}; x {tr.get('update_batches')} update "
            f"batches = {_f(tr.get('train_s'), 2)} s/iteration")  # fmt: skip


FORWARD_HEAD = (
    f"{'':<18}{'--- forward ms ---':>26}{'- vs bf16 -':>14}{'':>8}{'sol_rl / naive':>22}{'':>10}{'vs torchao':>14}"
    f"{'':>7}{'total':>7}",
    f"{'model':<12}{'prec':<6}{'eager':>8}{'pred':>8}{'compiled':>10}{'eager':>7}{'comp':>7}{'fast':>8}{'eager':>7}"
    f"{'comp':>7}{'pred':>7}{'compile s':>10}{'eager':>7}{'comp':>7}{'refr ms':>9}{'eager':>7}  eager profile "
    "(largest shares)",
)  # fmt: skip


def forwards_lines(s: dict[str, Any]) -> list[str]:
    """One model's forwards table: per precision the forward (eager / compiled, measured vs predicted), the
    fast-path count, Sol-RL's rollout ratio, the torchao comparison and the profile's biggest groups."""
    lines: list[str] = []
    bf = s["precisions"].get("bf16", {})
    it, pr = s.get("iteration", {}), s.get("predicted", {})
    for fmt, e in s["precisions"].items():
        if "eager_ms" not in e:
            e = {"skipped": "not run (cut off)", **e}
        if "skipped" in e or "error" in e:
            lines.append(f"{s['model']:<12}{fmt:<6} {_why(e)[:90]}")
            continue
        pred = pr.get("forward_ms", {}).get(fmt, {}).get("eager")
        comp, comp_bf = _ms(e, "compiled"), _ms(bf, "compiled")
        q = fmt != "bf16"
        x = bf["eager_ms"] / e["eager_ms"] if q and bf.get("eager_ms") else None
        xc = comp_bf / comp if q and comp and comp_bf else None
        fpr = e.get("fast_path")
        fast = f"{fpr['fast']}/{fpr['layers']}" if fpr else "-"
        r_e = it.get(f"eager/{fmt}", {}).get("sol_rl_vs_naive_scaling")
        r_c = it.get(f"compiled/{fmt}", {}).get("sol_rl_vs_naive_scaling")
        r_p = pr.get(f"iteration_eager/{fmt}", {}).get("sol_rl_vs_naive_scaling")
        r_t = it.get(f"eager/{fmt}", {}).get("sol_rl_vs_naive_scaling_total")
        cs = (e.get("compiled") or {}).get("compile_s")
        ao = e.get("torchao") or {}
        ao_e = ao["eager_ms"] / e["eager_ms"] if "eager_ms" in ao else None  # our speed / torchao's
        ao_c = _ms(ao, "compiled") / comp if _ms(ao, "compiled") and comp else None
        shares = sorted(e.get("profile_eager", {}).get("share", {}).items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"{s['model']:<12}{fmt:<6}{e['eager_ms']:>8.1f}{_f(pred):>8}{_f(comp):>10}{_f(x, 2):>7}"
                     f"{_f(xc, 2):>7}{fast:>8}{_f(r_e, 2):>7}{_f(r_c, 2):>7}{_f(r_p, 2):>7}{_f(cs, 0):>10}"
                     f"{_f(ao_e, 2):>7}{_f(ao_c, 2):>7}{_f(e.get('refresh_ms')):>9}{_f(r_t, 2):>7}  "
                     + " ".join(f"{g} {v:.0%}" for g, v in shares))  # fmt: skip
        made = e.get("quantize_where_made") or {}
        off = e.get("eager_ms_producers_paused")
        if "verdict" in made or off:  # issue 40's check: no standalone quantize kernel where a producer exists
            worth = f"; eager {off:.1f} ms with them paused ({off / e['eager_ms']:.2f}x)" if off else ""
            lines.append(f"{'':<18}producers: {made.get('verdict', 'not counted (a CPU profile)')}{worth}")
        c = e.get("compiled") or {}
        if q and c.get("census_summary"):  # traced scaled GEMMs (quantize fused) or opaque ops, per compiled graph
            n = c.get("census") or {}
            fed = f"{n['fed']} of {n['traced']} traced GEMMs read a producer's codes; " if "fed" in n else ""
            lines.append(f"{'':<18}compiled: {fed}{c['census_summary'][:100]}")
        if c.get("graphed_error"):
            lines.append(f"{'':<18}graph capture: {c['graphed_error'].splitlines()[0][:100]}")
        why = ao.get("skipped") or ao.get("error") or (ao.get("compiled") or {}).get("error")
        if why:
            lines.append(f"{'':<18}torchao: {why.splitlines()[0][:100]}")
    lines.append(train_line(s))
    return lines


def summary_lines(rec: dict[str, Any]) -> list[str]:
    """One screen: the device and clock, Sol-RL's trainer iterations, the preflight, the GPU tests, the
    ceilings, then each model's forwards table; a stage cut off or skipped says so."""
    info = rec.get("info", {})
    where = info.get("capability", info.get("device"))
    lines = [f"gpu_session call {rec.get('call') or '-'} on {info.get('name')} ({where}), torch {info.get('torch')}; "
             f"{rec['elapsed_s']:.0f} s of {rec['budget_s']:.0f} s budget"]  # fmt: skip
    stages = rec["stages"]
    for key, s in stages.items():
        if key.startswith("trainer:") and "families" in s:
            lines.extend(trainer_lines(key, s))
    pre = stages.get("preflight")
    if pre:
        checks = [k for k, v in pre.items() if isinstance(v, dict) and "ok" in v]
        lines.append("preflight: " + ", ".join(f"{k} {'ok' if pre[k]['ok'] else 'FAILED'}" for k in checks)
                     + (f" ({pre['message']})" if pre.get("message") else ""))  # fmt: skip
    tests = stages.get("gpu-tests")
    if tests and "counts" in tests:
        c = tests["counts"]
        failed = tests.get("failed_tests") or []
        lines.append(f"gpu tests: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('errors', 0)} "
                     f"errors, {c.get('skipped', 0)} skipped in {tests['seconds']:.0f} s"
                     + (f"; failed: {', '.join(failed[:4])}" if failed else ""))  # fmt: skip
    c = rec.get("ceilings")
    if c:

        def rate(key: str, unit: str) -> str:
            v = c.get(key, {})
            return f"{v[unit]:.3g}" if unit in v else "skip"

        lines.append(f"ceilings {c['gemm_shape']}: copy {c['copy']['gb_per_s']:.0f} GB/s, bf16 "
                     f"{rate('bf16_mm', 'tflops')} TFLOP/s, fp8 {rate('fp8_scaled_mm_rowwise', 'tflops')}, "
                     f"int8 {rate('int8_int_mm', 'tops')} TOP/s")  # fmt: skip
        att = c.get("attention")
        if att:
            parts = [f"{k} {v['median_ms']:.2f} ms" + (f" ({v['speedup_vs_sdpa']:.2f}x)" if "speedup_vs_sdpa" in v
                     else "") + f" err {v['rel_error']:.1e}" if "median_ms" in v else f"{k} skipped"
                     for k, v in att.items() if isinstance(v, dict)]  # fmt: skip
            lines.append(f"attention {att['shape']}: " + ", ".join(parts))
        prod = c.get("producers")
        if prod:  # the fused producer kernels against the unfused ops they replace
            parts = [f"{k.split()[0]} {v['fused_speedup']:.2f}x ({v['fused_gb_per_s']:.0f} GB/s)"
                     + (f", codes alone {v['codes_alone_speedup']:.2f}x" if "codes_alone_speedup" in v else "")
                     if "fused_ms" in v else f"{k.split()[0]} failed"
                     for k, v in prod.items() if isinstance(v, dict)]  # fmt: skip
            lines.append(f"producers ({prod['format']}, {prod['rows']} rows) fused vs unfused: " + ", ".join(parts))
    forwards = [s for k, s in stages.items() if k.startswith("forwards:") and "precisions" in s]
    if forwards:
        lines.extend(FORWARD_HEAD)
        for s in forwards:
            lines.extend(forwards_lines(s))
        lines.append("pred: bench/predict.py's eager roofline from this run's ceilings; sol_rl / naive: rollout "
                     "s/iteration at P=6, N=96, K=24, 6/10 steps (sol_rl's with its refresh); vs torchao: our "
                     "forward's speed over torchao's on the same layers; total: sol_rl / naive s/iteration with "
                     "refresh and nft_update training")  # fmt: skip
    for key, s in stages.items():
        if "error" in s or "timed_out" in s:
            lines.append(f"stage {key}: {_why(s)}" + (f" (during {s['step']})" if s.get("step") else ""))
        if s.get("cuda_broken"):
            lines.append(f"stage {key}: the CUDA context is broken: {s['cuda_broken']}")
        peak = s.get("peak_gib")
        if peak is not None:
            lines.append(f"stage {key}: peak {peak:.1f} GiB of GPU memory, {s.get('seconds', 0):.0f} s")
    for key, why in rec["skipped"].items():
        lines.append(f"stage {key} skipped: {why}")
    return lines
