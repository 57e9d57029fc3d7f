#!/usr/bin/env bash
# The declared dependency floors, tested: install diffusers, transformers, peft and huggingface_hub at
# exactly the lowest versions pyproject.toml allows (with everything else resolved around them) into
# a throwaway virtual environment, and run the tests that exercise them: the real diffusers pipelines,
# the reward models, the Explorer and the tiny test pipelines. A resolver's "satisfied" is not
# evidence that those versions work; this run is (docs/dependency-floors.md).
#
#   bash bench/floors.sh                    # venv in /tmp/venv-floors, prints the pass/fail summary
#   VENV=/tmp/v RECORD=bench/results/DATE-cpu-dependency-floors.json bash bench/floors.sh
#   PINS="diffusers==0.36.0 transformers==5.0.0" bash bench/floors.sh   # try other versions (bisecting)
#
# On a CPU-only machine torch comes from the CPU wheel (TORCH, default torch==2.13.0) first, as in .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/venv-floors}
TORCH=${TORCH:-torch==2.13.0}
TESTS=(tests/test_real_models.py tests/test_rewards_real.py tests/test_explorer.py tests/test_tiny_pipelines.py
       tests/test_z_image.py tests/test_flux2.py tests/test_sana_video.py tests/test_flux_kontext.py tests/test_qwenimage_edit.py
       tests/test_wan_experts.py tests/test_context_parallel.py tests/test_producers.py)

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  python -m pip install --quiet "$TORCH"
fi
# the floors as pins: "name>=X" in pyproject.toml's dependencies -> "name==X"
FLOORS=$(python - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
names = ("diffusers", "transformers", "peft", "huggingface_hub")
pins = [re.sub(r">=", "==", d) for d in deps if re.split(r"[<>=!~ ]", d)[0].replace("-", "_") in names]
missing = set(names) - {re.split(r"[<>=!~ ]", p)[0].replace("-", "_") for p in pins}
if missing:
    raise SystemExit(f"pyproject.toml declares no floor for {sorted(missing)}: add 'name>=X' to dependencies")
print(" ".join(pins))
EOF
)
PINS=${PINS:-$FLOORS}
echo "== installing the project with $PINS"
python -m pip install --quiet -e ".[dev]" $PINS
VERSIONS=$(python -c "
import importlib.metadata as m
print(' '.join(f'{p}=={m.version(p)}' for p in ('diffusers', 'transformers', 'peft', 'huggingface_hub', 'torch')))")
echo "== installed: $VERSIONS"
set +e
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee /tmp/floors-pytest.log
rc=${PIPESTATUS[0]}
set -e
if [ -n "${RECORD:-}" ]; then
  python - "$RECORD" "$rc" "$VERSIONS" "${TESTS[@]}" <<'EOF'
import json, platform, re, sys
from datetime import date
path, rc, versions, tests = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
log = open("/tmp/floors-pytest.log").read().strip().splitlines()
tail = log[-1]
failed = [x.split(" ")[1] for x in log if x.startswith(("FAILED ", "ERROR "))]
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
run = {"date": str(date.today()), "machine": platform.machine(), "python": platform.python_version(),
       "versions": dict(v.split("==") for v in versions.split()), "tests": tests,
       "result": "pass" if rc == 0 else "fail", "pytest_summary": tail, "counts": counts, "failed": failed}
try:  # one file per bisection: every run tried is kept, the last one is the floors' run
    rec = json.load(open(path))
except FileNotFoundError:
    rec = {"bench": "bench/floors.sh: diffusers, transformers, peft, huggingface_hub installed at exactly these "
                    "versions, and the tests that exercise them run (docs/dependency-floors.md)", "runs": []}
rec["runs"].append(run)
json.dump(rec, open(path, "w"), indent=2)
print(f"recorded {path}")
EOF
fi
exit "$rc"
