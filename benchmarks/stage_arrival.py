"""When a staged load reaches the worker, relative to the lookup's answer at the client: a stage
the leader sends on the worker's attach stream before it answers (``PrepareLoadRequest.stage``,
the connector's way since the twenty-fifth session) against one the client sends itself right
after its answer (``Transfer`` with ``stage``, the way before), alternating request by request.

    python3 benchmarks/stage_arrival.py [--blocks 1258] [--reps 60] [--passes 3] [--gap-ms 50] [--json out.json]

Each pass starts a leader and one CPU worker with a staging area (``--stage-mib 4``;
:func:`lookup_latency.engine_node`, ``DYN_LOG=debug``), offloads ``--blocks`` blocks (1258:
a 20K-token prompt in 16-token blocks), then per request: the lookup (``LeaderSession.prepare_load``,
the connector's client, the hit counted), the stage (asked in the lookup, or sent after it), the
call that names the engine blocks 10 ms later (it takes the staged groups and frees the area),
then ``--gap-ms`` idle. The worker's debug line of each stage gives the wall time it arrived
(``arrived at``); this reports arrival minus the client's answer time (ms; negative: before the
answer), per mode: the median over passes of each pass's p50, and the stages the worker did not
make (refused: the binding call came first).

Both clocks are the same host's. Why: a stage starts the hit's copy before the engine allocated its
blocks; the sooner it arrives, the longer its head start (``kvbm_worker/stages.py``).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance

from kvbm_client import sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.leader_session import LeaderSession, StageAsk
from kvbm_client.local_node import isolated_env
from lookup_latency import engine_node

MODES = ("leader", "client")
ARRIVED = re.compile(r"job (\d+) load: staged .*arrived at ([0-9.]+)\)")


def one_pass(blocks: int, reps: int, gap_s: float) -> dict[str, list[float]]:
    """Arrival minus answer (ms) per mode, and ``refused:<mode>`` counts (as one-element lists)."""
    with tempfile.TemporaryDirectory(prefix="kvbm-stage-", dir="/tmp") as tmp:
        root = Path(tmp)
        env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": blocks + 64, "DYN_LOG": "debug",
                                  "DYN_KVBM_HOST_FREE_WATERMARK": "0"})
        keys = sequence_hashes(list(range(blocks * 16)), 16)
        answers: dict[int, tuple[str, float]] = {}
        with engine_node(root, env, blocks, worker_args=("--stage-mib", "4")) as (node, config, client):
            client.wait(client.offload(keys, list(range(blocks))))
            region = client.region_id("0")
            stub = rpc.WorkerStub(open_channel(config.worker_address("0"), config))
            session = LeaderSession(node.leader_address, timeout=10, config=config)
            ask = StageAsk(2, ((WorkerId("0"), region),))
            for i in range(reps + 10):  # the first 10 warm up and are dropped
                mode = MODES[i % 2]
                handle = session.prepare_load(keys, count_hit=True, tokens_per_block=16,
                                              stage=ask if mode == "leader" else None)
                answered = time.time()
                signed = pb.SignedPlan(plan=handle.signed.plan, signature=handle.signed.signature)
                staged = None
                if mode == "client":
                    staged = stub.Transfer.future(pb.TransferRequest(region_id=region, plan=signed, layer_groups=2,
                                                                     stage=True, sent_at=time.time()), timeout=10)
                if i >= 10:
                    answers[handle.job_id] = (mode, answered)
                time.sleep(0.01)
                stub.Transfer(pb.TransferRequest(region_id=region, plan=signed, layer_groups=2,
                                                 engine_blocks=list(range(blocks))), timeout=10)
                if staged is not None:
                    staged.exception()  # (a refused stage is counted from the log below)
                time.sleep(gap_s)
            session.close()
        log = "".join(p.read_text() for p in root.glob("*.log"))
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for job, arrived in ARRIVED.findall(log):
        if int(job) in answers:
            mode, answered = answers.pop(int(job))
            out[mode].append((float(arrived) - answered) * 1e3)
    for mode in MODES:
        out[f"refused:{mode}"] = [float(sum(1 for m, _ in answers.values() if m == mode))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1258, help="blocks of the stored prefix [1258: 20K tokens]")
    ap.add_argument("--reps", type=int, default=60, help="timed requests per pass, the modes alternating [60]")
    ap.add_argument("--passes", type=int, default=3, help="passes, each on a fresh node [3]")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="idle time after each request [50]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    passes = [one_pass(args.blocks, args.reps, args.gap_ms / 1e3) for _ in range(args.passes)]
    rows = []
    for mode in MODES:
        p50s = [statistics.median(p[mode]) for p in passes if p[mode]]
        refused = [int(p[f"refused:{mode}"][0]) for p in passes]
        rows.append({"mode": mode, "arrival_after_answer_ms_p50": round(statistics.median(p50s), 3) if p50s else None,
                     "p50_per_pass": [round(x, 3) for x in p50s], "staged": [len(p[mode]) for p in passes],
                     "not_staged": refused})
        print(f"{mode}: stage arrived {rows[-1]['arrival_after_answer_ms_p50']} ms after the answer (p50; passes "
              f"{rows[-1]['p50_per_pass']}), staged {rows[-1]['staged']}, not staged {refused}")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "blocks": args.blocks, "reps": args.reps,
                                               "gap_ms": args.gap_ms, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
