"""The measurements of benchmarks/gpu_transfer.py, one function family per section.

* Section 0, the copy mechanisms in-process (``bench_mechanisms``): runs / cudaMemcpyBatchAsync /
  GPU gather, both layouts, both directions, against the one-shot pinned memcpy, and what each does
  to the matmul loop in another process.
* Section 1, offload / onboard through the real daemons: ``Node`` runs a leader and one ``--gpu 0``
  worker with this process as the engine (its KV cache exported through CUDA IPC); ``bench_daemon``
  times offload and onboard per batch size against the pinned memcpy, and ``daemon_traffic`` is the
  offload + onboard load of section 2 (interference).
* Section 3, the TTFT ceiling: ``bench_prefill`` times a Qwen3-4B-shaped prefill (random weights)
  for a few prompt lengths; ``timed_onboard`` times onboarding the same tokens' KV through the daemons.
* Section 4, G3 (``bench_disk``): disk -> GPU onboard (disk-only mode) against a raw O_DIRECT read
  of the same bytes of the daemon's disk cache file.
"""
from __future__ import annotations

import glob
import mmap
import os
import statistics
import time
from pathlib import Path

import numpy as np

from gpu_transfer_common import (BLOCK_BYTES, G1_BLOCKS, SIZES, Matmul, block_ref, emit, make_kv, median_time,
                                 memcpy_reference)


