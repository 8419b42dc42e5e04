#!/usr/bin/env bash
# The 2026-11-25 (second session) GPU runs of issue 13's layer-pipelined loads, in order, on one
# machine after benchmarks/vllm_gpu_install.sh, from a private copy of the tree (the device tool
# re-syncs the checkout on every call). Results and logs in $R (default /tmp/res).
#   KVBM_BENCH_COMMIT=<sha> bash benchmarks/gpu_runbook_layerwise.sh [steps...]
# steps (default all, in this order): tests greedy eager stress graphs greedy_graphs
. benchmarks/gpu_runbook_env.sh  # set -u, $R, step, A20, G8
for s in ${@:-tests greedy eager stress graphs greedy_graphs}; do
  step "start $s"
  case $s in
    tests) python3 -m pytest -q -p no:cacheprovider tests/gpu >"$R/gpu_tests.txt" 2>&1 ;;
    greedy) benchmarks/vllm_gpu_ttft.sh "$R/greedy8_layerwise_eager.jsonl" baseline,ours_layerwise $G8 \
              >"$R/greedy_eager.log" 2>&1 ;;
    eager) KVBM_CONNECTOR_TRACE=$R/t20k_eager.jsonl benchmarks/vllm_gpu_ttft.sh "$R/ttft20k_eager.jsonl" \
              lmcache,ours_sync,ours_layerwise,ours $A20 --timeout 300 --passes 2 >"$R/eager.log" 2>&1 ;;
    stress) python3 -m tests.stress.run --users 12 --turns 3 --gpu 0 --async-scheduling off --model-runner v1 \
              --block-size 16 --dtype float32 --load-mode layerwise --passes none,kill-worker \
              --out "$R/stress_layerwise_v1.json" >"$R/stress.log" 2>&1 ;;
    graphs) KVBM_CONNECTOR_TRACE=$R/t20k_graphs.jsonl benchmarks/vllm_gpu_ttft.sh "$R/ttft20k_graphs.jsonl" \
              lmcache,ours_sync,ours_layerwise $A20 --timeout 600 --passes 2 --cuda-graphs >"$R/graphs.log" 2>&1 ;;
    greedy_graphs) benchmarks/vllm_gpu_ttft.sh "$R/greedy8_layerwise_graphs.jsonl" baseline,ours_layerwise $G8 \
              --cuda-graphs --timeout 600 >"$R/greedy_graphs.log" 2>&1 ;;
  esac
  step "end $s rc=$?"
done
step "all done"
