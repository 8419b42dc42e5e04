"""Every gRPC channel of kvbm is opened here: unix sockets as they are, TCP only with TLS (or
with ``DYN_KVBM_INSECURE_TCP``), the caller's credentials attached to every call, message
sizes bounded by the configuration.

Runs in every role. ``daemon_token`` is for daemons calling daemons; clients on TCP send the
first token of ``DYN_KVBM_CLIENT_TOKEN_FILE``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import grpc

from .config import KvbmConfig
from .contract import GRPC_OPTIONS
from .endpoints import check_socket_dir, is_unix, unix_path
from .errors import KvbmConfigError
from .security import AUTHORIZATION_HEADER, DAEMON_TOKEN_HEADER, channel_credentials, load_client_tokens

log = logging.getLogger("kvbm")


def grpc_options(config: KvbmConfig) -> list[tuple[str, Any]]:
    """Channel and server options: :data:`GRPC_OPTIONS` with message sizes derived from
    ``DYN_KVBM_MAX_HASHES_PER_REQUEST`` (a request far larger than that is refused by gRPC
    before any handler runs)."""
    size = config.max_message_bytes
    sized = {"grpc.max_send_message_length": size, "grpc.max_receive_message_length": size}
    return [(k, sized.get(k, v)) for k, v in GRPC_OPTIONS]


#: Channel-only option. NOTE: gRPC shares subchannels between channels to the same address, so
#: a channel dialled afresh after a daemon restarted would inherit the old one's reconnect
#: backoff and fail its first call with the dead process's "Connection refused"; each channel
#: of ours keeps its own.
OWN_SUBCHANNELS = ("grpc.use_local_subchannel_pool", 1)


def call_metadata(config: KvbmConfig, address: str, daemon_token: str | None) -> tuple[tuple[str, str], ...]:
    """What every call on a channel to ``address`` carries."""
    if daemon_token:
        return ((DAEMON_TOKEN_HEADER, daemon_token),)
    if not is_unix(address) and config.client_token_file:
        return ((AUTHORIZATION_HEADER, f"Bearer {load_client_tokens(config.client_token_file)[0]}"),)
    return ()


def _tcp_credentials(config: KvbmConfig, address: str) -> grpc.ChannelCredentials | None:
    if is_unix(address):
        # A directory planted by someone else is never trusted; a missing one just means the
        # node is not up yet (the call fails UNAVAILABLE, or waits with wait_for_ready).
        directory = os.path.dirname(unix_path(address)) or "."
        if os.path.lexists(directory):
            check_socket_dir(directory)
        return None
    creds = channel_credentials(config)
    if creds is None and not config.insecure_tcp:
        raise KvbmConfigError(f"{address} is a TCP address: set DYN_KVBM_TLS_CA (and a client token, "
                              "DYN_KVBM_CLIENT_TOKEN_FILE), or DYN_KVBM_INSECURE_TCP=true for a test setup")
    return creds


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sync-stack interceptor: appends fixed metadata to every call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _AioMetadata:
    """asyncio interceptors append fixed metadata to every call. NOTE: grpc.aio files each
    interceptor under one call type only (an if/elif on its base classes), so there is one
    class per type."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=grpc.aio.Metadata(*(tuple(details.metadata or ()) + self.metadata)))


class _AioUnaryMetadata(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamMetadata(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


def open_channel(address: str, config: KvbmConfig, daemon_token: str | None = None) -> grpc.Channel:
    """A blocking-stack channel to ``address`` (engines' scheduler and worker roles, the CLI)."""
    options = [*grpc_options(config), OWN_SUBCHANNELS]
    creds = _tcp_credentials(config, address)
    channel = grpc.secure_channel(address, creds, options) if creds else grpc.insecure_channel(address, options)
    metadata = call_metadata(config, address, daemon_token)
    return grpc.intercept_channel(channel, _AddMetadata(metadata)) if metadata else channel


def open_aio_channel(address: str, config: KvbmConfig, daemon_token: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (daemons, :class:`~kvbm_client.client.AsyncKvbmClient`)."""
    options = [*grpc_options(config), OWN_SUBCHANNELS]
    creds = _tcp_credentials(config, address)
    metadata = call_metadata(config, address, daemon_token)
    interceptors: list[Any] | None = [_AioUnaryMetadata(metadata), _AioStreamMetadata(metadata)] \
        if metadata else None
    if creds:
        return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
