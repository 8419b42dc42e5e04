"""The region socket's wire format, and the engine side of it: hand KV memory to a worker.

Runs in the engine process (``KvbmClient.register_region``, the connectors' ``RegionLink``)
and, for the frame format only, in the worker daemon (:mod:`kvbm_worker.region_socket`).

A worker listens on ``config.region_socket(worker_id)``, a unix stream socket (0600) in the
checked private socket directory. One connection = one registration = one region:

1. the engine sends one frame, ``MAGIC`` + a 4-byte big-endian length + a serialized
   ``RegisterRegionRequest``, with the region's memfds attached to its first byte
   (SCM_RIGHTS; ``RegionBuffer.fd_index`` names them);
2. the worker answers one frame holding a ``RegionSocketReply`` (the region id, or a gRPC
   status code and why not) and, on success, keeps the connection open;
3. the region lives exactly as long as the connection: the engine closes it (or dies, and
   the kernel closes it) and the worker drops the region; the worker drops it
   (``UnregisterRegion``, shutdown) and the engine sees the connection end.

NOTE: the connection, not a pid, is the region's lifetime: nothing polls for a dead owner,
and a pid reused by another process can never inherit a region.
"""
from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass
from typing import Sequence

import grpc

from .contract import pb
from .endpoints import check_socket_dir
from .errors import KvbmError, KvbmRequestError, KvbmUnavailableError

MAGIC = b"KVR1"
HEADER = struct.Struct("!4sI")
#: a reply is a region id or a short message; anything longer is not a worker talking
MAX_REPLY_BYTES = 1 << 16


def frame(message: bytes) -> bytes:
    """``message`` with its header."""
    return HEADER.pack(MAGIC, len(message)) + message


def frame_length(header: bytes, max_bytes: int) -> int:
    """The body length a header announces; ValueError if it is no frame or too long."""
    magic, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ValueError(f"not a kvbm region frame (starts with {magic!r})")
    if length > max_bytes:
        raise ValueError(f"frame of {length} bytes; at most {max_bytes}")
    return int(length)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


class RegionRefused(KvbmRequestError):
    """The worker refused the registration (``code`` is the gRPC status it names)."""


@dataclass
class RegionLease:
    """A registered region, held by its open connection. ``close()`` unregisters it (the
    worker sees the connection end); :meth:`alive` tells whether the worker still holds it."""

    region_id: str
    path: str
    sock: socket.socket

    def alive(self) -> bool:
        """False once the worker closed the connection (it dropped the region or exited)."""
        if self.sock.fileno() < 0:
            return False
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return True
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Unregister (end the connection); idempotent."""
        self.sock.close()


def register(path: str, request: "pb.RegisterRegionRequest", fds: Sequence[int], timeout: float) -> RegionLease:
    """Register a region on the worker listening at ``path`` (blocking; call it off an event
    loop). The only registration path of the engine side.

    Raises:
        KvbmUnavailableError: no worker listens there (not started, restarted, wrong socket dir).
        RegionRefused: the worker refused the region (its code and reason).
        KvbmError: the socket directory is not private, or the listener is not our user's.
    """
    check_socket_dir(os.path.dirname(path) or ".")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise KvbmUnavailableError(f"no kvbm worker at {path}: {exc.strerror}") from None
        _, uid, _ = peer_credentials(sock)
        if uid != os.geteuid():  # NOTE: we hand it our memory: only our own user's worker
            raise KvbmError(f"{path} is served by uid {uid}, not by us (uid {os.geteuid()}); refusing")
        reply = _exchange(sock, frame(request.SerializeToString()), list(fds))
    except BaseException:
        sock.close()
        raise
    if reply.code != grpc.StatusCode.OK.value[0]:
        sock.close()
        code = next((c for c in grpc.StatusCode if c.value[0] == reply.code), grpc.StatusCode.UNKNOWN)
        raise RegionRefused(f"worker at {path} refused the region ({code.name}): {reply.message}", code)
    sock.settimeout(None)
    return RegionLease(reply.region_id, path, sock)


def _exchange(sock: socket.socket, data: bytes, fds: list[int]) -> "pb.RegionSocketReply":
    try:
        try:
            sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
            sock.sendall(data[sent:])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker refused before reading it all: its reply says why
        header = _read_exactly(sock, HEADER.size)
        body = _read_exactly(sock, frame_length(header, MAX_REPLY_BYTES))
    except (socket.timeout, TimeoutError):
        raise KvbmUnavailableError(f"the kvbm worker at {sock.getpeername()} did not answer") from None
    except (ConnectionError, ValueError) as exc:
        raise KvbmUnavailableError(f"region socket: {exc}") from None
    reply = pb.RegionSocketReply()
    reply.ParseFromString(body)
    return reply


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        data += chunk
    return bytes(data)
