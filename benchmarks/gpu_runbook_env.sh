# Sourced by the GPU runbooks (benchmarks/gpu_runbook_*.sh) on the GPU machine, from the repo root:
# the GPU environment (gpu_env.sh), the results dir $R (default /tmp/res), `step` (a timestamped
# line in $R/progress.log), the harness's two workloads: A20 (20K TTFT) and G8 (greedy
# max_tokens=8 check), and the GPU stress run's (S12: tests.stress.run, 12 users x 3 turns of the
# fp32 tiny model, layerwise loads; each step adds its scheduling, passes, work dir and result).
set -u
. benchmarks/gpu_env.sh
R=${R:-/tmp/res}; mkdir -p "$R"
step() { echo "$(date +%T) $*" >>"$R/progress.log"; }
A20="--users 5 --sys-len 0 --ctx-len 20000 --turn-len 128 --max-len 24576 --g1-gb 4"
G8="--users 3 --rounds 2 --sys-len 0 --ctx-len 4000 --turn-len 128 --max-tokens 8 --g1-gb 1 --max-len 6144"
S12="--users 12 --turns 3 --gpu 0 --block-size 16 --dtype float32 --load-mode layerwise --skip-baseline-check --timeout 240"
