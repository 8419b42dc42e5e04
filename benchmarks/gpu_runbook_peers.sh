#!/usr/bin/env bash
# Issue 13's GPU runs beside the peers, in order, on one machine after benchmarks/vllm_gpu_install.sh,
# from a private copy of the tree (the device tool re-syncs the checkout on every call). Results and
# logs in $R (default /tmp/res); progress in $R/progress.log. The kvbm worker logs at debug level
# (one line per job, a layer-grouped load's group times on the lane and on the daemon's loop) and
# every harness run records where each prompt's cached tokens came from (--hit-sources).
#   KVBM_BENCH_COMMIT=<sha> bash benchmarks/gpu_runbook_peers.sh [steps...]
# steps (default all, in this order): gap h2d eager20 graphs20 stress greedy eager8 graphs8 copy
#   gap       the daemon's G2 -> G1 lane code outside the daemon, back to back and 0.5 s apart
#             (is the GPU idle between requests what slows a load inside the daemon?)
#   h2d       the floor's memcpy on this machine (h2d_ceiling.py)
#   eager20   20K, eager: LMCache, kvbm layerwise, kvbm with its defaults (auto: async); 2 alternating passes
#   shapes20  20K, eager, 2 passes, each: LMCache and kvbm layerwise (the worker's default, front-loaded
#             layer groups) in one harness run, then kvbm layerwise with --load-group-shape even in
#             another (a worker flag: its own service); results ttft20k_shape_{front,even}_pP.jsonl
#   graphs20  20K, CUDA graphs: LMCache, kvbm layerwise; 2 passes
#   stress    no wrong KV: tests/stress under async scheduling (early loads on, vLLM 0.26 defers
#             block frees), layerwise loads, preemptions, outputs compared with vLLM alone
#   greedy    max_tokens=8 outputs, kvbm layerwise against vLLM alone (eager)
#   eager8    8K (the harness's defaults), eager: native, LMCache, Dynamo, kvbm layerwise; 2 passes
#   graphs8   8K, CUDA graphs: LMCache, kvbm layerwise; 2 passes
#   copy      g2_copy_path.py per kind of G2 memory (2026-11-25 third session)
#   gputests  tests/gpu/test_cuda_copier.py and test_daemon_gpu.py (every copy mechanism's bytes, CUDA IPC
#             loads, the signal page's GPU waits and stream writes), and kvbm doctor's CUDA checks
#             (tests/kvbm_client/test_doctor_cuda.py, since the twenty-seventh session)
#   issue20   20K, eager, 2 passes, each: LMCache and kvbm layerwise (the worker's default copy issue:
#             --cuda-copy auto = direct) in one harness run, then kvbm layerwise with --cuda-copy batch
#             (cuda-python, as before 2026-11-26's seventh session) in another; ttft20k_issue_{direct,batch}_pP
#   issue8    the same on 8K
#   ipcissue  ipc_issue_cost.py: the CPU cost of issuing copies into local vs CUDA-IPC memory
#   fwd8      8K, eager, 2 passes: LMCache, kvbm layerwise, kvbm synchronous (the engine's forward timed
#             in the trace: wall and CPU, overlapped with the copy or after it)
#   probes    wait_kernel_probe.py (LAZY plain / no_mul, EAGER plain: the word written by another thread)
#             and ipc_event_probe.py (a stream waiting on a dead process's CUDA IPC event)
#   staging   staging_scatter.py: a 20K hit's host -> GPU copy into a staging buffer, then device ->
#             device into the other process's KV cache (per-copy, and one index_copy_ kernel per layer
#             group), against today's direct load (idle / busy)
#   peers20t  20K, eager, 2 passes: LMCache with its hooks timed (lmcache_timed, peer_timing.py: where
#             its time goes), kvbm layerwise; then ttft_breakdown.py prints both
#   peers8t   the same on 8K
#   groups20  20K, eager, 2 passes: LMCache, kvbm layerwise in 6 (the default), 4 and 3 layer groups
#   alone     daemon_layer_loads.py, 418-block (8K) loads through the real daemons without an engine,
#             --cuda-copy auto (direct) and batch, 2 passes; then the same with 12 CPU-spinning processes
#   waits20   20K, eager, 2 passes: LMCache, kvbm layerwise (GPU layer waits where CUDA loads kernels
#             eagerly: run with KVBM_EAGER=1), kvbm layerwise with its layer waits on the CPU
#             (gpu_layer_waits false). NOTE: with KVBM_EAGER=1 vLLM 0.26 did not start in 300 s (H200)
#   waits8    the same on 8K: LMCache, Dynamo, kvbm layerwise, kvbm layerwise with CPU waits
#   greedyg   max_tokens=8 outputs, kvbm layerwise against vLLM alone, CUDA graphs (GREEDY_SYSTEMS: the
#             systems, default baseline,ours_layerwise; add ours for kvbm's defaults)
#   lazy20    20K, eager, 2 passes: LMCache with its hooks timed, kvbm layerwise (under CUDA's default
#             lazy module loading its layer waits stay on the CPU), kvbm layerwise with GPU layer waits
#             under lazy loading (ours_layerwise_gpuwait: gpu_layer_waits true)
#   lazy8     the same on 8K
#   lazy20g / lazy8g  lazy20 / lazy8 with CUDA graphs (PIECEWISE for kvbm: its layer hooks run between
#             the pieces; the forward's CPU time is small there, so the copy bounds both systems), and
#             vLLM alone (baseline: the cold-TTFT target's reference)
#   tail20 / tail8 / tail20g / tail8g  lazy20 / lazy8 / lazy20g / lazy8g with kvbm's earlier default
#             (ours_layerwise_eager: CPU layer waits under lazy loading) beside the default since the tenth
#             session (ours_layerwise: gpu_layer_waits tail, only the last layers' waits on the GPU)
#   stresslazy  the stress step with GPU layer waits under lazy loading (gpu_layer_waits true)
#   greedylazy  greedyg with GPU layer waits under lazy loading
#   stresstail / greedytail  stresslazy / greedylazy with gpu_layer_waits tail
#   proof20 / proof8 / proof20g / proof8g  issue 13's proof: native, LMCache, Dynamo, kvbm (its default; until
#             the tenth session also ours_layerwise_tail beside the then default)
#             in one run, 2 passes (graphs: vLLM alone too, the cold target's reference); since the
#             twenty-seventh session the workers have a staging area of PROOF_STAGE_MIB (default 1024; 0:
#             none), so kvbm layerwise stages its loads, and every system is warmed on a warm turn first
#             (PROOF_ARGS, default --warmup-turn); PROOF_SYSTEMS changes the systems
#   cold20 / cold20g  the cold target (no hit within 2 % of vLLM alone): vLLM alone (baseline), kvbm with
#             each step's PrepareStore on the scheduler's thread (ours_layerwise_syncstore, the behaviour until
#             the eleventh session), kvbm's default (big steps' store plans asked for off that thread) and
#             kvbm on vLLM's per-layer KV tensors (ours_layerwise_perlayer: does the cross-layer buffer cost
#             the forward?); 2 passes
#   coldf20   the cold target, eager, 3 passes: vLLM alone, kvbm asking the leader for every lookup
#             (ours_layerwise_nofilter, before the twelfth session), kvbm's default (a cold lookup
#             answered by the leader's presence filter, no round trip)
#   coldnull20  the cold target, eager, 3 passes: vLLM alone, vLLM with a connector that does nothing
#             (null: null_connector.py, what any connector costs inside vLLM), kvbm's default, kvbm on
#             vLLM's per-layer KV tensors (ours_layerwise_perlayer)
#   coldwhy20   the cold target, eager, 3 passes: vLLM alone, the null connector (its step timeline traced),
#             kvbm's default, kvbm offloading nothing (ours_layerwise_nostore: do the stores slow the
#             prefill?), kvbm synchronous (ours_sync: do the layerwise hooks?); ttft_breakdown.py prints the
#             cold timeline of each
#   coldwhy8  coldwhy20's question on 8K, as the twenty-ninth session's staged8 ran (the workers with
#             --stage-mib, a warm-up turn): vLLM alone, the null connector, kvbm staged, kvbm offloading
#             nothing; 3 passes (there kvbm's cold 8K was +2.2 % over vLLM alone, 20K +0.6 %)
#   holds20   20K eager, 3 passes: vLLM alone, kvbm (block holds: a finished request freed at once, the
#             blocks stores read pinned), kvbm with delayed frees (ours_layerwise_delayfree, before
#             2026-11-27): cold and warm; then ttft_breakdown.py
#   coldholds20  the cold target with block holds, 20K eager, 3 passes: vLLM alone and kvbm's default only
#   sync8g    8K, CUDA graphs, 2 passes: LMCache, kvbm layerwise (PIECEWISE graphs: its layer hooks run
#             between the pieces), kvbm synchronous (ours_sync: no layer hooks, vLLM's FULL_AND_PIECEWISE)
#   spy20g    20K graphs, LMCache then kvbm, each engine process sampled by py-spy (spy20g_<pid>.txt:
#             why kvbm's forward costs the engine's thread more CPU than LMCache's under graphs)
#   interference  wait_copy_interference.py: a load's host -> GPU copy alone and beside another process's
#             wait kernel (polling every 2 / 20 / 200 us), matmuls, HBM-bound copies
#   wordprobe word_write_probe.py: a signal-word write queued behind a 1 GiB copy, host -> host vs via the GPU
#   first20   20K, eager, 3 passes: LMCache, kvbm layerwise (gpu_layer_waits tail, the default), kvbm
#             layerwise with the waits after the first layer group on the GPU (ours_layerwise_afterfirst:
#             does an engine thread that trails the copy end the forward later?); first20g with CUDA
#             graphs, first8 on 8K (2026-11-27 fifteenth session); greedyfirst and stressfirst: the
#             greedy (CUDA graphs) and stress checks of greedytail / stresstail with after_first
#   gpu8      8K, eager: LMCache, kvbm (tail, the default), kvbm with every layer wait on the GPU
#             (ours_layerwise_gpuwait): since the words left the copy stream (ninth session) not run on
#             8K, where the engine's thread, not the copy, ends the forward; gpu20 the same on 20K;
#             PASSES passes (default 3) (2026-11-27 sixteenth session); h2dspread: h2d plus 40 copies
#             0.3 s apart (the host's own spread, under a load's p90); launch: launch_under_copy.py (an
#             engine's small GPU operations while another process copies host -> GPU); gc20: 20K eager,
#             LMCache and kvbm, PASSES passes, the engine's long garbage collections traced (the
#             breakdown's gc) and the daemons' logged (what the first warm request of a pass pays);
#             wu20, wu8: LMCache and kvbm, PASSES passes, each engine first takes an untimed warm turn
#             (--warmup-turn: the first timed warm request is no longer the engine's first of its shape)
#   killv1    issue 13's kill during a load on the GPU engine: the stress harness's kill-mid-load pass
#             (kvbm layerwise; the worker holds back each later layer group of a load 1 s and is killed
#             with kill -9 0.1 s into the first one held, then restarted; every output compared with vLLM
#             alone) under vLLM's V1 model runner one step at a time (where vLLM recomputes a failed
#             same-step load correctly); killv2 the same under vLLM 0.26's defaults (V2 runner, async
#             scheduling: vllm#49250 expected to recompute it wrongly)
#   every8g   8K, CUDA graphs, 2 passes: native, LMCache, Dynamo, kvbm in one run (proof8g without vLLM
#             alone: it fits one session's device time); every20g the same on 20K (2026-11-27 seventeenth
#             session)
#   lookup    lookup_latency.py: a 20K-token lookup's round trip, 90 ms apart as an engine's requests are,
#             from this tree and (KVBM_LOOKUP_BASE=DIR, another tree's kvbm_* packages) the one before
#             it, alternating, 4 passes; rpc: rpc_floor.py, a lookup-sized round trip without kvbm (a raw
#             unix socket, grpc sync, grpc.aio on uvloop), back to back and 90 ms apart
#   lk20g     20K, CUDA graphs, 2 passes: LMCache with its hooks timed, kvbm layerwise; then the
#             breakdown of both (2026-11-27 eighteenth session: the leader's batched pins)
#   why20     20K, eager, kvbm layerwise alone, one harness run (its own service) per worker variant, in
#             order: default, --cuda-copy runs, default again; each run's worker log apart (worker_why_V.log)
#             and lane_issue.py over them (why the lane's issue CPU beside vLLM grows with a piece's bytes;
#             2026-11-27 nineteenth session, whose run at 9a3ddff also tried two flags since removed:
#             --copy-overlap-hint off and --copy-src-order any)
#   pieces20  the same with --load-piece-mb 256 (the default), 64 and 32, twice in turn (A B C A B C)
#   alone20   daemon_layer_loads.py, 1258-block loads through the real daemons without an engine (24 GB
#             G2), one pass: the same lane figures without vLLM
#   beside20  alone20 (8 loads, one pass) with nothing else on the GPU, beside an idle vLLM engine, beside a
#             busy one (cold 20K prefills back to back), then alone again (engine_beside.py: is it vLLM's
#             presence or its work that makes the lane's issue cost grow with a piece's bytes?)
#   threads20 the same with --issue-threads 1 and 2, twice in turn (A B A B): a load's copies issued from one
#             thread or two (vLLM 0.26's V2 runner gives Qwen3 a KV allocation per layer: a copy per page;
#             2026-11-27 twentieth session; THREAD_PASSES="3 4" names further passes)
#   vs20      20K, eager, 2 passes: LMCache and kvbm layerwise (the worker's defaults) in one run
#   runner20  20K, eager, 2 passes: LMCache and kvbm layerwise under vLLM 0.26's defaults (V2 model runner,
#             async scheduling: a KV allocation per layer) and under its V1 runner one step at a time
#             (lmcache_v1, ours_layerwise_v1: the cross-layer buffer kvbm asks for, a copy per block)
#             in one run (2026-11-27 twenty-first session); greedyv1g: the greedy check (CUDA graphs)
#             of ours_layerwise_v1 against vLLM alone under the V1 runner (baseline_v1)
#   split20   20K, eager, kvbm layerwise alone: --issue-split-copies 512 (the default) and 256, in turn,
#             SPLIT_PASSES passes (default "1 2"): is a load's first piece (~506 copies) worth splitting?
#   mixed20   20K, eager, G2 48 GB, --cold-before-warm (an untimed new 20K prompt before each warm request:
#             kvbm stores it while the warm one loads): kvbm layerwise with its default (a store waits
#             while a load runs, --store-yield-ms 200) and with --store-yield-ms 0, in turn, MIXED_PASSES
#             passes (default "1 2"); then LMCache and kvbm layerwise in one run, 2 passes
#   storegil  daemon_layer_loads.py --layout per-layer --stores-beside (each 20K load beside a 20K store
#             on the same worker): this tree (a store's copy calls give up the interpreter lock) against
#             a copy of it in /tmp/kvhold with that one call reverted to holding it, alternating, 2 passes;
#             then this tree without stores
#   conc20    20K, eager, overlapping requests (vllm_peers.py --concurrent: every user its own task on
#             AsyncLLM, 6 rounds, G1 8 GiB, 10 new 20K prompts arriving 400 ms apart whose stores run
#             beside the users' loads; G2 48 GB), 2 passes, each: kvbm layerwise with its default (a store
#             waits while a load runs, --store-yield-ms 200) and with --store-yield-ms 0 in turn (each
#             its own service, the order reversed in pass 2), LMCache in the default's harness run;
#             each run's worker log apart (worker_conc_*: "waited ... for loads" lines)
#   fit20g    20K, CUDA graphs, FIT_PASSES passes (default 1): LMCache and kvbm layerwise since it keeps vLLM's
#             FULL_AND_PIECEWISE graphs (no requires_piecewise_for_cudagraph; compat.layerwise_graph_fit)
#   staged20g 20K, CUDA graphs, STAGED_PASSES passes (default 2): LMCache, kvbm layerwise unstaged and kvbm layerwise
#             with staged loads (ours_layerwise_unstaged, ours_layerwise_staged; STAGED_SYSTEMS changes the systems;
#             until the twenty-fifth session the unstaged side was ours_layerwise, which now stages where the
#             workers have an area), the workers with a staging area of STAGE_MIB (default 1024); STAGED_ARGS go to
#             the harness (default --warmup-turn since the twenty-seventh session: each pass's first warm request
#             was its p90 on lease c, and the harness's p90 of 10 warm requests is their largest); staged8g
#             the same on 8K, staged20 / staged8 the same eager (twenty-eighth session: with
#             STAGED_SYSTEMS=native,lmcache,dynamo,ours_layerwise_staged they are the proof's every-peer run,
#             staged and warmed, without vLLM alone)
#   stressstaged  the stress step (no wrong KV, async scheduling, layerwise loads) with a staging area of STAGE_MIB:
#             fails if no load used a stage
#   greedystaged  max_tokens=8 outputs with CUDA graphs, kvbm layerwise with staged loads against vLLM alone
#   upload    does a small upload (or kernel) on another stream wait behind queued copies?
#             (upload_behind_copies.py: why a stage takes the first layer group only)
#   gatestaged    the staged path's GPU tests (tests/gpu/test_daemon_gpu.py -k staged); if one fails, the
#             runbook stops there (no engine run on a broken scatter: twenty-sixth session, every staged
#             load of a run failed and was recomputed)
#   conc20l   conc20's users under a lighter load: 4 new 20K prompts 1.5 s apart, thinking 300 ms; LMCache and
#             kvbm layerwise (its default) in one run, 2 passes (conc20's 10 prompts 400 ms apart kept vLLM's
#             queue full: every TTFT was mostly waiting for the prefills ahead of it); CONC_SYSTEMS changes the systems
#   tput8     8K, eager, overlapping requests, 128 output tokens each (--concurrent --max-tokens 128,
#             G1 16 GiB: decode, no G1 eviction): vLLM alone and kvbm layerwise, each under vLLM's
#             defaults (V2 runner, async scheduling) and under the V1 runner one step at a time; 2 passes
#             (what one step at a time costs in throughput: out_tok_per_s, tpot); TPUT_SYSTEMS and
#             TPUT_PASSES (default 2) change the systems and passes, TPUT_TAG the file's name; tput8g: the same with CUDA graphs
# (The nineteenth session's streams20 / gpuload steps, at 825e0ce, tried --load-streams, since removed.)
# Earlier sessions' runs (other steps, other systems) are recorded in their result files' argv.
. benchmarks/gpu_runbook_env.sh  # set -u, $R, step, A20, G8
T=benchmarks/vllm_gpu_ttft.sh
GPU_TESTS="tests/gpu/test_cuda_copier.py tests/gpu/test_daemon_gpu.py tests/kvbm_client/test_doctor_cuda.py"
export KVBM_WORKER_LOG=${KVBM_WORKER_LOG:-debug}
H=--hit-sources
# One harness run of SYSTEMS for step $s, then its breakdown, both into $R/$s.log. The step's name
# ends in its workload, 20 (A20) or 8 (the harness's default 8K), then "g" for CUDA graphs
# (timeout 600 s, else 300 s); ARGS go to the harness last.
#   peers SYSTEMS [ARGS...]
peers() {
  local Y=$1 W=${s//[!0-9]/} O="--timeout 300" X=""; shift
  [ "$W" = 20 ] && X="$A20"
  [ "${s%g}" != "$s" ] && O="--timeout 600 --cuda-graphs"
  KVBM_CONNECTOR_TRACE=$R/t${W}k_$s.jsonl $T "$R/ttft${W}k_$s.jsonl" $Y $X $H $O "$@" >"$R/$s.log" 2>&1
  local F=""  # the floor, on 20K: h2d_ceiling.py measures a 20K hit's bytes (the step h2d, run before)
  [ "$W" = 20 ] && [ -f "$R/h2d_ceiling.json" ] && F="--h2d $R/h2d_ceiling.json"
  python3 benchmarks/ttft_breakdown.py "$R/ttft${W}k_$s.jsonl" "$R/t${W}k_$s.jsonl" $F >>"$R/$s.log" 2>&1
}
# 20K, eager, kvbm layerwise alone, one harness run (its own service) per worker variant NAME=FLAGS, in
# order; each run's worker log apart ($R/worker_TAG_NAME.log), then lane_issue.py over them.
# VARGS: more harness arguments.
#   variants TAG NAME=FLAGS...
variants() {
  local tag=$1 v n w=/tmp/kvbm-logs/worker.log l; shift
  for v in "$@"; do
    n=${v%%=*}; l=$(cat "$w" 2>/dev/null | wc -l)
    KVBM_WORKER_ARGS="${v#*=}" KVBM_CONNECTOR_TRACE=$R/t20k_${tag}_$n.jsonl $T "$R/ttft20k_${tag}_$n.jsonl" \
      ours_layerwise $A20 $H --timeout 300 ${VARGS:-} >>"$R/$s.log" 2>&1
    tail -n +$((l + 1)) "$w" >"$R/worker_${tag}_$n.log"; step "$s $n done"
  done
  for v in "$@"; do n=${v%%=*}; P=$(echo "${v#*=}" | sed -n 's/.*--load-piece-mb \([0-9.]*\).*/--piece-mb \1/p')
    python3 benchmarks/lane_issue.py "$R/worker_${tag}_$n.log" --min-blocks 1000 $P >>"$R/$s.log" 2>&1
  done
}
for s in ${@:-gap h2d eager20 graphs20 stress greedy eager8 graphs8}; do
  step "start $s"
  case $s in
    gap) for g in 0 0.5; do python3 benchmarks/g2_copy_path.py --kinds shared --gap-s $g \
           --json "$R/g2_copy_gap$g.json" >>"$R/gap.log" 2>&1; done ;;
    gputests) { echo "# commit ${KVBM_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(date -u +%FT%TZ)," \
                     "GPU $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
                echo "# python3 -m pytest -q -rs -p no:cacheprovider $GPU_TESTS"
                python3 -m pytest -q -rs -p no:cacheprovider $GPU_TESTS; } >"$R/gpu_tests.txt" 2>&1 ;;
    upload) timeout 120 python3 benchmarks/upload_behind_copies.py --json "$R/upload_behind_copies.json" \
              >"$R/upload.log" 2>&1 ;;
    gatestaged) if ! python3 -m pytest -q -p no:cacheprovider tests/gpu/test_daemon_gpu.py -k staged \
                     >"$R/gpu_tests_staged.txt" 2>&1; then step "gatestaged failed: the runbook stops"; exit 1; fi ;;
    probes) for v in "LAZY plain" "LAZY no_mul" "EAGER plain"; do set -- $v
              CUDA_MODULE_LOADING=$1 timeout 60 python3 benchmarks/wait_kernel_probe.py $2 >>"$R/probes.log" 2>&1
            done
            timeout 120 python3 benchmarks/ipc_event_probe.py --json "$R/ipc_event_probe.json" >>"$R/probes.log" 2>&1 ;;
    staging) timeout 300 python3 benchmarks/staging_scatter.py --json "$R/staging_scatter.json" \
               >"$R/staging.log" 2>&1 ;;
    peers20t|peers8t) W=${s#peers}; W=${W%t}; X=""; [ "$W" = 20 ] && X="$A20"
              KVBM_CONNECTOR_TRACE=$R/t${W}k_peers_timed.jsonl $T "$R/ttft${W}k_peers_timed.jsonl" \
                lmcache_timed,ours_layerwise $X $H --timeout 300 --passes 2 >"$R/$s.log" 2>&1 ;;
    groups20) KVBM_CONNECTOR_TRACE=$R/t20k_groups.jsonl $T "$R/ttft20k_groups.jsonl" \
                lmcache,ours_layerwise,ours_layerwise_g4,ours_layerwise_g3 $A20 $H --timeout 300 --passes 2 \
                >"$R/groups20.log" 2>&1 ;;
    fwd8) KVBM_CONNECTOR_TRACE=$R/t8k_fwd.jsonl $T "$R/ttft8k_fwd.jsonl" lmcache,ours_layerwise,ours_sync \
            $H --timeout 300 --passes 2 >"$R/fwd8.log" 2>&1 ;;
    alone) for h in 0 12; do python3 benchmarks/daemon_layer_loads.py --blocks 418 --reps 12 --variant direct= \
             --variant "batch=--cuda-copy batch" --passes 2 --hog $h --json "$R/alone_hog$h.json" \
             >>"$R/alone.log" 2>&1; done ;;
    ipcissue) python3 benchmarks/ipc_issue_cost.py --json "$R/ipc_issue_cost.json" >"$R/ipcissue.log" 2>&1 ;;
    issue20|issue8) W=${s#issue}; X=""; [ "$W" = 20 ] && X="$A20"
             for p in 1 2; do
               KVBM_CONNECTOR_TRACE=$R/t${W}k_issue_direct_p$p.jsonl $T "$R/ttft${W}k_issue_direct_p$p.jsonl" \
                 lmcache,ours_layerwise $X $H --timeout 300 >>"$R/$s.log" 2>&1
               KVBM_WORKER_ARGS="--cuda-copy batch" KVBM_CONNECTOR_TRACE=$R/t${W}k_issue_batch_p$p.jsonl \
                 $T "$R/ttft${W}k_issue_batch_p$p.jsonl" ours_layerwise $X $H --timeout 300 >>"$R/$s.log" 2>&1
             done ;;
    waits20) KVBM_CONNECTOR_TRACE=$R/t20k_waits.jsonl $T "$R/ttft20k_waits.jsonl" \
               lmcache,ours_layerwise,ours_layerwise_cpuwait $A20 $H --timeout 300 --passes 2 >"$R/waits20.log" 2>&1 ;;
    waits8) KVBM_CONNECTOR_TRACE=$R/t8k_waits.jsonl $T "$R/ttft8k_waits.jsonl" \
               lmcache,dynamo,ours_layerwise,ours_layerwise_cpuwait $H --timeout 300 --passes 2 >"$R/waits8.log" 2>&1 ;;
    lazy20|lazy8|lazy20g|lazy8g|tail20|tail8|tail20g|tail8g|proof20|proof8|proof20g|proof8g)
              P=${s%%[0-9]*}; W=${s#$P}; X=""; F=$P; S=""; O="--timeout 300"; E=""; V=${KVBM_WORKER_ARGS:-}
              case $P in
                lazy) Y=lmcache_timed,ours_layerwise,ours_layerwise_gpuwait ;;
                tail) Y=lmcache_timed,ours_layerwise_eager,ours_layerwise ;;  # (tail is the default)
                proof) Y=${PROOF_SYSTEMS:-native,lmcache,dynamo,ours_layerwise}; E=${PROOF_ARGS---warmup-turn}
                       [ "${PROOF_STAGE_MIB:-1024}" = 0 ] || V="--stage-mib ${PROOF_STAGE_MIB:-1024}" ;;
              esac
              if [ "${W%g}" != "$W" ]; then  # graphs; vLLM alone beside them, but not in the tail A/B
                W=${W%g}; F=${P}g; O="--timeout 600 --cuda-graphs"; [ $P = tail ] || S=baseline,
              fi
              [ "$W" = 20 ] && X="$A20"
              KVBM_WORKER_ARGS="$V" KVBM_CONNECTOR_TRACE=$R/t${W}k_$F.jsonl $T "$R/ttft${W}k_$F.jsonl" \
                $S$Y $X $H $O $E --passes 2 >"$R/$s.log" 2>&1 ;;
    cold20|cold20g) O="--timeout 300"; [ $s = cold20g ] && O="--timeout 600 --cuda-graphs"
              KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,ours_layerwise_syncstore,ours_layerwise,ours_layerwise_perlayer $A20 $H $O --passes 2 \
                >"$R/$s.log" 2>&1 ;;
    coldf20) KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,ours_layerwise_nofilter,ours_layerwise $A20 $H --timeout 300 --passes 3 >"$R/$s.log" 2>&1 ;;
    coldnull20) KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,null,ours_layerwise,ours_layerwise_perlayer $A20 $H --timeout 300 --passes 3 >"$R/$s.log" 2>&1 ;;
    coldwhy20) KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,null,ours_layerwise,ours_layerwise_nostore,ours_sync $A20 $H --timeout 300 --passes 3 >"$R/$s.log" 2>&1
               python3 benchmarks/ttft_breakdown.py "$R/ttft20k_$s.jsonl" "$R/t20k_$s.jsonl" >>"$R/$s.log" 2>&1 ;;
    coldwhy8) KVBM_WORKER_ARGS="--stage-mib ${STAGE_MIB:-1024}" peers baseline,null,ours_layerwise_staged,ours_layerwise_nostore \
                --passes 3 --warmup-turn ;;
    holds20) KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,ours_layerwise,ours_layerwise_delayfree $A20 $H --timeout 300 --passes 3 >"$R/$s.log" 2>&1
               python3 benchmarks/ttft_breakdown.py "$R/ttft20k_$s.jsonl" "$R/t20k_$s.jsonl" >>"$R/$s.log" 2>&1 ;;
    coldholds20) KVBM_CONNECTOR_TRACE=$R/t20k_$s.jsonl $T "$R/ttft20k_$s.jsonl" \
                baseline,ours_layerwise $A20 $H --timeout 300 --passes 3 >"$R/$s.log" 2>&1 ;;
    first20|first20g|first8) peers lmcache,ours_layerwise,ours_layerwise_afterfirst --passes 3 ;;
    gpu8|gpu20|gpu8g|gpu20g) peers lmcache,ours_layerwise,ours_layerwise_gpuwait --passes ${PASSES:-3} ;;
    launch) for n in 300 2000; do timeout 300 python3 benchmarks/launch_under_copy.py --launches $n \
              --json "$R/launch_under_copy_$n.json" >>"$R/launch.log" 2>&1; done ;;
    gc20) KVBM_LEADER_LOG=debug peers lmcache,ours_layerwise --passes ${PASSES:-3} ;;
    wu20|wu8) peers lmcache,ours_layerwise --warmup-turn --passes ${PASSES:-3} ;;
    killv1|killv2) M="--model-runner v1 --async-scheduling off"; [ $s = killv2 ] && M="--async-scheduling on"
              python3 -m tests.stress.run $S12 $M --passes kill-mid-load --work /tmp/sw \
              --tag ${s#kill} --out "$R/stress_killmidload_${s#kill}.json" >"$R/$s.log" 2>&1 ;;
    every8g|every20g) peers native,lmcache,dynamo,ours_layerwise --passes 2 ;;
    lookup) timeout 500 python3 benchmarks/lookup_latency.py --gap-ms 90 --reps 100 --passes 4 \
              ${KVBM_LOOKUP_BASE:+--src "$KVBM_LOOKUP_BASE"} --src . --json "$R/lookup_latency.json" >"$R/lookup.log" 2>&1 ;;
    rpc) timeout 300 python3 benchmarks/rpc_floor.py --json "$R/rpc_floor.json" >"$R/rpc.log" 2>&1 ;;
    lk20g) peers lmcache_timed,ours_layerwise --passes 2 ;;
    why20) variants why "default=" "runs=--cuda-copy runs" "default2=" ;;
    pieces20) for p in 1 2; do
                variants pieces_p$p "mb256=--load-piece-mb 256" "mb64=--load-piece-mb 64" "mb32=--load-piece-mb 32"
              done ;;
    vs20) peers lmcache,ours_layerwise --passes 2 ;;
    runner20) peers lmcache,lmcache_v1,ours_layerwise,ours_layerwise_v1 --passes 2 ;;
    greedyv1g) $T "$R/greedy8_v1_graphs.jsonl" baseline_v1,ours_layerwise_v1 $G8 --cuda-graphs --timeout 600 \
                 >"$R/$s.log" 2>&1
               python3 benchmarks/greedy_check.py "$R/greedy8_v1_graphs.jsonl" --reference baseline_v1 >>"$R/$s.log" 2>&1 ;;
    split20) for p in ${SPLIT_PASSES:-1 2}; do
               variants split_p$p "s512=--issue-split-copies 512" "s256=--issue-split-copies 256"; done ;;
    mixed20) for p in ${MIXED_PASSES:-1 2}; do KVBM_G2_GB=48 VARGS="--cold-before-warm --g2-gb 48" \
               variants mixed_p$p "y200=" "y0=--store-yield-ms 0"; done
             KVBM_G2_GB=48 peers lmcache,ours_layerwise --passes 2 --cold-before-warm --g2-gb 48 ;;
    conc20) C="--concurrent --rounds 6 --g1-gb 8 --g2-gb 48 --strangers 10 --stranger-gap-ms 400 --think-ms 200 \
              --stagger-ms 100 --timeout 300"; w=/tmp/kvbm-logs/worker.log
            for p in 1 2; do O="y200 y0"; [ $p = 2 ] && O="y0 y200"
              for n in $O; do
                Y=ours_layerwise; F=""; [ $n = y0 ] && F="--store-yield-ms 0"
                [ $n = y200 ] && { Y=lmcache,ours_layerwise; [ $p = 2 ] && Y=ours_layerwise,lmcache; }
                l=$(cat "$w" 2>/dev/null | wc -l)
                KVBM_G2_GB=48 KVBM_WORKER_ARGS="$F" KVBM_CONNECTOR_TRACE=$R/t20k_conc_${n}_p$p.jsonl \
                  $T "$R/ttft20k_conc_${n}_p$p.jsonl" $Y $A20 $C >>"$R/$s.log" 2>&1
                tail -n +$((l + 1)) "$w" >"$R/worker_conc_${n}_p$p.log"
                step "$s $n p$p done; store waits: $(grep -c 'for loads' "$R/worker_conc_${n}_p$p.log")"
              done
            done ;;
    fit20g) peers lmcache,ours_layerwise --passes ${FIT_PASSES:-1} ;;
    staged20g|staged8g|staged20|staged8) KVBM_WORKER_ARGS="--stage-mib ${STAGE_MIB:-1024}" peers ${STAGED_SYSTEMS:-lmcache,ours_layerwise_unstaged,ours_layerwise_staged} \
                 --passes ${STAGED_PASSES:-2} ${STAGED_ARGS---warmup-turn} ;;
    stressstaged) python3 -m tests.stress.run $S12 --async-scheduling on --stage-mib ${STAGE_MIB:-1024} --passes none \
              --work /tmp/sws --out "$R/stress_staged.json" >"$R/stressstaged.log" 2>&1 ;;
    greedystaged) KVBM_WORKER_ARGS="--stage-mib ${STAGE_MIB:-1024}" $T "$R/greedy8_staged_graphs.jsonl" \
                    baseline,ours_layerwise_staged $G8 --cuda-graphs --timeout 600 >"$R/greedystaged.log" 2>&1 ;;
    conc20l) KVBM_G2_GB=48 KVBM_CONNECTOR_TRACE=$R/t20k_conc_light.jsonl $T "$R/ttft20k_conc_light.jsonl" \
               ${CONC_SYSTEMS:-lmcache,ours_layerwise} $A20 --concurrent --rounds 6 --g1-gb 8 --g2-gb 48 --strangers 4 \
               --stranger-gap-ms 1500 --think-ms 300 --stagger-ms 100 --timeout 300 --passes 2 >"$R/$s.log" 2>&1 ;;
    tput8|tput8g) O="--timeout 300"; F=tput8k_${TPUT_TAG:-runner}
             [ $s = tput8g ] && { O="--timeout 600 --cuda-graphs"; F=${F}_graphs; }
             KVBM_CONNECTOR_TRACE=$R/t8k_$s.jsonl $T "$R/$F.jsonl" \
               ${TPUT_SYSTEMS:-baseline,baseline_v1,ours_layerwise,ours_layerwise_v1} --concurrent --rounds 2 \
               --max-tokens 128 --think-ms 0 --stagger-ms 0 --g1-gb 16 $O --passes ${TPUT_PASSES:-2} >"$R/$s.log" 2>&1 ;;
    storegil) C=kvbm_worker/handlers/cuda_copier.py; rm -rf /tmp/kvhold; cp -a . /tmp/kvhold
              sed -i 's/release=stream is self.streams\[Direction.D2H\])/release=False)/' /tmp/kvhold/$C
              if cmp -s $C /tmp/kvhold/$C; then echo "storegil: the revert did not apply" >"$R/$s.log"; false
              else for p in 1 2; do for v in hold release; do D=.; [ $v = hold ] && D=/tmp/kvhold
                (cd $D && PYTHONPATH=$PWD:/tmp/site:$PWD/.site python3 benchmarks/daemon_layer_loads.py --layout per-layer --blocks 1258 --reps 6 \
                  --passes 1 --g2-gb 24 --stores-beside --json "$R/storegil_${v}_p$p.json") >>"$R/$s.log" 2>&1
                step "storegil $v p$p done"; done; done
              python3 benchmarks/daemon_layer_loads.py --layout per-layer --blocks 1258 --reps 6 --passes 1 \
                --g2-gb 24 --json "$R/storegil_none.json" >>"$R/$s.log" 2>&1; fi ;;
    threads20) for p in ${THREAD_PASSES:-1 2}; do variants threads_p$p "t1=--issue-threads 1" "t2=--issue-threads 2"; done ;;
    beside20) for m in none idle busy none2; do
                e=""; rm -f "$R/beside.ready" "$R/beside.stop"
                if [ "${m%2}" != none ]; then
                  setsid python3 benchmarks/engine_beside.py --ready "$R/beside.ready" --stop "$R/beside.stop" \
                    $([ $m = busy ] && echo --busy) >>"$R/beside20_engine.log" 2>&1 & e=$!  # (gpu_env.sh's env)
                  for i in $(seq 1 150); do [ -e "$R/beside.ready" ] && break; sleep 2; done
                fi
                python3 benchmarks/daemon_layer_loads.py --blocks 1258 --reps 8 --passes 1 --g2-gb 24 \
                  --json "$R/beside20_$m.json" >>"$R/beside20.log" 2>&1
                if [ -n "$e" ]; then  # (an engine that does not stop within 60 s is killed, with its children)
                  touch "$R/beside.stop"
                  for i in $(seq 1 60); do kill -0 $e 2>/dev/null || break; sleep 1; done
                  kill -- -$e 2>/dev/null; wait $e
                fi
                step "beside20 $m done"
              done ;;
    alone20) python3 benchmarks/daemon_layer_loads.py --blocks 1258 --reps 10 --passes 1 --g2-gb 24 \
               --json "$R/alone20.json" >"$R/alone20.log" 2>&1 ;;
    h2dspread) python3 benchmarks/h2d_ceiling.py --spread 40 --json "$R/h2d_ceiling.json" >"$R/h2d.log" 2>&1 ;;
    sync8g) KVBM_CONNECTOR_TRACE=$R/t8k_$s.jsonl $T "$R/ttft8k_$s.jsonl" \
                lmcache,ours_layerwise,ours_sync $H --timeout 600 --cuda-graphs --passes 2 >"$R/$s.log" 2>&1 ;;
    stresslazy|stresstail|stressfirst) V=true; N=stress_lazy_gpuwait; [ $s = stresstail ] && V='"tail"' && N=stress_tail
              [ $s = stressfirst ] && V='"after_first"' && N=stress_afterfirst
              python3 -m tests.stress.run $S12 --async-scheduling on --kvbm-extra "{\"gpu_layer_waits\": $V}" \
              --passes none --work /tmp/sw --out "$R/$N.json" >"$R/$s.log" 2>&1 ;;
    greedylazy|greedytail|greedyfirst) V=gpuwait; [ $s = greedytail ] && V=tail; [ $s = greedyfirst ] && V=afterfirst
               $T "$R/greedy8_${V}_graphs.jsonl" baseline,ours_layerwise_$V $G8 --cuda-graphs --timeout 600 \
               >"$R/$s.log" 2>&1 ;;
    spy20g) rm -f "$R/spy.stop"  # py-spy (collapsed stacks, every thread) of each engine process, in order
            ( seen=""; until [ -f "$R/spy.stop" ]; do
                for p in $(pgrep -f 'EngineCore|spawn_main'); do case " $seen " in *" $p "*) ;; *) seen="$seen $p"
                  echo "$(date +%T) pid $p: $(tr '\0' ' ' </proc/$p/cmdline | cut -c1-80)" >>"$R/spy.log"
                  /tmp/site/bin/py-spy record --pid $p --rate 200 --format raw --threads --nonblocking \
                    -o "$R/spy20g_$p.txt" >>"$R/spy.log" 2>&1 & ;; esac; done; sleep 2; done; wait ) &
            KVBM_CONNECTOR_TRACE=$R/t20k_spyg.jsonl $T "$R/ttft20k_spyg.jsonl" lmcache,ours_layerwise $A20 $H \
              --timeout 600 --cuda-graphs >"$R/spy20g.log" 2>&1
            touch "$R/spy.stop"; wait ;;
    interference) timeout 300 python3 benchmarks/wait_copy_interference.py --json "$R/wait_copy_interference.json" \
                    >"$R/interference.log" 2>&1 ;;
    wordprobe) timeout 120 python3 benchmarks/word_write_probe.py --json "$R/word_write_probe.json" >"$R/wordprobe.log" 2>&1 ;;
    greedyg) $T "$R/greedy8_layerwise_graphs.jsonl" ${GREEDY_SYSTEMS:-baseline,ours_layerwise} $G8 --cuda-graphs --timeout 600 \
               >"$R/greedyg.log" 2>&1 ;;
    copy) python3 benchmarks/g2_copy_path.py --json "$R/g2_copy_path.json" >"$R/copy.log" 2>&1 ;;
    h2d) python3 benchmarks/h2d_ceiling.py --json "$R/h2d_ceiling.json" >"$R/h2d.log" 2>&1 ;;
    eager20) KVBM_CONNECTOR_TRACE=$R/t20k_eager.jsonl $T "$R/ttft20k_eager.jsonl" \
               lmcache,ours_layerwise,ours $A20 $H --timeout 300 --passes 2 >"$R/eager20.log" 2>&1 ;;
    shapes20) for p in 1 2; do
               KVBM_CONNECTOR_TRACE=$R/t20k_shape_front_p$p.jsonl $T "$R/ttft20k_shape_front_p$p.jsonl" \
                 lmcache,ours_layerwise $A20 $H --timeout 300 >>"$R/shapes20.log" 2>&1
               KVBM_WORKER_ARGS="--load-group-shape even" KVBM_CONNECTOR_TRACE=$R/t20k_shape_even_p$p.jsonl \
                 $T "$R/ttft20k_shape_even_p$p.jsonl" ours_layerwise $A20 $H --timeout 300 >>"$R/shapes20.log" 2>&1
             done ;;
    graphs20) KVBM_CONNECTOR_TRACE=$R/t20k_graphs.jsonl $T "$R/ttft20k_graphs.jsonl" lmcache,ours_layerwise \
               $A20 $H --timeout 600 --passes 2 --cuda-graphs >"$R/graphs20.log" 2>&1 ;;
    stress) python3 -m tests.stress.run $S12 --async-scheduling on --passes none \
              --work /tmp/sw --out "$R/stress_async_early.json" >"$R/stress.log" 2>&1 ;;
    greedy) $T "$R/greedy8_layerwise.jsonl" baseline,ours_layerwise $G8 >"$R/greedy.log" 2>&1 ;;
    eager8) KVBM_CONNECTOR_TRACE=$R/t8k_eager.jsonl $T "$R/ttft8k_eager.jsonl" native,lmcache,dynamo,ours_layerwise \
               $H --timeout 300 --passes 2 >"$R/eager8.log" 2>&1 ;;
    graphs8) KVBM_CONNECTOR_TRACE=$R/t8k_graphs.jsonl $T "$R/ttft8k_graphs.jsonl" lmcache,ours_layerwise \
               $H --timeout 600 --passes 2 --cuda-graphs >"$R/graphs8.log" 2>&1 ;;
  esac
  step "end $s rc=$?"
done
step "all done"
