#!/usr/bin/env bash
# The 2026-11-25 (third session) GPU runs of issue 13, in order, on one machine after
# benchmarks/vllm_gpu_install.sh, from a private copy of the tree (the device tool re-syncs the
# checkout on every call). Results and logs in $R (default /tmp/res); progress in $R/progress.log.
# Ran: copy and h2d on a first machine, which went back mid-eager20 (three runs kept as
# results/vllm026_ttft_20k_h100_2026-11-25c_lost_machine_partial.jsonl); then on a second machine
# `h2d eager20 graphs20 eager8 greedy`, of which the device time covered h2d, eager20 and graphs20.
#   KVBM_BENCH_COMMIT=<sha> bash benchmarks/gpu_runbook_peers.sh [steps...]
# steps (default all, in this order): copy h2d eager20 graphs20 eager8 graphs8 greedy
#   copy      the daemon's G2 -> G1 path outside the daemon, per kind of G2 memory (g2_copy_path.py)
#   h2d       the floor's memcpy on this machine (h2d_ceiling.py)
#   eager20   20K, eager: vLLM native offloading, LMCache, Dynamo KVBM, kvbm layerwise; 2 alternating passes
#   graphs20  20K, CUDA graphs: LMCache, kvbm layerwise; 2 passes
#   eager8    8K (the harness's defaults), eager: native, LMCache, Dynamo, kvbm layerwise; 2 passes
#   graphs8   8K, CUDA graphs: LMCache, kvbm layerwise; 2 passes
#   greedy    max_tokens=8 outputs, kvbm layerwise against vLLM alone (eager)
. benchmarks/gpu_runbook_env.sh  # set -u, $R, step, A20, G8
T=benchmarks/vllm_gpu_ttft.sh
for s in ${@:-copy h2d eager20 graphs20 eager8 graphs8 greedy}; do
  step "start $s"
  case $s in
    copy) python3 benchmarks/g2_copy_path.py --json "$R/g2_copy_path.json" >"$R/copy.log" 2>&1 ;;
    h2d) python3 benchmarks/h2d_ceiling.py --json "$R/h2d_ceiling.json" >"$R/h2d.log" 2>&1 ;;
    eager20) KVBM_CONNECTOR_TRACE=$R/t20k_eager.jsonl $T "$R/ttft20k_eager.jsonl" native,lmcache,dynamo,ours_layerwise \
               $A20 --timeout 300 --passes 2 >"$R/eager20.log" 2>&1 ;;
    graphs20) KVBM_CONNECTOR_TRACE=$R/t20k_graphs.jsonl $T "$R/ttft20k_graphs.jsonl" lmcache,ours_layerwise \
               $A20 --timeout 600 --passes 2 --cuda-graphs >"$R/graphs20.log" 2>&1 ;;
    eager8) KVBM_CONNECTOR_TRACE=$R/t8k_eager.jsonl $T "$R/ttft8k_eager.jsonl" native,lmcache,dynamo,ours_layerwise \
               --timeout 300 --passes 2 >"$R/eager8.log" 2>&1 ;;
    graphs8) KVBM_CONNECTOR_TRACE=$R/t8k_graphs.jsonl $T "$R/ttft8k_graphs.jsonl" lmcache,ours_layerwise \
               --timeout 600 --passes 2 --cuda-graphs >"$R/graphs8.log" 2>&1 ;;
    greedy) $T "$R/greedy8_layerwise.jsonl" baseline,ours_layerwise $G8 >"$R/greedy.log" 2>&1 ;;
  esac
  step "end $s rc=$?"
done
step "all done"
