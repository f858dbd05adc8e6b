#!/usr/bin/env bash
# One call (<= 8 min on one H200): Bench B1's comparison at a GPU-sized shape (gpu-llama-1b, bf16, P = 32k/64k,
# R = 512, G in {2, 8}) and the micro-batch x chunk Pareto sweep, each configuration in a fresh process; JSON (+ PNG)
# into the directory given as the first argument, else $OUT, else bench/results/gpu-<time>.
#
#   bench/gpu.sh                      # on the GPU machine
#   bench/gpu.sh /tmp/x --device cpu --smoke   # dry run on CPU (seconds; the test suite runs it)
#
# Python: $PYTHON, else ./.venv/bin/python, else python3; the package is imported from src/ (no install needed).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${OUT:-}"
if [[ $# -gt 0 && "$1" != --* ]]; then DIR="$1"; shift; fi
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ARGS=()
[[ -n "$DIR" ]] && ARGS+=(--out-dir "$DIR")
exec "$PY" -m longstraw.bench.gpu "${ARGS[@]}" "$@"
