#!/usr/bin/env bash
# On a lent device machine (30 minutes, bare, the project not installed), make the GPU session's two
# device calls instead (docs/gpu-session.md): `bash bench/device_call.sh 1`, then `... 2`.
# This script is the long form, for a machine held for an hour or more.
# Everything that needs a GPU, in the order to run it: correctness first, then kernel benchmarks,
# then end-to-end ones. Each stage writes its log and JSON under OUT (default bench/results) and a
# failing stage does not stop the later ones. Stages: build-ext, gpu-tests, kernels, e2e-tiny,
# e2e-sana, e2e-flux, e2e-sd35 (pick with STAGES="gpu-tests kernels"). Needs: a CUDA PyTorch, triton,
# diffusers, and this package importable (pip install -e . --no-deps, or PYTHONPATH=.); build-ext
# also needs nvcc, cmake and the nvidia-cutlass wheel (pip install --no-deps nvidia-cutlass).
#
#   bash bench/gpu_checks.sh                         # all stages, results into bench/results
#   STAGES="gpu-tests kernels" bash bench/gpu_checks.sh /tmp/out
#
# Seen on one H100 (2026-11-24, torch 2.11 + CUDA 13.0): build-ext 234 s on 16 cores; gpu-tests
# 123 s; kernels 47 s; e2e-tiny's compiled families spend 4-5 min each in max-autotune before
# their first timed iteration (compile time is reported apart), so give e2e-tiny 15 minutes;
# e2e-sana's eager families about 80 s each at --iterations 1. Where diffusers or the CUTLASS
# headers are missing, install their wheels first (diffusers, importlib_metadata, lazy-importer,
# nvidia-cutlass, all pure Python).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-build-ext gpu-tests kernels e2e-tiny e2e-sana e2e-flux e2e-sd35}"

stage() {  # name, command...
  local name=$1
  shift
  if [[ " $STAGES " != *" $name "* ]]; then return 0; fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
# The CUDA extension (solrl_engine._C: fused-amax quantize, CUTLASS sm100 GEMM), built in place.
stage build-ext python -m pip install --no-build-isolation --no-deps -e .
stage gpu-tests python -m pytest -q -m gpu tests/
stage kernels python bench/kernels.py --out "$OUT"
# The bundled model at the paper's N=96 -> K=24 (16 prompts).
stage e2e-tiny python bench/e2e.py --model tiny --paper-scale --iterations 3 --out "$OUT"
# Full-size architectures at the paper's resolutions, N=96 -> K=24; one prompt per iteration keeps
# one H100 within memory and time (say so when quoting the numbers).
stage e2e-sana python bench/e2e.py --model sana-1.6b --prompts 1 --rollout-batch 48 --train-batch 8 --iterations 2 --out "$OUT"
stage e2e-flux python bench/e2e.py --model flux-dev --prompts 1 --rollout-batch 24 --train-batch 4 --iterations 2 --out "$OUT"
stage e2e-sd35 python bench/e2e.py --model sd35-large --prompts 1 --rollout-batch 12 --train-batch 2 --iterations 2 --out "$OUT"
