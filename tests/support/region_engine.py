"""A stand-in engine process for the region tests: registers a KV region on worker 0 and holds
it until its stdin closes (or it is killed).

    python tests/support/region_engine.py engine [--store N] [--seed S]   # a well-behaved engine
    python tests/support/region_engine.py squat --claim-pid PID          # claims another's pid

Reads the node's ``DYN_KVBM_*`` environment. Prints one JSON line once registered:
``{"pid": ..., "region_id": ..., "digest": ...}``. ``engine`` fills its buffer with a seeded
pattern and, with ``--store N``, stores blocks 0..N-1 under the keys of ``seed`` first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer, sequence_hashes
from kvbm_client.region_wire import register
from kvbm_client.security import region_digest

LAYERS, PAGE = 4, 2048


def keys(n: int, seed: int) -> list:
    return sequence_hashes([seed * 7_919 + i for i in range(n * 16)], 16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "squat"])
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--store", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--claim-pid", type=int, default=0)
    args = p.parse_args()
    config = KvbmConfig.from_env()
    engine = ShmKvBuffer(args.blocks, LAYERS, PAGE)
    engine.array[:] = np.random.default_rng(args.seed).integers(0, 256, engine.array.shape, dtype=np.uint8)
    if args.mode == "squat":  # a hostile client: says it is process --claim-pid
        request = engine.spec().to_request()
        request.pid = args.claim_pid
        lease = register(config.region_socket("0"), request, [engine.fd], 10)
        region_id = lease.region_id
    else:
        client = KvbmClient(config, client_name=f"engine-{os.getpid()}")
        region_id = client.register_region("0", engine.spec())
        client.wait_ready(30)
        if args.store:
            client.wait(client.offload(keys(args.store, args.seed), list(range(args.store))))
    print(json.dumps({"pid": os.getpid(), "region_id": region_id, "digest": region_digest(region_id)}), flush=True)
    sys.stdin.read()  # hold the region until the test closes our stdin (or kills us)


if __name__ == "__main__":
    main()
