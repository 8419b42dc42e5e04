"""The worker's region socket: where engines hand over their KV memory (never by path).

Runs in the worker daemon, on its event loop. Listens on ``config.region_socket(worker_id)``
(a unix stream socket, mode 0600, in the checked private socket directory). Owns the
listening socket and one task per connection; registration decisions are the
:class:`~.region_registry.RegionRegistry`'s. Wire format: :mod:`kvbm_client.region_wire`.

Per connection:

1. the peer's credentials (SO_PEERCRED): its uid must be ours; its pid becomes the region's
   owner (nothing in the request says who the owner is);
2. one frame (a ``RegisterRegionRequest``) with its fds (SCM_RIGHTS), within
   ``RegionLimits.max_request_bytes`` / ``max_buffers`` fds and :data:`RECEIVE_TIMEOUT_S`;
3. the registry maps it (memfds must be sealed against shrinking; CUDA IPC handles come
   only this way), the fds received are closed (the mappings keep the memory);
4. one reply frame (``RegionSocketReply``: the region id, or a status code and why not);
5. the region lives as long as the connection: end of stream, anything more sent, or a
   reset drops it; a region dropped by id (``UnregisterRegion``) closes the connection.

NOTE: the connection is the lifetime (decided over pid polling): an engine that dies, even
by SIGKILL, has its region dropped at once by the kernel closing its socket, and no other
process can ever take over a region by reusing or claiming a pid.
"""
from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from typing import Callable

import grpc

from kvbm_client.contract import pb
from kvbm_client.endpoints import prepare_unix_socket, remove_unix_socket
from kvbm_client.region_wire import HEADER, frame, frame_length, peer_credentials
from kvbm_client.security import region_digest
from kvbm_client.tasks import TaskSet

from .errors import RegionRejected
from .region_registry import RegionRegistry
from .regions import Peer

log = logging.getLogger("kvbm.worker")
Code = grpc.StatusCode

