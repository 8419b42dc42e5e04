"""Checks of the configuration and of the sizes it asks for: does it parse, what pools it
gives, and whether G2, G3 and the CPU engine's KV cache fit this machine.

Runs in ``kvbm doctor``. Pool sizes come from :mod:`kvbm_client.sizing`, the rule the
leader plans with, for the layout given by ``--layout`` or reported by the running node.
"""
from __future__ import annotations

import glob
import os
import resource

from ..ids import Tier
from ..sizing import PoolSizes, pool_sizes
from . import machine
from .base import Check, CheckResult, DoctorContext, fail, info, ok, skip, warn

# NOTE: the worker's G3 file prefix (kvbm_worker.pools.DISK_PREFIX); kvbm_client never
# imports the daemons, so it is spelled again here.
DISK_FILE_PREFIX = "kvbm-disk-cache-"
#: vLLM's CPU KV cache per rank when VLLM_CPU_KVCACHE_SPACE is unset (GiB).
VLLM_CPU_KVCACHE_DEFAULT_GIB = 4
#: A tier may take at most this share of what is free before we warn.
HEADROOM = 0.8


def check_parse(ctx: DoctorContext) -> CheckResult:
    """The DYN_KVBM_* environment and flags parse, and at least one tier is configured."""
    if ctx.config is None:
        return fail(f"configuration does not parse: {ctx.config_error}",
                    "fix the variable or flag named here (`kvbm serve --help` lists each with its default)")
    cfg = ctx.config
    if not (cfg.host_enabled or cfg.disk_enabled):
        return fail("no cache tier configured: the leader refuses to start",
                    "set DYN_KVBM_CPU_CACHE_GB (G2 host memory) and/or DYN_KVBM_DISK_CACHE_GB (G3 disk)")
    tiers = [name for name, on in (("G2", cfg.host_enabled), ("G3", cfg.disk_enabled)) if on]
    mode = " (disk-only mode G1->G3)" if cfg.disk_only else ""
    return ok(f"parses; tiers {' + '.join(tiers)}{mode}", tiers=tiers)


def node_shards(ctx: DoctorContext) -> tuple[list[int], str] | None:
    """Each worker's shard of one block (bytes) and where that came from, or None if unknown."""
    lay = ctx.options.layout
    if lay is not None:
        workers = lay.workers or ctx.options.num_workers
        return [lay.num_layers * lay.page_bytes] * workers, \
            f"--layout {workers} worker(s) x {lay.num_layers} layers x {lay.page_bytes} B"
    st = ctx.node().status
    if st is not None and st.workers and all(w.HasField("layout") for w in st.workers):
        shards = [w.layout.num_layers * w.layout.page_bytes for w in st.workers]
        return shards, f"the running node's {len(shards)} worker(s)"
    return None


def _sizes(ctx: DoctorContext) -> PoolSizes | None:
    shards = node_shards(ctx)
    return None if shards is None else pool_sizes(ctx.cfg, shards[0])


def tier_bytes(ctx: DoctorContext, tier: Tier) -> int | None:
    """What a tier will occupy (padding included when the layout is known), None if unknown."""
    cfg = ctx.cfg
    sizes = _sizes(ctx)
    if sizes is not None:
        return sizes.host_bytes if tier is Tier.HOST else sizes.disk_bytes
    gb = cfg.cpu_cache_gb if tier is Tier.HOST else cfg.disk_cache_gb
    override = cfg.cpu_cache_override_num_blocks if tier is Tier.HOST else cfg.disk_cache_override_num_blocks
    return None if override else (int(gb * 1e9) if gb else 0)


