"""Configuration: the ``DYN_KVBM_*`` environment variables of NVIDIA Dynamo KVBM, same names,
meanings and defaults, plus a few of kvbm's own (marked "kvbm" below).

One table (:data:`OPTIONS`) drives the environment parser, every daemon's ``--help`` and
the README's configuration table, so the three never disagree.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import KvbmConfigError
from .ids import MAX_HASH_BYTES
from .presence import check_slots

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


@dataclass(frozen=True)
class KvbmConfig:
    """Validated node configuration; build it with :meth:`from_env`."""

    cpu_cache_gb: float | None = None
    disk_cache_gb: float | None = None
    cpu_cache_override_num_blocks: int | None = None
    disk_cache_override_num_blocks: int | None = None
    disk_cache_dir: str = "/tmp"
    disable_disk_offload_filter: bool = False
    leader_worker_init_timeout_secs: float = 1800.0
    disk_zerofill_fallback: bool = False
    disk_disable_o_direct: bool = False
    metrics: bool = False
    metrics_port: int = 6880
    metrics_addr: str = "127.0.0.1"
    socket_dir: str | None = None
    leader_address: str | None = None
    disk_filter_decay_secs: float = 600.0
    disk_filter_max_entries: int = 1_000_000
    job_timeout_secs: float = 30.0
    session_ttl_secs: float = 10.0
    max_hashes: int = 65536
    presence_filter_slots: int = 1 << 24
    host_free_watermark: float = 0.05
    store_demotion_mb: float = 64.0
    cost_aware_loads: bool = True
    prefill_tokens_per_s: float = 0.0
    host_load_gbps: float = 20.0
    disk_load_gbps: float = 2.0
    etcd_endpoints: str | None = None
    nats_server: str | None = None
    node_name: str | None = None
    etcd_lease_ttl_secs: int = 10
    event_buffer: int = 10000
    node_key_file: str | None = None
    client_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    insecure_tcp: bool = False
    nats_creds: str | None = None
    nats_nkey_seed: str | None = None
    nats_tls_ca: str | None = None
    max_sessions: int = 1024
    max_session_ttl_secs: float = 120.0
    max_queued_jobs: int = 64
    max_name_bytes: int = 256
    max_region_pages: int = 8192
    max_region_buffers: int = 64
    max_regions: int = 8
    disk_io_timeout_secs: float = 10.0
    host_checksums: bool = False
    disk_persist: bool = False
    disk_persist_sync: bool = True

    # ---- derived -------------------------------------------------------------------
    @property
    def host_enabled(self) -> bool:
        return bool(self.cpu_cache_override_num_blocks) or bool(self.cpu_cache_gb)

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_cache_override_num_blocks) or bool(self.disk_cache_gb)

    @property
    def disk_only(self) -> bool:
        return self.disk_enabled and not self.host_enabled

    @property
    def resolved_socket_dir(self) -> str:
        return self.socket_dir or default_socket_dir()

    @property
    def resolved_leader_address(self) -> str:
        return self.leader_address or "unix:" + os.path.join(self.resolved_socket_dir, "leader.sock")

    @property
    def resolved_node_name(self) -> str:
        return self.node_name or socket.gethostname()

    def worker_address(self, worker_id: str) -> str:
        return "unix:" + os.path.join(self.resolved_socket_dir, f"worker-{worker_id}.sock")

    def region_socket(self, worker_id: str) -> str:
        """Path of the unix socket where engines hand their KV memory to worker ``worker_id``."""
        return os.path.join(self.resolved_socket_dir, f"worker-{worker_id}.regions.sock")

    @property
    def resolved_node_key_file(self) -> str:
        return self.node_key_file or os.path.join(self.resolved_socket_dir, "node.key")

    @property
    def max_message_bytes(self) -> int:
        """Largest gRPC message any side accepts: a request of ``max_hashes`` hashes and as many
        parent hashes (plus their framing), and 1 MiB for everything else."""
        return self.max_hashes * 2 * (MAX_HASH_BYTES + 3) + (1 << 20)

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "KvbmConfig":
        """Read every option from ``env`` (default: ``os.environ``); ``overrides`` win."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for opt in OPTIONS:
            raw = env.get(opt.env)
            if raw is None:
                continue
            try:
                values[opt.field] = opt.parse(raw)
            except ValueError as exc:
                raise KvbmConfigError(f"{opt.env}={raw!r}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("cpu_cache_gb", "disk_cache_gb", "cpu_cache_override_num_blocks",
                     "disk_cache_override_num_blocks"):
            value = getattr(self, name)
            if value is not None and (value < 0 or not math.isfinite(value)):
                raise KvbmConfigError(f"{_BY_FIELD[name].env} must be a finite number >= 0, got {value}")
        if self.leader_worker_init_timeout_secs <= 0:
            raise KvbmConfigError("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS must be > 0")
        if not 0 < self.metrics_port < 65536:
            raise KvbmConfigError(f"DYN_KVBM_METRICS_PORT out of range: {self.metrics_port}")
        for name in ("max_hashes", "job_timeout_secs", "session_ttl_secs", "disk_filter_max_entries",
                     "disk_filter_decay_secs", "max_sessions", "max_session_ttl_secs", "max_queued_jobs",
                     "max_name_bytes", "max_region_pages", "max_region_buffers", "max_regions",
                     "disk_io_timeout_secs"):
            if not getattr(self, name) > 0:
                raise KvbmConfigError(f"{_BY_FIELD[name].env} must be positive, got {getattr(self, name)}")
        if self.presence_filter_slots:
            try:
                check_slots(self.presence_filter_slots)
            except ValueError as exc:
                raise KvbmConfigError(f"DYN_KVBM_PRESENCE_FILTER_SLOTS: {exc}") from None
        for name in ("host_load_gbps", "disk_load_gbps"):
            if not 0 < getattr(self, name) < math.inf:
                raise KvbmConfigError(f"{_BY_FIELD[name].env} must be a finite number > 0")
        if not 0 <= self.prefill_tokens_per_s < math.inf:
            raise KvbmConfigError("DYN_KVBM_PREFILL_TOKENS_PER_S must be a finite number >= 0")
        if not (self.store_demotion_mb == -1 or 0 <= self.store_demotion_mb < math.inf):
            raise KvbmConfigError("DYN_KVBM_STORE_DEMOTION_MB must be a finite number >= 0, or -1 (no limit)")
        if not 0 <= self.host_free_watermark < 1:
            raise KvbmConfigError("DYN_KVBM_HOST_FREE_WATERMARK must be in [0, 1)")
        if self.session_ttl_secs > self.max_session_ttl_secs:
            raise KvbmConfigError(f"DYN_KVBM_SESSION_TTL_SECS ({self.session_ttl_secs:g}) exceeds "
                                  f"DYN_KVBM_MAX_SESSION_TTL_SECS ({self.max_session_ttl_secs:g})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise KvbmConfigError("DYN_KVBM_TLS_CERT and DYN_KVBM_TLS_KEY go together")
        if self.etcd_lease_ttl_secs < 2 or self.event_buffer < 1:
            raise KvbmConfigError("DYN_KVBM_ETCD_LEASE_TTL_SECS must be >= 2 and DYN_KVBM_EVENT_BUFFER >= 1")

    def require_tier(self) -> None:
        """Raise a clear startup error when no cache tier is configured."""
        if not (self.host_enabled or self.disk_enabled):
            raise KvbmConfigError(
                "no cache tier configured: set DYN_KVBM_CPU_CACHE_GB (G2 host memory) and/or "
                "DYN_KVBM_DISK_CACHE_GB (G3 disk), or the *_OVERRIDE_NUM_BLOCKS variables")


def add_config_arguments(parser: argparse.ArgumentParser, fields: tuple[str, ...] | None = None) -> None:
    """Add one ``--flag`` per option (or per listed field); each help names its env variable."""
    group = parser.add_argument_group("configuration (flags override the environment)")
    for opt in OPTIONS:
        if fields is not None and opt.field not in fields:
            continue
        flag = "--" + opt.field.replace("_", "-")
        kind = {bool: "true|false"}.get(type(opt.default), "VALUE")
        group.add_argument(flag, dest=opt.field, default=None, metavar=kind,
                           help=f"{opt.help} [env {opt.env}, default {opt.default}]")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> KvbmConfig:
    """Environment first, then any flag given on the command line (``--insecure``, where a
    daemon has it, is a shorthand for ``--insecure-tcp true``)."""
    overrides: dict[str, Any] = {"insecure_tcp": True} if getattr(args, "insecure", False) else {}
    for opt in OPTIONS:
        raw = getattr(args, opt.field, None)
        if raw is None:
            continue
        try:
            overrides[opt.field] = opt.parse(str(raw))
        except ValueError as exc:
            raise KvbmConfigError(f"--{opt.field.replace('_', '-')}={raw!r}: {exc}") from None
    return KvbmConfig.from_env(env, **overrides)


def config_to_env(cfg: KvbmConfig) -> dict[str, str]:
    """The environment that reproduces ``cfg`` in a child process."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        out[_BY_FIELD[f.name].env] = str(value).lower() if isinstance(value, bool) else str(value)
    return out
