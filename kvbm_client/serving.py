"""The one way a kvbm daemon serves gRPC: bounded messages, every call checked against the
node's access policy, unix sockets private, TCP only with TLS and client authentication.

Runs in the leader and worker daemons. Lifecycle: :func:`make_server`, add servicers, then
:func:`start_server`; the caller stops the server and calls ``remove_unix_socket``.
"""
from __future__ import annotations

import logging

import grpc

from .channels import grpc_options
from .config import KvbmConfig
from .endpoints import is_unix, prepare_unix_socket, secure_unix_socket
from .errors import KvbmConfigError
from .security import AccessPolicy, AuthInterceptor, NodeKey, load_client_tokens, server_credentials

log = logging.getLogger("kvbm")


def make_server(config: KvbmConfig, address: str, node_key: NodeKey) -> grpc.aio.Server:
    """A server whose every call passes the :class:`AccessPolicy` first (client tokens are
    required on TCP when configured)."""
    tokens = () if is_unix(address) else load_client_tokens(config.client_token_file)
    policy = AccessPolicy(node_key, tokens)
    return grpc.aio.server(options=grpc_options(config), interceptors=[AuthInterceptor(policy)])


async def start_server(server: grpc.aio.Server, address: str, config: KvbmConfig) -> None:
    """Bind ``address`` and start. A unix socket goes in a checked private directory with
    mode 0600; TCP needs a certificate and a way to authenticate clients (tokens or mTLS),
    else it is refused unless ``DYN_KVBM_INSECURE_TCP`` / ``--insecure`` (then a warning)."""
    if is_unix(address):
        prepare_unix_socket(address)
        server.add_insecure_port(address)
        await server.start()
        secure_unix_socket(address)
        return
    creds = server_credentials(config)
    authenticated = creds is not None and bool(config.tls_ca or config.client_token_file)
    if not authenticated:
        if not config.insecure_tcp:
            raise KvbmConfigError(
                f"refusing to listen on TCP {address} without TLS and client authentication: set "
                "DYN_KVBM_TLS_CERT and DYN_KVBM_TLS_KEY, and DYN_KVBM_CLIENT_TOKEN_FILE or DYN_KVBM_TLS_CA "
                "(mTLS); or pass --insecure for a test setup")
        log.warning("listening on TCP %s WITHOUT %s: any host that reaches it can use this node", address,
                    "client authentication" if creds else "TLS")
    if creds is not None:
        server.add_secure_port(address, creds)
    else:
        server.add_insecure_port(address)
    await server.start()
