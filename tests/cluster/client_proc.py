"""A client process (an engine stand-in) for the multi-process cluster tests.

    python client_proc.py offload|onboard SEED N_BLOCKS NUM_WORKERS

Finds its node's leader through etcd (ETCD_ENDPOINTS, DYN_KVBM_NODE_NAME; no leader address),
registers a shared-memory engine buffer on every worker, and either offloads N blocks whose
bytes are a pure function of (seed, block, rank), or onboards them into other engine blocks
and counts the bytes that differ. Prints one JSON line.
"""
from __future__ import annotations

import json
import sys
import tempfile

import numpy as np

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer, sequence_hashes

LAYERS, PAGE = 4, 2048


def pattern(seed: int, block: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, block, rank]).integers(0, 256, (LAYERS, PAGE), dtype=np.uint8)


def main() -> int:
    mode, seed, n, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = KvbmConfig.from_env()
    keys = sequence_hashes([seed * 100_003 + i for i in range(n * 16)], 16)
    tmp = tempfile.mkdtemp()
    engines = {str(w): ShmKvBuffer(2 * n, LAYERS, PAGE, directory=tmp) for w in range(workers)}
    out: dict = {"mode": mode}
    with KvbmClient(config, client_name=f"client-{mode}") as client:
        out["leader_address"] = client.aio.leader_address
        for w, buf in engines.items():
            client.register_region(w, buf.spec())
        client.wait_ready(30)
        if mode == "offload":
            for w, buf in engines.items():
                for i in range(n):
                    buf.array[i] = pattern(seed, i, int(w))
            handle = client.offload(keys, list(range(n)))
            client.wait(handle)
            out["stored"] = handle.num_blocks
        else:
            out["matched"] = client.match(keys).num_matched
            handle = client.onboard(keys, list(range(n, 2 * n)))
            client.wait(handle)
            out["loaded"] = handle.num_blocks
            wrong = 0
            for w, buf in engines.items():
                for i in range(handle.num_blocks):
                    wrong += int(np.count_nonzero(buf.array[n + i] != pattern(seed, i, int(w))))
            out["wrong_bytes"] = wrong
        for w in engines:
            client.unregister_region(w)
    for buf in engines.values():
        buf.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