def check_pools(ctx: DoctorContext) -> CheckResult:
    """The pool sizes in blocks this configuration gives for the node's layout."""
    shards = node_shards(ctx)
    if shards is None:
        return skip("layout unknown: pass --layout LAYERS:PAGE_BYTES[:WORKERS], or run it while "
                    "the engine is registered")
    sizes = pool_sizes(ctx.cfg, shards[0])
    cfg = ctx.cfg
    text = (f"block {machine.fmt_bytes(sizes.block_bytes)} ({shards[1]}): "
            f"G2 {sizes.host_slots} blocks ({machine.fmt_bytes(sizes.host_bytes)}), "
            f"G3 {sizes.disk_slots} blocks ({machine.fmt_bytes(sizes.disk_bytes)})")
    data = {"block_bytes": sizes.block_bytes, "host_slots": sizes.host_slots, "disk_slots": sizes.disk_slots,
            "host_bytes": sizes.host_bytes, "disk_bytes": sizes.disk_bytes}
    empty = [(t, env) for t, on, slots, env in (
        ("G2", cfg.host_enabled, sizes.host_slots, "DYN_KVBM_CPU_CACHE_GB"),
        ("G3", cfg.disk_enabled, sizes.disk_slots, "DYN_KVBM_DISK_CACHE_GB")) if on and slots == 0]
    if empty:
        tier, env = empty[0]
        return fail(f"{text}: {tier} is smaller than one block",
                    f"raise {env} to at least {sizes.block_bytes / 1e9:.3g} GB (one block)", **data)
    st = ctx.node().status
    if st is not None and ctx.options.layout is None:
        running = {Tier(t.tier).label: t.capacity_blocks for t in st.tiers}
        planned = {"G2": sizes.host_slots, "G3": sizes.disk_slots}
        differ = [f"{t} {running[t]} vs {planned[t]}" for t in running if running[t] != planned.get(t)]
        if differ:
            return warn(f"{text}; the running node has other sizes ({', '.join(differ)})",
                        "restart the node (kvbm serve) to apply this configuration", **data)
    return ok(text, **data)


def check_host_memory(ctx: DoctorContext) -> CheckResult:
    """G2 fits in the memory this machine (and its cgroup) can still give."""
    if not ctx.cfg.host_enabled:
        return skip("no G2 configured")
    mem = machine.memory()
    st = ctx.node().status
    held = sum(int(w.host_bytes) for w in st.workers if w.state == "ready") if st is not None else 0
    if held:
        return ok(f"G2 already allocated by the running node ({machine.fmt_bytes(held)}); "
                  f"{mem.source} {machine.fmt_bytes(mem.available)} left", available=mem.available, host_bytes=held)
    need = tier_bytes(ctx, Tier.HOST)
    if need is None:
        return skip("G2 given in blocks: pass --layout LAYERS:PAGE_BYTES[:WORKERS] to size it in bytes")
    text = f"G2 {machine.fmt_bytes(need)}, {mem.source} {machine.fmt_bytes(mem.available)}"
    data = {"host_bytes": need, "available": mem.available}
    fit_gb = machine.gb_at_most(mem.available * HEADROOM)
    if need > mem.available:
        return fail(f"{text}: G2 does not fit; the workers would be OOM-killed while allocating",
                    f"lower DYN_KVBM_CPU_CACHE_GB to at most {fit_gb} (leaving room for the engine)", **data)
    if need > mem.available * HEADROOM:
        return warn(f"{text}: less than {1 - HEADROOM:.0%} left for the engine and the OS",
                    f"consider DYN_KVBM_CPU_CACHE_GB <= {fit_gb}", **data)
    return ok(text, **data)


def check_memlock(ctx: DoctorContext) -> CheckResult:
    """``ulimit -l`` (RLIMIT_MEMLOCK) against G2 on a GPU node.

    NOTE: measured on an H100 node (driver 580): ``cudaHostRegister`` and ``cudaMallocHost`` pinned
    1 GiB under ``ulimit -l 64`` as an unprivileged user, so CUDA pinning (how the worker pins G2)
    is not bound by this limit; ``mlock`` and RDMA memory registration are. Hence INFO, not WARN.
    """
    if not ctx.options.gpus:
        return skip("CPU workers: G2 is not pinned (pass --gpus to check a GPU node)")
    if not ctx.cfg.host_enabled:
        return skip("no G2 configured")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else machine.fmt_bytes(soft)
    need = tier_bytes(ctx, Tier.HOST)
    if soft == resource.RLIM_INFINITY or (need is not None and need <= soft):
        return ok(f"ulimit -l {limit}", memlock=soft)
    return info(f"ulimit -l {limit} is below G2 ({machine.fmt_bytes(need) if need else 'size unknown'}): "
                "fine for CUDA pinning (cudaHostRegister is not limited by it), not for mlock or RDMA "
                "registration", "only if something registers G2 for RDMA: `ulimit -l unlimited` "
                "(systemd LimitMEMLOCK=infinity, docker --ulimit memlock=-1)", memlock=soft)


