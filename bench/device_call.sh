#!/usr/bin/env bash
# One device call of the GPU session, exactly as the lent machine runs it (docs/gpu-session.md). The device
# tool's command is `bash bench/device_call.sh 1` (then `... 2`), with carry [".whl"] and timeout_s 600:
#   1: the GPU tests (first, in their own process), the preflight, Sol-RL's trainer iterations on SANA-1.6B
#   2: Sol-RL's trainer iterations on FLUX.1-dev (never completed on a GPU before)
#   3: ceilings, SANA-1.6B's, FLUX.1-dev's and SD3.5-L's forwards, when device time is left
#   4: ceilings, Wan2.1-1.3B's and Wan2.1-14B's forwards (video, 480 x 832 x 81 frames), when device time is left
#   5: Sol-RL's trainer iteration on Wan2.1-1.3B (480 x 832 x 81 frames, N = 16, K = 4), when device time is left
# The machine is bare and the project is NOT installed: the carried wheels (diffusers and what it needs, torchao)
# go into $SOLRL_SITE (default /tmp/site), and the checkout runs from PYTHONPATH. Everything is logged to
# $OUT/gpu_session.log beside $OUT/gpu_session.json. Arguments after the call number go to bench/gpu_session.py;
# tests/test_gpu_rehearsal.py runs this file on the CPU with `--smoke` (and PYTHON="python -S").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
call=${1:?"usage: bash bench/device_call.sh 1|2|3|4|5 [gpu_session.py arguments]"}
shift
: "${OUT:?OUT must name the folder the results go to (the device machine sets it)}"
mkdir -p "$OUT"
site=${SOLRL_SITE:-/tmp/site}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "device_call: installing the carried wheels into $site failed" | tee -a "$OUT/gpu_session.log"; exit 3; }
fi
export PYTHONPATH="$site:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# shellcheck disable=SC2086  # PYTHON may carry flags ("python -S")
${PYTHON:-python3} bench/gpu_session.py --call "$call" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_session.log"
exit "${PIPESTATUS[0]}"
