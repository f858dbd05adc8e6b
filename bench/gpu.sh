#!/usr/bin/env bash
# One call (<= 8 min on one H200), parts in order of priority until a deadline (benchmarks/gpu.py): the
# gpu-marked tests, Bench B1 at a ~1B model (gpu-llama-1b, bf16, P 32K/128K, R 512, G 2/8, every plan), the longest
# exact step, sampling throughput vs transformers generate (and the Pareto sweep with --pareto). JSON, summary.md
# (+ PNG unless --no-plots) into the directory given as the first argument, else $OUT, else bench/results/gpu-<time>.
#
#   bench/gpu.sh                                 # on the GPU machine
#   bench/gpu.sh "$OUT" --no-plots               # on the lent device (its $OUT returns at most 8 files)
#   bench/gpu.sh /tmp/x --device cpu --smoke     # dry run on CPU (seconds; the test suite runs it)
#
# Python: $PYTHON, else ./.venv/bin/python, else python3; the packages are imported from src/ and the repository
# root (no install needed).
# Wheels in .whl/ (e.g. `pip download --no-deps -d .whl transformers==5.24.0`, for a machine that cannot reach PyPI
# and has an older transformers) are installed into a scratch directory first and put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${OUT:-}"
if [[ $# -gt 0 && "$1" != --* ]]; then DIR="$1"; shift; fi
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
SITE=""
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE="$(mktemp -d)/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$PWD:$PWD/src${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
ARGS=()
[[ -n "$DIR" ]] && ARGS+=(--out-dir "$DIR")
exec "$PY" -m benchmarks gpu "${ARGS[@]}" "$@"