def check_shm(ctx: DoctorContext) -> CheckResult:
    """``/dev/shm`` can hold a CPU engine's KV cache (vLLM CPU puts it there, one file per rank)."""
    if ctx.options.gpus:
        return skip("GPU workers: the engine's KV cache is on the GPU, not in /dev/shm")
    shm = ctx.options.shm_dir
    if not os.path.isdir(shm):
        return fail(f"{shm} does not exist", "mount a tmpfs on /dev/shm (the CPU engine's KV cache lives there)")
    raw = ctx.env.get("VLLM_CPU_KVCACHE_SPACE", "")
    gib = int(raw) if raw.strip().isdigit() else VLLM_CPU_KVCACHE_DEFAULT_GIB
    need = gib * ctx.options.num_workers << 30
    free = machine.free_bytes(shm) + _own_files(shm, "kvbm-vllm-kv-")
    text = (f"{shm} {machine.fmt_bytes(free)} free of {machine.fmt_bytes(machine.total_bytes(shm))}; "
            f"CPU engine KV cache {ctx.options.num_workers} x {gib} GiB (VLLM_CPU_KVCACHE_SPACE)")
    if not os.access(shm, os.W_OK):
        return fail(f"{shm} is not writable", f"make {shm} writable (a tmpfs, mode 1777)")
    if free < need:
        return fail(f"{text}: does not fit", f"grow it (docker --shm-size={max(1, need >> 30) + 1}g, "
                    "or `mount -o remount,size=...G /dev/shm`) or lower VLLM_CPU_KVCACHE_SPACE",
                    free=free, need=need)
    return ok(text, free=free, need=need)


def _own_files(directory: str, prefix: str) -> int:
    """Bytes held by kvbm's own files there (a running node's; freed when it restarts)."""
    total = 0
    for path in glob.glob(os.path.join(directory, prefix + "*")):
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def check_disk_space(ctx: DoctorContext) -> CheckResult:
    """G3 fits in the free space of DYN_KVBM_DISK_CACHE_DIR's filesystem."""
    cfg = ctx.cfg
    if not cfg.disk_enabled:
        return skip("no G3 configured")
    need = tier_bytes(ctx, Tier.DISK)
    directory = cfg.disk_cache_dir
    free = machine.free_bytes(directory) + (_own_files(directory, DISK_FILE_PREFIX) if os.path.isdir(directory) else 0)
    if need is None:
        return info(f"{directory}: {machine.fmt_bytes(free)} free; G3 given in blocks",
                    "pass --layout LAYERS:PAGE_BYTES[:WORKERS] to compare it with G3 in bytes", free=free)
    text = f"G3 {machine.fmt_bytes(need)}, {machine.fmt_bytes(free)} free in {directory}"
    data = {"disk_bytes": need, "free": free}
    if need > free:
        return fail(f"{text}: the disk is too small; sizing the G3 file would fail (ENOSPC)",
                    f"lower DYN_KVBM_DISK_CACHE_GB to at most {machine.gb_at_most(free * 0.9)}, free space, or point "
                    "DYN_KVBM_DISK_CACHE_DIR at a larger disk", **data)
    if need > free * 0.9:
        return warn(f"{text}: G3 would fill the filesystem to over 90 %",
                    "leave headroom: other writers on this disk would hit ENOSPC", **data)
    return ok(text, **data)


CHECKS = (
    Check("config", "parse", check_parse, needs_config=False),
    Check("config", "pools", check_pools),
    Check("config", "host_memory", check_host_memory),
    Check("config", "memlock", check_memlock),
    Check("config", "shm", check_shm),
    Check("config", "disk_space", check_disk_space),
)
