"""Who may call what on a node, and the keys that make plans and acknowledgements unforgeable.

Runs in every role. The threat model is in the README ("Threat model"); in short:

* **The node key** (32 random bytes in a 0600 file, ``DYN_KVBM_NODE_KEY_FILE``, default
  ``<socket dir>/node.key``) is created by the leader and read by the workers. Clients never
  need it. Everything daemon-only derives from it with HMAC-SHA256 and a label:

  - the *daemon token*, presented in the ``kvbm-daemon-token`` metadata by a daemon calling
    another daemon (a worker's ``Attach``/``SetLayout``/``PoolsReady``/``StartTransfer``/
    ``CompleteTransfer``, the leader's ``Worker.Command``);
  - the *plan key* of one leader incarnation, ``derive("plan-key/" + leader_id)``: the leader
    signs plans with it and a worker derives the same key from the leader id in ``Welcome``,
    so no key ever travels;
  - the *ack key*: a worker signs each command acknowledgement with it, so a NATS subscriber
    cannot acknowledge for a worker.

* **Client tokens** (``DYN_KVBM_CLIENT_TOKEN_FILE``, one per line) are required from clients on
  TCP listeners (``authorization: Bearer <token>``). On unix sockets the socket's 0600 mode in
  a 0700 directory is the authentication: only the daemons' own user can connect.

* **TLS**: a TCP listener needs a certificate and key (``DYN_KVBM_TLS_CERT``/``_KEY``), and
  with ``DYN_KVBM_TLS_CA`` it requires client certificates (mTLS). Without TLS and tokens a
  daemon refuses to listen on TCP unless ``DYN_KVBM_INSECURE_TCP`` is set.
"""
from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Awaitable, Callable, Mapping

import grpc

from .config import KvbmConfig
from .errors import KvbmConfigError

log = logging.getLogger("kvbm")

NODE_KEY_BYTES = 32
DAEMON_TOKEN_HEADER = "kvbm-daemon-token"
AUTHORIZATION_HEADER = "authorization"


# ---------------------------------------------------------------------------- node key
@dataclass(frozen=True)
class NodeKey:
    """The node's shared secret and what derives from it (see the module docstring)."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) < NODE_KEY_BYTES:
            raise KvbmConfigError(f"node key has {len(self.secret)} bytes; {NODE_KEY_BYTES} needed")

    def __repr__(self) -> str:  # never print the secret
        return "NodeKey(<redacted>)"

    def derive(self, label: str) -> bytes:
        return hmac.new(self.secret, b"kvbm/v1/" + label.encode(), hashlib.sha256).digest()

    @cached_property
    def daemon_token(self) -> str:
        """(Derived once: every call a daemon serves compares against it.)"""
        return self.derive("daemon-token").hex()

    def plan_key(self, leader_id: str) -> bytes:
        """The key one leader incarnation signs plans with (workers derive the same)."""
        return self.derive("plan-key/" + leader_id)

    @property
    def ack_key(self) -> bytes:
        return self.derive("ack-key")


def _check_private(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise KvbmConfigError(f"node key {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise KvbmConfigError(f"node key {path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise KvbmConfigError(f"node key {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0600 "
                              f"(chmod 600 {path})")


def load_node_key(path: str) -> NodeKey:
    """Read the node key; refuses a file that others could read or that is not ours."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        _check_private(path, os.fstat(fd))
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        return NodeKey(bytes.fromhex(data.decode().strip()))
    except ValueError:
        raise KvbmConfigError(f"node key {path} is not hex text") from None


def create_node_key(path: str) -> NodeKey:
    """Load the node key at ``path``, or create it (0600, written to a temporary file and
    renamed into place, so a reader never sees half a key)."""
    try:
        return load_node_key(path)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".node.key.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(NODE_KEY_BYTES).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another leader created it meanwhile: then use that one
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    log.info("node key at %s", path)
    return load_node_key(path)


async def wait_node_key(path: str, timeout: float) -> NodeKey:
    """A worker waits for the leader to create the node key (started in any order)."""
    end = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return load_node_key(path)
        except FileNotFoundError:
            if time.monotonic() >= end:
                raise KvbmConfigError(f"no node key at {path} after {timeout:g}s: start the leader first, or "
                                      "point DYN_KVBM_NODE_KEY_FILE at the leader's key") from None
        await asyncio.sleep(delay)
        delay = min(1.0, delay * 2)


# ---------------------------------------------------------------------------- acknowledgements
def _ack_message(worker_id: str, job_id: int, ok: bool, error: str) -> bytes:
    return f"{worker_id}\x1f{job_id}\x1f{int(ok)}\x1f{error}".encode()


def sign_ack(key: NodeKey, worker_id: str, job_id: int, ok: bool, error: str) -> bytes:
    return hmac.new(key.ack_key, _ack_message(worker_id, job_id, ok, error), hashlib.sha256).digest()


def ack_is_authentic(key: NodeKey, resp: Any, worker_id: str, job_id: int) -> bool:
    """Whether ``resp`` (a ``CommandResponse``) was signed by a daemon of this node, for this
    worker and job (a replayed acknowledgement of another job does not verify)."""
    if resp.worker_id != worker_id or resp.job_id != job_id:
        return False
    expected = sign_ack(key, worker_id, job_id, resp.ok, resp.error)
    return hmac.compare_digest(expected, resp.signature)


