#!/usr/bin/env bash
# The GPU queue's next slices on a GPU machine (a bare one: the machine's own Python and torch,
# the wheels of `make gpu-wheels` from .gpu/wheels installed into /tmp/gpu-site first), or at
# smoke size on a machine without CUDA. Flags go to `python -m benchmarks.gpu_queue next`
# (--budget-min 9.5 by default). Set GIT_COMMIT where the tree has no .git; records go to
# docs/results/gpu-queue/ and, when $OUT is set, to $OUT too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
if compgen -G ".gpu/wheels/*.whl" >/dev/null && ! "$PY" -c "import hivemind" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-site .gpu/wheels/*.whl
  export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/gpu-site/bin:$PATH"
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_queue next "$@"
