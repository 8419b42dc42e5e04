# Source on the GPU machine, from the repo root, after benchmarks/vllm_gpu_install.sh:
#   . benchmarks/gpu_env.sh
# The environment of every GPU command of benchmarks/ and tests/stress: the carried wheels first,
# NVLink multicast off (the machines' rule), FlashInfer's JIT sampler off (greedy does not use it),
# and KVBM_VLLM_VENV pointing at a "venv" whose python is the machine's python3 (tests/stress and
# tests/disagg start engines with "$KVBM_VLLM_VENV/bin/python").
export PYTHONPATH=$PWD:/tmp/site:$PWD/.site HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT=/tmp/vc PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a wheel of the bundle installs a top-level "tests" package, which would shadow ours
rm -rf .site/tests
mkdir -p /tmp/gv/bin
printf '#!/bin/sh\nexec python3 "$@"\n' >/tmp/gv/bin/python && chmod +x /tmp/gv/bin/python
export KVBM_VLLM_VENV=/tmp/gv
