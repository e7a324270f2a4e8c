#!/usr/bin/env bash
# GPU check of the worker's tiered pool (DESIGN.md §8), for a CUDA machine, in < 8 minutes:
# runs the tests marked `gpu` and `kvstream bench offload --device cuda --json`, and
# writes one JSON result file: $1, else $OUT/gpu-check.json when OUT is set, else
# ./gpu-check.json.
#
# It uses the first Python with a CUDA build of torch among $PYTHON, ./.venv/bin/python,
# $KVSTREAM_GPU_VENV (default /tmp/kvstream-gpu-venv) and python3: a virtual environment
# as it is, a system Python through a venv made at $KVSTREAM_GPU_VENV with
# --system-site-packages, so that torch is reused, not downloaded; missing
# small packages are installed with pip. The project runs from this tree (PYTHONPATH), so
# no build is needed; without the compiled hashing kernel, hashing falls back to Python.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
result="${1:-${OUT:+$OUT/gpu-check.json}}"
result="${result:-$PWD/gpu-check.json}"
mkdir -p "$(dirname "$result")"
result="$(cd "$(dirname "$result")" && pwd)/$(basename "$result")"
venv="${KVSTREAM_GPU_VENV:-/tmp/kvstream-gpu-venv}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

base=""
for candidate in "${PYTHON:-}" "$root/.venv/bin/python" "$venv/bin/python" python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then base="$candidate"; break; fi
done
if [ -z "$base" ]; then
    echo "gpu-check: no Python with a CUDA build of torch and a visible GPU (set PYTHON=...)" >&2
    printf '{"ok": false, "error": "no Python with CUDA torch and a visible GPU"}\n' > "$result"
    exit 2
fi
if "$base" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
    py="$base"  # already a virtual environment: use it as it is
else
    echo "==> venv $venv from $base" >&2
    "$base" -m venv --system-site-packages "$venv"
    py="$venv/bin/python"
fi
missing="$("$py" - <<'PY'
import importlib.util
need = {"pytest": "pytest", "numpy": "numpy", "xxhash": "xxhash", "click": "click", "structlog": "structlog"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)"
if [ -n "$missing" ]; then
    echo "==> pip install $missing" >&2
    "$py" -m pip install --quiet $missing
fi

cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Only the GPU test modules are collected, with only their own conftest (--confcutdir:
# the root one needs the Kafka client), so the check needs no more than torch and the above.
set +e
timeout 240 "$py" -m pytest -m gpu tests/worker/test_*gpu*.py --confcutdir="$root/tests/worker" -p no:cacheprovider \
    -o addopts="" -q -rs --junitxml="$work/pytest.xml" > "$work/pytest.log" 2>&1
pytest_rc=$?
timeout 200 "$py" -c 'from kvstream.cli import main; main()' --log-level WARNING \
    bench offload --device cuda --blocks 512 --rounds 3 --json > "$work/bench.json" 2> "$work/bench.err"
bench_rc=$?
set -e
cat "$work/pytest.log" >&2

"$py" - "$work" "$result" "$pytest_rc" "$bench_rc" "$(( $(date +%s) - start ))" <<'PY'
import json, sys, xml.etree.ElementTree as ET
import torch
work, result, pytest_rc, bench_rc, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tests = {"rc": pytest_rc}
try:
    suite = ET.parse(f"{work}/pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        tests[key] = int(suite.get(key, 0))
    tests["failed_cases"] = [
        f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
except (OSError, ET.ParseError) as exc:
    tests["error"] = f"no junit report: {exc}"
tests["log_tail"] = open(f"{work}/pytest.log").read()[-4000:]
bench = {"rc": bench_rc}
try:
    bench["result"] = json.loads(open(f"{work}/bench.json").read())
except ValueError:
    bench["stderr_tail"] = open(f"{work}/bench.err").read()[-4000:]
ok = pytest_rc == 0 and tests.get("skipped", 1) == 0 and bench_rc == 0
out = {"ok": ok, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "elapsed_s": elapsed,
       "pytest_gpu": tests, "bench_offload": bench}
json.dump(out, open(result, "w"), indent=1)
print(json.dumps({"ok": ok, "result": result, "tests": {k: tests.get(k) for k in ("tests", "failures", "errors", "skipped")},
                  "paths": bench.get("result", {}).get("paths")}))
sys.exit(0 if ok else 1)
PY