def bench_mechanisms(matmul: Matmul) -> None:
    from kvbm_client.cuda_export import page_placements
    from kvbm_worker.cuda_region import CudaEngineRegion
    from kvbm_worker.handlers.cuda import CudaCopier
    from kvbm_worker.handlers.pinned import PinnedHost
    from kvbm_worker.pools import HostPool, SlotGeometry
    n = 1250
    host = HostPool(SlotGeometry.of(BLOCK_BYTES, n))
    pinned = PinnedHost(0)
    pinned.pin(host.address, host.buffer.nbytes, chunk=(1 << 30) // BLOCK_BYTES * BLOCK_BYTES)  # as the worker pins
    rng = np.random.default_rng(0)
    import torch
    dev_flat = torch.empty(n * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    host_flat = torch.empty(n * BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
    ref_d2h, ref_h2d = memcpy_reference(n * BLOCK_BYTES, dev_flat, host_flat)
    del dev_flat, host_flat
    for layout in ("cross", "layers"):
        kv = make_kv(layout)
        layers = []
        for i, t in enumerate(kv):
            nb, page, pages = page_placements(t.shape, t.stride(), t.element_size(), 0, 0 if layout == "cross" else 1, 3)
            layers += [(i, off, st) for off, st in pages]
        region = CudaEngineRegion.from_local(kv, layers, page, nb)
        perm = rng.permutation(G1_BLOCKS)
        src, dst = perm[:n], perm[n:2 * n]
        addrs = host.address + np.arange(n) * host.geometry.slot_bytes
        for mech in ("runs", "batch", "gather"):
            copier = CudaCopier(0, pinned, mech)
            for blocks in (16, n):
                d2h = median_time(lambda: copier.copy("d2h", region, src[:blocks], addrs[:blocks]), 5)
                h2d = median_time(lambda: copier.copy("h2d", region, dst[:blocks], addrs[:blocks]), 5)
                ok = all(torch.equal(block_ref(kv, layout, int(dst[i])), block_ref(kv, layout, int(src[i])))
                         for i in range(0, blocks, max(1, blocks // 16)))
                nbytes = blocks * BLOCK_BYTES
                emit(what="mechanism", layout=layout, mechanism=copier.last_mechanism, blocks=blocks,
                     d2h_GBps=round(nbytes / d2h / 1e9, 2), h2d_GBps=round(nbytes / h2d / 1e9, 2),
                     d2h_vs_memcpy=round(ref_d2h * blocks / n / d2h, 3), h2d_vs_memcpy=round(ref_h2d * blocks / n / h2d, 3),
                     bytes_equal=ok)

            def loop(direction, blocks, stop, copier=copier):
                moved = 0
                while not stop.is_set():
                    copier.copy(direction, region, blocks, addrs)
                    moved += len(blocks) * BLOCK_BYTES
                return moved
            # the two directions on two threads and two streams, as the worker's lanes run them
            both = CudaCopier(0, pinned, mech)
            res = matmul.with_traffic([lambda s: loop("d2h", src, s, both), lambda s: loop("h2d", dst, s, both)])
            emit(what="mechanism_interference", layout=layout, mechanism=mech, **res)
            copier.close()
            both.close()
        region.close()
        del kv, region
        torch.cuda.empty_cache()
    emit(what="memcpy_reference", blocks=n, d2h_GBps=round(n * BLOCK_BYTES / ref_d2h / 1e9, 2),
         h2d_GBps=round(n * BLOCK_BYTES / ref_h2d / 1e9, 2))
    pinned.close()
    host.close()


ROOT = Path(__file__).resolve().parent.parent


class Node:
    """A leader and one ``--gpu 0`` worker (logs in ``root``) and this process's client of them."""

    def __init__(self, root: Path, **env: str) -> None:
        from kvbm_client import KvbmClient
        from kvbm_client.local_node import LocalNode, isolated_env
        self.node = LocalNode(isolated_env(root, {"DYN_LOG": "info", "DYN_KVBM_HOST_FREE_WATERMARK": "0",
                                                  "DYN_KVBM_JOB_TIMEOUT_SECS": "60", **env}),
                              gpus=[0], worker_args=["--no-nixl"], log_dir=root, cwd=ROOT)
        try:
            self.node.start(timeout=120.0)  # the GPU worker imports torch and creates its CUDA context first
            self.client = KvbmClient(self.node.config(), timeout=60)
        except BaseException:
            self.node.stop()
            raise

    def stop(self) -> None:
        self.client.close()
        self.node.stop(30.0)


def fresh(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def register(node: Node, kv, layout: str) -> float:
    from kvbm_client.cuda_export import export_kv_cache
    t = time.perf_counter()
    node.client.register_region("0", export_kv_cache(kv if layout == "layers" else kv[0],
                                                     block_dim=0 if layout == "cross" else 1))
    node.client.wait_ready(600)
    return time.perf_counter() - t


def bench_daemon(node: Node, kv, layout: str, refs: dict) -> dict:
    import torch
    c = node.client
    rng = np.random.default_rng(1)
    onboard_s = {}
    for n in SIZES:
        reps = 20 if n <= 16 else 8 if n <= 256 else 4
        perm = rng.permutation(G1_BLOCKS)
        src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
        keys_list = []

        parts = {"prep_store": [], "prep_load": [], "worker_store": [], "worker_load": []}

        def offload():
            keys = fresh(n)
            t = time.perf_counter()
            h = c.offload(keys, src)
            parts["prep_store"].append(time.perf_counter() - t)
            r = c.wait(h)
            parts["worker_store"].append(r.seconds)
            assert r.num_blocks == n, r
            keys_list.append(keys)
        t_off = median_time(offload, reps)
        keys = keys_list[-1]

        def onboard():
            t = time.perf_counter()
            h = c.onboard(keys, dst)
            parts["prep_load"].append(time.perf_counter() - t)
            parts["worker_load"].append(c.wait(h).seconds)
        t_on = median_time(onboard, reps)
        ok = all(torch.equal(block_ref(kv, layout, d), block_ref(kv, layout, s))
                 for d, s in list(zip(dst, src))[::max(1, n // 16)])
        ref_d2h, ref_h2d = refs[n]
        onboard_s[n] = t_on
        emit(what="daemon", layout=layout, blocks=n, MB=round(n * BLOCK_BYTES / 1e6, 1),
             offload_ms=round(t_off * 1e3, 3), onboard_ms=round(t_on * 1e3, 3),
             offload_GBps=round(n * BLOCK_BYTES / t_off / 1e9, 2), onboard_GBps=round(n * BLOCK_BYTES / t_on / 1e9, 2),
             offload_vs_memcpy=round(ref_d2h / t_off, 3), onboard_vs_memcpy=round(ref_h2d / t_on, 3),
             bytes_equal=ok, **{f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in parts.items()})
    return onboard_s


def daemon_traffic(node: Node, batch: int = 256):
    c = node.client
    perm = np.random.default_rng(2).permutation(G1_BLOCKS)
    src, dst = perm[:batch].tolist(), perm[batch:2 * batch].tolist()
    keys = fresh(batch)
    c.wait(c.offload(keys, src))

    def offloads(stop):
        moved = 0
        while not stop.is_set():
            moved += c.wait(c.offload(fresh(batch), src)).bytes
        return moved

    def onboards(stop):
        moved = 0
        while not stop.is_set():
            moved += c.wait(c.onboard(keys, dst)).bytes
        return moved
    return [offloads, onboards]


def bench_prefill() -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        try:
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        except TypeError:
            m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    out = {}
    for ntok in (2048, 8192, 20000):
        ids = torch.randint(0, 1000, (1, ntok), device="cuda")
        ts = []
        with torch.no_grad():
            for i in range(4):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                m(ids, logits_to_keep=1)
                e.record()
                e.synchronize()
                if i:
                    ts.append(s.elapsed_time(e) / 1e3)
        out[ntok] = statistics.median(ts)
    del m
    torch.cuda.empty_cache()
    return out


def timed_onboard(node: Node, kv, layout: str, n: int, reps: int = 5) -> float:
    c = node.client
    perm = np.random.default_rng(3).permutation(G1_BLOCKS)
    keys = fresh(n)
    c.wait(c.offload(keys, perm[:n].tolist()))
    return median_time(lambda: c.wait(c.onboard(keys, perm[n:2 * n].tolist())), reps)


def raw_odirect_read(path: str, nbytes: int, io: int = 16 << 20) -> float:
    buf = mmap.mmap(-1, io)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, io):
            os.preadv(fd, [memoryview(buf)[:min(io, nbytes - off)]], off)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        buf.close()


def bench_disk(root: Path, kv, layout: str) -> None:
    import torch
    n = 1250
    node = Node(root, DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS=str(n + 50))
    try:
        register(node, kv, layout)
        c = node.client
        perm = np.random.default_rng(4).permutation(G1_BLOCKS)
        src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
        keys = fresh(n)
        t = time.perf_counter()
        assert c.wait(c.offload(keys, src)).num_blocks == n
        t_off = time.perf_counter() - t
        ons = []
        for _ in range(3):
            t = time.perf_counter()
            c.wait(c.onboard(keys, dst))
            ons.append(time.perf_counter() - t)
        ok = all(torch.equal(block_ref(kv, layout, d), block_ref(kv, layout, s)) for d, s in list(zip(dst, src))[::50])
        path = glob.glob(str(root / "disk" / "kvbm-disk-cache-*"))[0]
        raw = statistics.median(raw_odirect_read(path, n * BLOCK_BYTES) for _ in range(3))
        t_on = statistics.median(ons)
        emit(what="disk", layout=layout, blocks=n, GB=round(n * BLOCK_BYTES / 1e9, 2), io="preadv/pwritev (no NIXL)",
             offload_g1_g3_GBps=round(n * BLOCK_BYTES / t_off / 1e9, 2),
             onboard_g3_g1_GBps=round(n * BLOCK_BYTES / t_on / 1e9, 2),
             raw_odirect_read_GBps=round(n * BLOCK_BYTES / raw / 1e9, 2), onboard_vs_raw=round(raw / t_on, 3),
             bytes_equal=ok)
    finally:
        node.stop()
