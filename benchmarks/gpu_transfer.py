"""GPU data-path benchmark (run on a GPU machine; one run does everything).

  0. copy mechanisms in-process (runs / cudaMemcpyBatchAsync / GPU gather), both layouts, both
     directions, and what each does to a bf16 matmul loop in another process;
  1. offload / onboard through the real daemons (this process is the engine, exporting its KV
     cache through CUDA IPC to ``kvbm-worker --gpu 0``) for 1..1250 blocks of a vLLM-like layout
     (16 tokens, 36 layers, 8 KV heads, head dim 128, bf16: 2.25 MiB per block), as a ratio to a
     one-shot pinned memcpy of the same bytes;
  2. interference: matmul TFLOP/s in a separate process with and without that traffic;
  3. TTFT ceiling: Qwen3-4B-shaped prefill (random weights) vs onboarding the same tokens' KV;
  4. G3: disk -> GPU onboard (disk-only mode) vs a raw O_DIRECT read of the same bytes.

    python benchmarks/gpu_transfer.py --out results.jsonl
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from provenance import header_line  # noqa: E402  (benchmarks/, on the path as the script's folder)
from gpu_transfer_common import BLOCK_BYTES, G1_BLOCKS, SIZES, Matmul, emit, make_kv, matmul_child  # noqa: E402
from gpu_transfer_common import memcpy_reference, write_rows  # noqa: E402
from gpu_transfer_sections import (Node, bench_daemon, bench_disk, bench_mechanisms, bench_prefill,  # noqa: E402
                                   daemon_traffic, register, timed_onboard)

LAYOUTS = ["cross", "layers"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_transfer.jsonl")
    ap.add_argument("--matmul-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: mech,daemon,interf,ttft,disk")
    ap.add_argument("--quick", action="store_true",
                    help="only the daemon section, cross-layer layout (about a minute)")
    args = ap.parse_args()
    if args.quick:
        args.skip = "mech,interf,ttft,disk"
        LAYOUTS[:] = ["cross"]
    if args.matmul_child:
        matmul_child()
        return 0
    skip = set(args.skip.split(","))
    import torch
    header = header_line()
    import cuda.bindings
    emit(what="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), cuda_bindings=cuda.bindings.__version__,
         block_bytes=BLOCK_BYTES, layout="16 tok x 36 layers x 8 heads x 128 dim bf16")
    root = Path(tempfile.mkdtemp(prefix="kvbm-gpu-bench-"))
    matmul = Matmul()
    try:
        emit(what="matmul_alone", tflops=round(matmul.measure(2.0), 1))
        if "mech" not in skip:
            bench_mechanisms(matmul)
        kvs = {layout: make_kv(layout) for layout in LAYOUTS}
        dev_flat = kvs["cross"][0].view(-1).view(torch.uint8)
        host_flat = torch.empty(1250 * BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
        refs = {n: memcpy_reference(n * BLOCK_BYTES, dev_flat, host_flat) for n in SIZES}
        for n, (d, h) in refs.items():
            emit(what="memcpy", blocks=n, d2h_GBps=round(n * BLOCK_BYTES / d / 1e9, 2),
                 h2d_GBps=round(n * BLOCK_BYTES / h / 1e9, 2))
        del host_flat
        onboard = {}
        if not {"daemon", "interf", "ttft"} <= skip:
            (root / "g2").mkdir()
            node = Node(root / "g2", DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS=str(G1_BLOCKS))
            try:
                for layout in LAYOUTS:
                    secs = register(node, kvs[layout], layout)
                    emit(what="register_and_ready", layout=layout, seconds=round(secs, 2),
                         G2_GB=round(G1_BLOCKS * BLOCK_BYTES / 1e9, 2))
                    if "daemon" not in skip:
                        onboard[layout] = bench_daemon(node, kvs[layout], layout, refs)
                    if "interf" not in skip:
                        res = matmul.with_traffic(daemon_traffic(node))
                        emit(what="interference", layout=layout, via="daemons, 256-block offloads + onboards", **res)
                    if layout == "cross" and "ttft" not in skip and "daemon" in skip:
                        onboard["cross"] = {n: timed_onboard(node, kvs[layout], layout, n) for n in (128, 512, 1250)}
                    node.client.unregister_region("0")
            finally:
                node.stop()
        matmul.close()
        if "ttft" not in skip and "cross" in onboard:
            prefill = bench_prefill()
            for ntok, blocks in ((2048, 128), (8192, 512), (20000, 1250)):
                t_on = onboard["cross"][blocks]
                emit(what="ttft", tokens=ntok, blocks=blocks, kv_GB=round(blocks * BLOCK_BYTES / 1e9, 2),
                     prefill_ms=round(prefill[ntok] * 1e3, 1), onboard_ms=round(t_on * 1e3, 1),
                     speedup=round(prefill[ntok] / t_on, 2))
        if "disk" not in skip:
            (root / "g3").mkdir()
            bench_disk(root / "g3", kvs["cross"], "cross")
    finally:
        write_rows(args.out, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
