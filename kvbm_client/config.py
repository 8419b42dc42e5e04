"""Configuration: the ``DYN_KVBM_*`` environment variables of NVIDIA Dynamo KVBM, same names,
meanings and defaults, plus a few of kvbm's own (marked "kvbm" in the table).

One table (:data:`OPTIONS`, in :mod:`.config_options`) drives the environment parser, every
daemon's ``--help`` and the README's configuration table, so the three never disagree.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from .config_options import OPTIONS, Option, default_socket_dir, parse_bool
from .errors import KvbmConfigError
from .ids import MAX_HASH_BYTES
from .presence import check_slots

__all__ = ["OPTIONS", "KvbmConfig", "Option", "add_config_arguments", "config_from_args", "config_to_env",
           "default_socket_dir", "parse_bool"]


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