# ---------------------------------------------------------------------------- client tokens
def load_client_tokens(path: str | None) -> tuple[str, ...]:
    """The accepted client tokens (one per line, blank lines and ``#`` comments ignored)."""
    if not path:
        return ()
    with open(path) as f:
        tokens = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise KvbmConfigError(f"DYN_KVBM_CLIENT_TOKEN_FILE {path} holds no token")
    return tokens


def _metadata(pairs: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if isinstance(value, bytes):
            continue
        out.setdefault(key.lower(), value)
    return out


def _matches(presented: str | None, accepted: tuple[str, ...]) -> bool:
    if not presented:
        return False
    ok = False
    for token in accepted:  # no early exit: constant time in which token matched
        ok |= hmac.compare_digest(presented.encode(), token.encode())
    return ok


# ---------------------------------------------------------------------------- roles
class Role(enum.Enum):
    """Who may call an RPC."""

    ANYONE = "anyone"  # status, sessions, transfers: a client of the node
    DAEMON = "daemon"  # only the node's leader and workers (node key holders)


#: Per fully qualified method; methods not listed are client methods (``Role.ANYONE``).
DAEMON_METHODS: frozenset[str] = frozenset({
    "/kvbm.v1.Leader/Attach", "/kvbm.v1.Leader/SetLayout", "/kvbm.v1.Leader/PoolsReady",
    "/kvbm.v1.Leader/CompleteTransfer", "/kvbm.v1.Leader/StartTransfer", "/kvbm.v1.Worker/Command",
})


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""


@dataclass(frozen=True)
class AccessPolicy:
    """The pure decision: may a call of ``method`` with ``metadata`` go on?

    Args:
        node_key: the node key (daemon calls must present its daemon token).
        client_tokens: tokens clients must present (``authorization: Bearer``); empty means
            client calls need no token (unix sockets).
    """

    node_key: NodeKey
    client_tokens: tuple[str, ...] = ()

    def check(self, method: str, metadata: Mapping[str, str]) -> Verdict:
        daemon = _matches(metadata.get(DAEMON_TOKEN_HEADER), (self.node_key.daemon_token,))
        if method in DAEMON_METHODS:
            if daemon:
                return Verdict(True)
            if DAEMON_TOKEN_HEADER in metadata:
                return Verdict(False, grpc.StatusCode.PERMISSION_DENIED,
                               f"{method}: the daemon token is not this node's")
            return Verdict(False, grpc.StatusCode.UNAUTHENTICATED,
                           f"{method} is for the node's daemons; a client may not call it")
        if not self.client_tokens or daemon:
            return Verdict(True)
        auth = metadata.get(AUTHORIZATION_HEADER, "")
        if _matches(auth[7:] if auth.lower().startswith("bearer ") else None, self.client_tokens):
            return Verdict(True)
        return Verdict(False, grpc.StatusCode.UNAUTHENTICATED,
                       f"{method}: a client token is required (authorization: Bearer …)")


def _denial(verdict: Verdict, streaming: bool) -> grpc.RpcMethodHandler:
    if streaming:
        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(verdict.code, verdict.details)
            yield  # pragma: no cover - makes this an async generator
        return grpc.unary_stream_rpc_method_handler(deny_stream)

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(verdict.code, verdict.details)
    return grpc.unary_unary_rpc_method_handler(deny)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies an :class:`AccessPolicy` to every call before its handler runs."""

    def __init__(self, policy: AccessPolicy, streaming_methods: frozenset[str] = frozenset()) -> None:
        self.policy = policy
        self.streaming = streaming_methods | {"/kvbm.v1.Leader/Attach"}

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        verdict = self.policy.check(details.method, _metadata(details.invocation_metadata))
        if verdict.allowed:
            return await continuation(details)
        log.warning("refused %s: %s", details.method, verdict.details)
        return _denial(verdict, details.method in self.streaming)


# ---------------------------------------------------------------------------- TLS
def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(config: KvbmConfig) -> grpc.ServerCredentials | None:
    """TLS for a TCP listener (mTLS when a CA is configured); None without a certificate."""
    if not config.tls_cert:
        return None
    assert config.tls_key is not None  # validated together
    ca = _read(config.tls_ca) if config.tls_ca else None
    return grpc.ssl_server_credentials([(_read(config.tls_key), _read(config.tls_cert))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(config: KvbmConfig) -> grpc.ChannelCredentials | None:
    """TLS for a client of a TCP listener (with our certificate when we have one: mTLS)."""
    if not (config.tls_ca or config.tls_cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca) if config.tls_ca else None,
        private_key=_read(config.tls_key) if config.tls_key else None,
        certificate_chain=_read(config.tls_cert) if config.tls_cert else None)


def region_digest(region_id: str) -> str:
    """What a worker shows of a region id (the id itself is a capability)."""
    return hashlib.sha256(region_id.encode()).hexdigest()[:16] if region_id else ""
