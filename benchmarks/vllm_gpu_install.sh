#!/usr/bin/env bash
# On the GPU machine, from the repo root: install the carried vLLM 0.26 wheel bundle
# (../shared/tools/vllm_gpu_bundle.sh .carry, parts .carry/p00..p07) into .site, grpcio (the
# stubs need >= 1.85.1; `.whl/`) into /tmp/site, and write the Qwen3-4B-shaped config that
# vllm_peers.py serves with dummy weights. Idempotent. Then: benchmarks/vllm_gpu_ttft.sh.
# The tree is over 4 MiB since 2026-11-26, so the tree and one 60 MiB part no longer fit the device
# tool's 64 MiB a call: re-split the bundle first (any part size works, the parts are concatenated):
#   cat .carry/p?? > /tmp/b && rm .carry/p?? && split -b 46M -d -a 2 /tmp/b .carry/p   # p00..p09 (46M since 2026-11-27: the tree is 13 MB; carry .whl in a call of its own)
set -eu
if [ ! -d .site/vllm ]; then
  mkdir -p /tmp/w
  cat .carry/p?? | tar x -C /tmp/w
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site /tmp/w/*.whl
fi
if [ -d .whl ] && [ ! -d /tmp/site/grpc ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
PYTHONPATH=/tmp/site:$PWD/.site:$PWD python3 -c "import vllm, grpc, kvbm_client; print('vllm', vllm.__version__, 'grpc', grpc.__version__)"
