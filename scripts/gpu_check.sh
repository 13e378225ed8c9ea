#!/usr/bin/env bash
# The GPU check (issue 22): the CUDA tests, device memory of a training node (135M and the
# Llama-3.2-1B shape), one exchange's tensor work against a device copy, throughput with
# exchanges, two `gasloc-node join` on one GPU that train, gossip and export. Writes
# docs/results/gpu.md. Offline; about 10 minutes on one H100. Flags go to benchmarks/gpu_check.py
# (e.g. --parts memory,engine). Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
  echo "gpu-check: no CUDA device for $PY (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi
exec "$PY" -m benchmarks.gpu_check "$@"
