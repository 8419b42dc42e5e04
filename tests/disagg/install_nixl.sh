#!/usr/bin/env bash
# NIXL for the 1P1D tests on the vLLM CPU build: `nixl` (the import name vLLM uses) and
# `nixl-cu13` (its UCX backend, which also moves host memory on a machine without a GPU) from
# PyPI, installed with --no-deps into a directory of their own (default: .venv-nixl in the repo;
# KVBM_NIXL_SITE overrides), which the harness puts first on the engines' PYTHONPATH. The vLLM
# venv itself is not changed. Idempotent; prints the directory on its last line.
#   bash tests/disagg/install_nixl.sh [PYTHON]   (default: $KVBM_VLLM_VENV/bin/python or .venv-vllm)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:-${KVBM_VLLM_VENV:-$repo/.venv-vllm}/bin/python}
site=${KVBM_NIXL_SITE:-$repo/.venv-nixl}
if ! PYTHONPATH=$site "$python" -c "import nixl._api" >/dev/null 2>&1; then
  "$python" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$site" \
    nixl==1.5.1 nixl-cu13==1.5.1 >&2
  PYTHONPATH=$site "$python" -c "import nixl._api" >&2
fi
echo "$site"