#: how long a connection may take to send its registration
RECEIVE_TIMEOUT_S = 10.0
#: connections that have not registered yet (beyond: RESOURCE_EXHAUSTED at once). NOTE: each
#: may hold up to DYN_KVBM_MAX_REGION_BUFFERS received fds until it is answered
MAX_PENDING = 4


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class RegionSocket:
    """One worker's region socket (see the module docstring).

    Args:
        path: the socket's path (``config.region_socket(worker_id)``).
        registry: decides and holds the regions.
        closing: true once the worker refuses new work.
    """

    def __init__(self, path: str, registry: RegionRegistry, closing: Callable[[], bool]) -> None:
        self.path = path
        self.registry = registry
        self._closing = closing
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections = TaskSet(log, "region socket connection")
        self._pending = 0

    async def start(self) -> None:
        address = "unix:" + self.path
        prepare_unix_socket(address)  # checks the directory (ours, 0700), removes a stale socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._accept_task = asyncio.ensure_future(self._accept())
        log.info("region socket %s", self.path)

    async def close(self) -> None:
        """Stop accepting, end every connection (the regions stay with the registry, which
        the service closes after the copies drained); idempotent."""
        tasks = [self._accept_task] if self._accept_task else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self._connections.close(), return_exceptions=True)
        self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            remove_unix_socket("unix:" + self.path)

    # ------------------------------------------------------------------ connections
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. EMFILE: keep the socket, try again shortly
                log.warning("region socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._connections.spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            region_id = await self._register(conn)
            if region_id is not None:
                await self._hold(conn, region_id)
        except (ConnectionError, OSError) as exc:
            log.debug("region socket connection: %s", exc)
        except Exception:
            log.exception("region socket connection failed")
        finally:
            conn.close()

    async def _register(self, conn: socket.socket) -> str | None:
        """Steps 1 to 3; the region id, or None after a refusal was answered."""
        self._pending += 1
        fds: list[int] = []
        try:
            peer = Peer(*peer_credentials(conn))
            if self._pending > MAX_PENDING:
                raise _Refused(Code.RESOURCE_EXHAUSTED, f"{MAX_PENDING} registrations are already in progress")
            if peer.uid != os.geteuid():
                raise _Refused(Code.PERMISSION_DENIED, f"uid {peer.uid} may not register regions with a worker "
                                                       f"of uid {os.geteuid()}")
            if self._closing():
                raise _Refused(Code.UNAVAILABLE, "worker is shutting down")
            body = await asyncio.wait_for(self._receive(conn, fds), RECEIVE_TIMEOUT_S)
            request = _parse(body)
            try:
                region = await self.registry.register(request, fds, peer)
            except RegionRejected as exc:
                raise _Refused(exc.code, exc.message) from None
        except _Refused as refusal:
            log.warning("region registration refused (peer pid %s): %s", _pid(conn), refusal.message)
            await self._reply(conn, pb.RegionSocketReply(code=refusal.code.value[0], message=refusal.message))
            return None
        except asyncio.TimeoutError:
            await self._reply(conn, pb.RegionSocketReply(
                code=Code.DEADLINE_EXCEEDED.value[0], message=f"no registration within {RECEIVE_TIMEOUT_S:g}s"))
            return None
        finally:
            self._pending -= 1
            for fd in fds:
                os.close(fd)
        return region.region_id

    async def _hold(self, conn: socket.socket, region_id: str) -> None:
        """Steps 4 and 5: answer, then hold the region until the peer's end or the region's,
        whichever comes first. Only a worker shutdown (cancellation) leaves the region to the
        registry; every other way out drops it."""
        loop = asyncio.get_running_loop()
        try:
            await self._reply(conn, pb.RegionSocketReply(region_id=region_id))
            peer_end = asyncio.ensure_future(_readable(loop, conn))
            dropped = asyncio.ensure_future(self.registry.wait_gone(region_id))
            try:
                await asyncio.wait({peer_end, dropped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                peer_end.cancel()
                dropped.cancel()
                # NOTE: let the reader be removed before the socket closes: its fd number is reused
                await asyncio.gather(peer_end, dropped, return_exceptions=True)
        except (ConnectionError, OSError) as exc:
            log.debug("region %s: %s", region_digest(region_id), exc)
        if self.registry.get(region_id) is not None:
            log.info("engine connection of region %s ended: dropping the region", region_digest(region_id))
            await self.registry.unregister(region_id)

    async def _receive(self, conn: socket.socket, fds: list[int]) -> bytes:
        """One frame; the fds that came with it are appended to ``fds`` (the caller closes them)."""
        loop = asyncio.get_running_loop()
        limits = self.registry.limits
        data = bytearray()
        need = HEADER.size
        while len(data) < need:
            await _readable(loop, conn)
            # (max_buffers memfds, and one more: the signal page)
            room = socket.CMSG_SPACE(max(0, limits.max_buffers + 1 - len(fds)) * array.array("i").itemsize)
            try:
                chunk, ancdata, flags, _ = conn.recvmsg(need - len(data), room)
            except BlockingIOError:
                continue
            fds.extend(_rights(ancdata))
            if flags & socket.MSG_CTRUNC or len(fds) > limits.max_buffers + 1:  # (the space is rounded up)
                raise _Refused(Code.INVALID_ARGUMENT, f"more than {limits.max_buffers + 1} fds "
                                                      "(DYN_KVBM_MAX_REGION_BUFFERS and a signal page)")
            if not chunk:
                raise ConnectionError("the peer closed the connection before its registration was complete")
            data += chunk
            if need == HEADER.size and len(data) == HEADER.size:
                try:
                    need += frame_length(bytes(data), limits.max_request_bytes)
                except ValueError as exc:
                    raise _Refused(Code.INVALID_ARGUMENT, f"{exc} (DYN_KVBM_MAX_REGION_PAGES, "
                                                          "DYN_KVBM_MAX_REGION_BUFFERS)") from None
        return bytes(data[HEADER.size:])

    @staticmethod
    async def _reply(conn: socket.socket, reply: "pb.RegionSocketReply") -> None:
        await asyncio.get_running_loop().sock_sendall(conn, frame(reply.SerializeToString()))


def _parse(body: bytes) -> "pb.RegisterRegionRequest":
    request = pb.RegisterRegionRequest()
    try:
        request.ParseFromString(body)
    except Exception:  # google.protobuf.message.DecodeError
        raise _Refused(Code.INVALID_ARGUMENT, "the frame is no RegisterRegionRequest") from None
    return request


def _rights(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[:len(data) - len(data) % received.itemsize])
            fds.extend(received)
    return fds


def _pid(conn: socket.socket) -> int | str:
    try:
        return peer_credentials(conn)[0]
    except OSError:
        return "?"


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until ``sock`` has data (or its end) to read."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)
    fd = sock.fileno()
    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
