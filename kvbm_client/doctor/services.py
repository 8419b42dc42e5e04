"""Checks of what the node talks to and listens on: etcd, NATS, the socket directory, the
metrics port.

Runs in ``kvbm doctor``; every network probe is bounded by ``DoctorOptions.timeout_s``.
etcd and NATS are probed with the project's own clients (aetcd, nats-py), imported lazily
so that a single-node install without ``kvbm[cluster]`` still runs the other checks.
"""
from __future__ import annotations

import asyncio
import errno
import os
import pwd
import socket
import stat
import urllib.error
import urllib.request

from ..discovery import parse_endpoints
from .base import Check, CheckResult, DoctorContext, fail, ok, skip

CLUSTER_EXTRA = "pip install 'kvbm[cluster]'"


async def _etcd_status(host: str, port: int, timeout: float) -> str:
    import aetcd

    client = aetcd.Client(host=host, port=port, timeout=timeout, connect_wait_timeout=timeout)
    try:
        await asyncio.wait_for(client.connect(), timeout)
        status = await asyncio.wait_for(client.status(), timeout)
        return f"etcd {status.version}"
    finally:
        await asyncio.wait_for(client.close(), timeout)


def check_etcd(ctx: DoctorContext) -> CheckResult:
    """ETCD_ENDPOINTS (when set) answers: the endpoint kvbm uses is its first one."""
    endpoints = ctx.cfg.etcd_endpoints
    if not endpoints:
        return skip("ETCD_ENDPOINTS not set (single node, no discovery)")
    try:
        host, port = parse_endpoints(endpoints)[0]
    except ValueError as exc:
        return fail(f"ETCD_ENDPOINTS={endpoints!r}: {exc}", "set it to http://HOST:PORT[,...]")
    try:
        import aetcd  # noqa: F401
    except ImportError:
        return fail("ETCD_ENDPOINTS is set but aetcd is not installed", CLUSTER_EXTRA)
    try:
        version = asyncio.run(_etcd_status(host, port, ctx.options.timeout_s))
    except Exception as exc:  # aetcd ConnectionFailedError, grpc errors, timeouts
        why = type(exc).__name__ + (f": {exc}" if str(exc) else "")
        return fail(f"etcd at {host}:{port} unreachable within {ctx.options.timeout_s:g} s ({why})",
                    f"start etcd or fix ETCD_ENDPOINTS (`etcdctl --endpoints={host}:{port} endpoint health`)")
    return ok(f"{version} at {host}:{port}")


async def _nats_info(servers: list[str], timeout: float) -> str:
    import nats

    seen: list[Exception] = []

    async def remember(exc: Exception) -> None:  # nats-py would log every failed attempt
        seen.append(exc)

    # NOTE: max_reconnect_attempts=1 makes nats-py give up on a refused server after one
    # retry; with 0 its server selection loops forever.
    try:
        nc = await nats.connect(servers=servers, connect_timeout=timeout, allow_reconnect=False,
                                max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=remember,
                                name="kvbm-doctor")
    except Exception as exc:
        if seen:
            raise ConnectionError(f"{type(seen[-1]).__name__}: {seen[-1]}") from exc
        raise
    try:
        await nc.flush(timeout=max(1, round(timeout)))
        where = nc.connected_url.netloc if nc.connected_url else servers[0]
        return f"nats-server {nc._server_info.get('version', '?')} at {where}"
    finally:
        await nc.close()


def check_nats(ctx: DoctorContext) -> CheckResult:
    """NATS_SERVER (when set) accepts a connection and answers a PING."""
    servers = [s.strip() for s in (ctx.cfg.nats_server or "").split(",") if s.strip()]
    if not servers:
        return skip("NATS_SERVER not set (commands over gRPC, no KV events)")
    try:
        import nats  # noqa: F401
    except ImportError:
        return fail("NATS_SERVER is set but nats-py is not installed", CLUSTER_EXTRA)
    try:
        text = asyncio.run(asyncio.wait_for(_nats_info(servers, ctx.options.timeout_s), ctx.options.timeout_s * 2))
    except Exception as exc:  # refused, NoServersError, timeouts
        why = type(exc).__name__ + (f": {exc}" if str(exc) else "")
        return fail(f"NATS at {', '.join(servers)} unreachable ({why})",
                    "start nats-server or fix NATS_SERVER (nats://HOST:PORT)")
    return ok(text)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_socket_dir(ctx: DoctorContext) -> CheckResult:
    """The unix-socket directory is ours, a real directory, mode 0700 (ssh-agent's rules)."""
    path = ctx.cfg.resolved_socket_dir
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ok(f"{path} does not exist yet; the daemons create it with mode 0700")
    if stat.S_ISLNK(st.st_mode):
        return fail(f"{path} is a symlink (to {os.readlink(path)}): whoever owns the target can "
                    "intercept the leader's plan secret", f"remove the link (rm {path}); the daemons create a "
                    "real 0700 directory")
    if not stat.S_ISDIR(st.st_mode):
        return fail(f"{path} is not a directory", "remove it, or set DYN_KVBM_SOCKET_DIR elsewhere")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return fail(f"{path} is owned by {_owner(st.st_uid)}, not by {_owner(os.geteuid())}",
                    "remove it (it may be another user's), or set DYN_KVBM_SOCKET_DIR to a directory of yours")
    if mode & 0o077:
        return fail(f"{path} has mode {mode:04o}: other users can reach the leader's and workers' sockets",
                    f"chmod 700 {path}", mode=f"{mode:04o}")
    return ok(f"{path}: owned by {_owner(st.st_uid)}, mode {mode:04o}", mode=f"{mode:04o}")


def _serves_kvbm_metrics(addr: str, port: int, timeout: float) -> bool:
    host = "127.0.0.1" if addr in ("0.0.0.0", "") else ("::1" if addr == "::" else addr)
    url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return b"kvbm_" in reply.read(1 << 20)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def check_metrics_port(ctx: DoctorContext) -> CheckResult:
    """With DYN_KVBM_METRICS on, the /metrics port is free (or already this node's leader's)."""
    cfg = ctx.cfg
    if not cfg.metrics:
        return skip("metrics off (DYN_KVBM_METRICS)")
    where = f"{cfg.metrics_addr}:{cfg.metrics_port}"
    family = socket.AF_INET6 if ":" in cfg.metrics_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # NOTE: SO_REUSEADDR like the leader's HTTP server, so TIME_WAIT does not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.metrics_addr, cfg.metrics_port))
            return ok(f"{where} free")
        except OSError as exc:
            error = exc
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return fail(f"{where}: {error.strerror or error}", "set DYN_KVBM_METRICS_ADDR to an address of this machine")
    if error.errno != errno.EADDRINUSE:
        return fail(f"{where}: cannot bind ({error.strerror})", "choose another DYN_KVBM_METRICS_PORT")
    if ctx.node().running and _serves_kvbm_metrics(cfg.metrics_addr, cfg.metrics_port, ctx.options.timeout_s):
        return ok(f"{where} in use by this node's leader (serves kvbm_* metrics)")
    return fail(f"{where} is in use by another process: the leader would fail to start",
                "set DYN_KVBM_METRICS_PORT to a free port, or stop that process "
                f"(`ss -ltnp 'sport = :{cfg.metrics_port}'`)")


CHECKS = (
    Check("services", "etcd", check_etcd),
    Check("services", "nats", check_nats),
    Check("services", "socket_dir", check_socket_dir),
    Check("services", "metrics_port", check_metrics_port),
)
