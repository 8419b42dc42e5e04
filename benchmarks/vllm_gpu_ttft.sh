#!/usr/bin/env bash
# TTFT of kvbm ("ours") against the peers on the real vLLM 0.26 GPU engine, in one harness run.
# Run on the GPU machine from the repo root, after installing the wheel bundle into .site
# (../shared/reference/VLLM_GPU.md) and grpcio into /tmp/site:
#   benchmarks/vllm_gpu_ttft.sh OUT.jsonl baseline,native,lmcache,dynamo,ours [vllm_peers.py args...]
# 20K workload: --users 5 --sys-len 0 --ctx-len 20000 --turn-len 128 --max-len 24576 --g1-gb 4
# 8K workload:  (the harness defaults) --users 8 --sys-len 1024 --ctx-len 6144 --turn-len 256 --g1-gb 3
# Benchmark hygiene (issue 13), vllm_peers.py flags passed through:
#   --passes N     the systems run in order N times (A B C A B C ...), each engine started afresh per
#                  pass; every line carries its "pass", and the run ends with one summary line per
#                  system: the median over the passes of each pass's warm p50 / p90, each pass's value,
#                  "reproduced": false (printed DID NOT REPRODUCE) where the passes differ by > 10 %.
#                  The kvbm service below outlives the passes: "ours" gets a namespace per pass
#                  (pass 0 unchanged), so each pass starts without the blocks of the one before.
#   --cuda-graphs  vLLM's default compilation and CUDA graphs (enforce_eager off; PIECEWISE for Dynamo,
#                  whose save_kv_layer hook does work); default eager. "mode" and the engine's resolved
#                  "cudagraph_mode" are in every line. Compiling makes engines start slower: --timeout 600.
#   --timeout S    seconds per engine (one system in one pass), default 300.
# The first line of OUT records the commit, argv and machine (GPU names from nvidia-smi): on a copy
# of the tree without .git, set KVBM_BENCH_COMMIT to the commit that was copied.
# The kvbm service (leader + one `--gpu 0` worker, G2 = 24 GB) is started beside the engine and
# outlives each engine process; the engine reaches it through the README's kv-transfer-config.
# OURS_EXTRA: kv_connector_extra_config JSON for "ours" (default {}: load_mode auto, which is
# asynchronous under vLLM's V2 model runner or async scheduling; {"load_mode":"sync"} for the faster
# synchronous loads; {"cost_aware_loads":false}: load every hit, the behaviour before cost-aware loads).
# KVBM_WORKER_ARGS: more kvbm-worker flags (e.g. --cuda-copy runs). KVBM_WORKER_LOG: the worker's
# DYN_LOG alone (debug: one line per job, with a layer-grouped load's group times on the lane and
# on the daemon's event loop, in $KVBM_LOGDIR/worker.log); KVBM_LEADER_LOG the same for the leader.
# KVBM_LOGDIR: daemon logs and each engine's stderr (default /tmp/kvbm-logs).
# KVBM_EAGER=1: kvbm's engines start with CUDA_MODULE_LOADING=EAGER, which GPU layer waits need
# (kvbm_client/signal_page.py); vLLM 0.26 then did not start within 300 s on an H200 (2026-11-26).
set -u
out=$1; systems=$2; shift 2
export PYTHONPATH=/tmp/site:$PWD/.site:$PWD HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT=/tmp/vc PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a hung engine killed with SIGABRT prints every thread's stack
# vLLM 0.26 warms a FlashInfer top-k/top-p sampler that is JIT-compiled (minutes, with ninja) on a
# machine with an empty cache; greedy sampling does not use it. Off for every system alike.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
logdir=${KVBM_LOGDIR:-/tmp/kvbm-logs}; mkdir -p "$logdir"
pids=()
if [[ ",$systems," == *",ours"* ]]; then
  # KVBM_G2_GB / KVBM_G3_GB: the service's G2 size (default 24) and a G3 size (default none; with
  # it every block evicted from G2 goes to G3, in KVBM_G3_DIR): a small G2 makes hits come from G3
  export DYN_KVBM_SOCKET_DIR=/tmp/kvbm-sock-$$ DYN_KVBM_CPU_CACHE_GB=${KVBM_G2_GB:-24}
  if [[ -n "${KVBM_G3_GB:-}" ]]; then
    export DYN_KVBM_DISK_CACHE_GB=$KVBM_G3_GB DYN_KVBM_DISK_CACHE_DIR=${KVBM_G3_DIR:-/tmp} \
      DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=true
  fi
  DYN_LOG=${KVBM_LEADER_LOG:-${DYN_LOG:-info}} python3 -m kvbm_leader >>"$logdir/leader.log" 2>&1 & pids+=($!)
  DYN_LOG=${KVBM_WORKER_LOG:-${DYN_LOG:-info}} python3 -m kvbm_worker --gpu 0 --no-nixl ${KVBM_WORKER_ARGS:-} >>"$logdir/worker.log" 2>&1 & pids+=($!)
  unset DYN_KVBM_CPU_CACHE_GB  # the harness sets it for the engine process
  export OURS_KTC='{"kv_connector":"KvbmConnector","kv_connector_module_path":"kvbm_client.connectors.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":'"${OURS_EXTRA:-{\}}"'}'
fi
python3 benchmarks/vllm_peers.py --systems "$systems" --out "$out" --logdir "$logdir" "$@"
rc=$?
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
wait
exit $rc
