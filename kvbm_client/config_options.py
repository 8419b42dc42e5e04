"""The table of kvbm's settings (:data:`OPTIONS`): each ``DYN_KVBM_*`` environment variable of NVIDIA
Dynamo KVBM with its field, parser, default and help (same names, meanings and defaults), plus a
few of kvbm's own (``origin`` "kvbm"). :mod:`.config` builds the validated :class:`~.config.KvbmConfig`,
every daemon's ``--help`` and the README's configuration table from it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(text: str | bool) -> bool:
    """``true/1/yes/on`` or ``false/0/no/off/""`` (any case); a bool is taken as is."""
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false or 1/0)")


def _opt_float(text: str) -> float | None:
    return None if text.strip() == "" else float(text)


def _opt_int(text: str) -> int | None:
    return None if text.strip() == "" else int(text)


@dataclass(frozen=True)
class Option:
    field: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    origin: str = "Dynamo"


def default_socket_dir() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"kvbm-{os.getuid()}")


OPTIONS: tuple[Option, ...] = (
    Option("cpu_cache_gb", "DYN_KVBM_CPU_CACHE_GB", _opt_float, None,
           "G2 host cache size in GB (1e9 bytes), summed over the node's workers."),
    Option("disk_cache_gb", "DYN_KVBM_DISK_CACHE_GB", _opt_float, None,
           "G3 disk cache size in GB. Alone (no CPU cache) it selects the disk-only mode G1->G3."),
    Option("cpu_cache_override_num_blocks", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", _opt_int, None,
           "Exact number of G2 blocks; overrides DYN_KVBM_CPU_CACHE_GB."),
    Option("disk_cache_override_num_blocks", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", _opt_int, None,
           "Exact number of G3 blocks; overrides DYN_KVBM_DISK_CACHE_GB."),
    Option("disk_cache_dir", "DYN_KVBM_DISK_CACHE_DIR", str, "/tmp",
           "Directory of the G3 files (kvbm-disk-cache-*; kvbm-g3-* with DYN_KVBM_DISK_PERSIST)."),
    Option("disable_disk_offload_filter", "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", parse_bool, False,
           "Offload every block evicted from G2 to G3, not only blocks with frequency >= 2."),
    Option("leader_worker_init_timeout_secs", "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", float, 1800.0,
           "How long the leader waits for its workers to attach and allocate their pools."),
    Option("disk_zerofill_fallback", "DYN_KVBM_DISK_ZEROFILL_FALLBACK", parse_bool, False,
           "When fallocate() is unsupported, size the disk file by writing zeros."),
    Option("disk_disable_o_direct", "DYN_KVBM_DISK_DISABLE_O_DIRECT", parse_bool, False,
           "Open the disk file without O_DIRECT (for filesystems that reject it with EINVAL)."),
    Option("metrics", "DYN_KVBM_METRICS", parse_bool, False, "Serve Prometheus metrics."),
    Option("metrics_port", "DYN_KVBM_METRICS_PORT", int, 6880, "Port of the /metrics endpoint."),
    Option("metrics_addr", "DYN_KVBM_METRICS_ADDR", str, "127.0.0.1",
           "Address the /metrics endpoint binds to.", "kvbm"),
    Option("socket_dir", "DYN_KVBM_SOCKET_DIR", str, None,
           "Directory (mode 0700) of the leader's and workers' unix sockets "
           "[default: $XDG_RUNTIME_DIR/kvbm-UID or /tmp/kvbm-UID].", "kvbm"),
    Option("leader_address", "DYN_KVBM_LEADER_ADDRESS", str, None,
           "Leader gRPC address: unix:/path or host:port [default: unix socket in the socket dir].",
           "kvbm"),
    Option("disk_filter_decay_secs", "DYN_KVBM_DISK_FILTER_DECAY_SECS", float, 600.0,
           "Period of the frequency decay step (every count drops by 1).", "kvbm"),
    Option("disk_filter_max_entries", "DYN_KVBM_DISK_FILTER_MAX_ENTRIES", int, 1_000_000,
           "Bound of the frequency table (least recently seen entries are dropped).", "kvbm"),
    Option("job_timeout_secs", "DYN_KVBM_JOB_TIMEOUT_SECS", float, 30.0,
           "Deadline of one transfer job; workers refuse to start a job past it.", "kvbm"),
    Option("session_ttl_secs", "DYN_KVBM_SESSION_TTL_SECS", float, 10.0,
           "A client that stops renewing for this long loses its pins and pending jobs.", "kvbm"),
    Option("max_hashes", "DYN_KVBM_MAX_HASHES_PER_REQUEST", int, 65536,
           "Longest hash list one request may carry.", "kvbm"),
    Option("presence_filter_slots", "DYN_KVBM_PRESENCE_FILTER_SLOTS", int, 1 << 24,
           "Slots of the leader's presence filter (a power of two, 65536 to 2^30, one byte each; 0: none), "
           "a file in the socket dir that local clients map read-only to answer a cold request's "
           "lookup without a round trip. 2^24 (16 MiB) keeps false 'maybe' answers near one in a "
           "hundred up to a million stored blocks.", "kvbm"),
    Option("host_free_watermark", "DYN_KVBM_HOST_FREE_WATERMARK", float, 0.05,
           "Fraction of G2 kept free by background demotion/eviction.", "kvbm"),
    Option("store_demotion_mb", "DYN_KVBM_STORE_DEMOTION_MB", float, 64.0,
           "MB of G2->G3 copies one offload may carry (the blocks it evicts from G2); past it the "
           "evicted blocks are dropped, not written to G3 first, so a slow disk never holds the "
           "engine's blocks (the background demotion still feeds G3). -1: no limit.", "kvbm"),
    # ---- cost-aware onboarding (kvbm_leader/onboard_cost.py) ----
    Option("cost_aware_loads", "DYN_KVBM_COST_AWARE_LOADS", parse_bool, True,
           "Connectors load a hit only as far as loading beats recomputing it (the rest is "
           "recomputed, its G3 blocks promoted to G2); false: load every hit.", "kvbm"),
    Option("prefill_tokens_per_s", "DYN_KVBM_PREFILL_TOKENS_PER_S", float, 0.0,
           "The engine's prefill speed a connector assumes until it measured one (0: load every "
           "hit until then).", "kvbm"),
    Option("host_load_gbps", "DYN_KVBM_HOST_LOAD_GBPS", float, 20.0,
           "Prior of the G2 load bandwidth per worker, GB/s (measured loads take over).", "kvbm"),
    Option("disk_load_gbps", "DYN_KVBM_DISK_LOAD_GBPS", float, 2.0,
           "Prior of the G3 load bandwidth per worker, GB/s (measured loads take over).", "kvbm"),
    # ---- cluster plane (kvbm_client/discovery.py, kvbm_client/bus.py) ----
    Option("etcd_endpoints", "ETCD_ENDPOINTS", str, None,
           "etcd endpoints, comma-separated (http://127.0.0.1:2379): register leaders and workers, "
           "discover the node's leader [default: no etcd, single node].", "Dynamo runtime"),
    Option("nats_server", "NATS_SERVER", str, None,
           "NATS server URL (nats://127.0.0.1:4222): leader commands to workers and KV events "
           "[default: no NATS, commands over gRPC, no events].", "Dynamo runtime"),
    Option("node_name", "DYN_KVBM_NODE_NAME", str, None,
           "Name of this node in etcd keys and NATS subjects [default: the host name].", "kvbm"),
    Option("etcd_lease_ttl_secs", "DYN_KVBM_ETCD_LEASE_TTL_SECS", int, 10,
           "TTL of the etcd leases of leaders and workers (kept alive every TTL/3).", "kvbm"),
    Option("event_buffer", "DYN_KVBM_EVENT_BUFFER", int, 10000,
           "KV events buffered for NATS before new ones are dropped (counted).", "kvbm"),
    # ---- security (kvbm_client/security.py; README "Threat model") ----
    Option("node_key_file", "DYN_KVBM_NODE_KEY_FILE", str, None,
           "The node key (0600, created by the leader, read by workers): signs plans and command "
           "acknowledgements and authenticates daemons to each other [default: <socket dir>/node.key].",
           "kvbm"),
    Option("client_token_file", "DYN_KVBM_CLIENT_TOKEN_FILE", str, None,
           "Bearer tokens (one per line) that clients must present on TCP; clients send the first "
           "[default: none; required to listen on TCP unless DYN_KVBM_INSECURE_TCP].", "kvbm"),
    Option("tls_cert", "DYN_KVBM_TLS_CERT", str, None,
           "PEM certificate of this daemon (TCP listeners) or client (mTLS).", "kvbm"),
    Option("tls_key", "DYN_KVBM_TLS_KEY", str, None, "PEM private key for DYN_KVBM_TLS_CERT.", "kvbm"),
    Option("tls_ca", "DYN_KVBM_TLS_CA", str, None,
           "PEM CA bundle: clients verify servers with it; servers with it require client "
           "certificates (mTLS).", "kvbm"),
    Option("insecure_tcp", "DYN_KVBM_INSECURE_TCP", parse_bool, False,
           "Allow TCP without TLS and tokens (testing only; logged as a warning).", "kvbm"),
    Option("nats_creds", "DYN_KVBM_NATS_CREDS", str, None,
           "NATS credentials file (JWT + nkey seed) for the leader and workers.", "kvbm"),
    Option("nats_nkey_seed", "DYN_KVBM_NATS_NKEY_SEED", str, None, "NATS nkey seed file.", "kvbm"),
    Option("nats_tls_ca", "DYN_KVBM_NATS_TLS_CA", str, None,
           "PEM CA bundle to verify a TLS NATS server (tls:// URLs).", "kvbm"),
    # ---- limits ----
    Option("max_sessions", "DYN_KVBM_MAX_SESSIONS", int, 1024,
           "Open client sessions the leader keeps at most (new ones are refused beyond).", "kvbm"),
    Option("max_session_ttl_secs", "DYN_KVBM_MAX_SESSION_TTL_SECS", float, 120.0,
           "Longest session TTL a client may ask for (longer requests are clamped).", "kvbm"),
    Option("max_queued_jobs", "DYN_KVBM_MAX_QUEUED_JOBS", int, 64,
           "Transfer jobs a worker queues per lane before it answers RESOURCE_EXHAUSTED.", "kvbm"),
    Option("max_name_bytes", "DYN_KVBM_MAX_NAME_BYTES", int, 256,
           "Longest client, engine, worker or session name accepted.", "kvbm"),
    Option("max_region_pages", "DYN_KVBM_MAX_REGION_PAGES", int, 8192,
           "Most (layer, K or V) page placements one engine region may describe.", "kvbm"),
    Option("max_region_buffers", "DYN_KVBM_MAX_REGION_BUFFERS", int, 64,
           "Most buffers (memfds or CUDA allocations) one engine region may map.", "kvbm"),
    Option("max_regions", "DYN_KVBM_MAX_REGIONS", int, 8,
           "Engine regions one worker holds at once (engines sharing its cache; more are refused "
           "with RESOURCE_EXHAUSTED).", "kvbm"),
    # ---- integrity and persistence ----
    Option("disk_io_timeout_secs", "DYN_KVBM_DISK_IO_TIMEOUT_SECS", float, 10.0,
           "A G3 read or write slower than this fails its job (a hung disk never freezes a lane).",
           "kvbm"),
    Option("host_checksums", "DYN_KVBM_HOST_CHECKSUMS", parse_bool, False,
           "Also checksum G2 blocks and verify them on every load (G3 blocks always are).", "kvbm"),
    Option("disk_persist", "DYN_KVBM_DISK_PERSIST", parse_bool, False,
           "Keep G3 files and their index across restarts (default off: files removed on a clean "
           "stop, as Dynamo does).", "kvbm"),
    Option("disk_persist_sync", "DYN_KVBM_DISK_PERSIST_SYNC", parse_bool, True,
           "With DYN_KVBM_DISK_PERSIST: flush the G3 file and its index to the device around every "
           "G3 write, so the index holds across a power loss; false: across process and OS crashes "
           "only (after a power loss a torn block fails its checksum and is dropped, never served).",
           "kvbm"),
)

_BY_FIELD = {o.field: o for o in OPTIONS}
