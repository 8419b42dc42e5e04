"""KvbmClient: the contract's Python side for engines and tools (async, plus a sync facade).

A client holds a leader session (renewed in the background) and one channel per worker.
One gRPC round trip per batch: ``prepare_*`` asks the leader for a signed plan for the whole
batch; each worker executes it in one ``Transfer`` call and confirms it to the leader before
answering, so when :meth:`AsyncKvbmClient.wait` returns the blocks are committed (stores)
or in the engine's memory (loads). Clients never own data.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import MappingProxyType
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

import grpc

from .config import KvbmConfig
from .channels import open_aio_channel
from .contract import MatchResult, pb, rpc
from .errors import KvbmRequestError, KvbmTimeoutError, KvbmUnavailableError, from_rpc_error
from .handles import TransferHandle, TransferResult, load_handle, store_handle
from .ids import BlockHash, EngineBlockId, SessionId, WorkerId
from .region_wire import RegionLease, register
from .regions import RegionSpecLike
from .session import SessionCore

log = logging.getLogger("kvbm.client")
T = TypeVar("T")
CONTROL_TIMEOUT = 10.0


class AsyncKvbmClient:
    """Async client; create with :meth:`connect`. The asyncio shell of a
    :class:`~kvbm_client.session.SessionCore` (session decisions live there)."""

    def __init__(self, config: KvbmConfig | None = None, leader_address: str | None = None,
                 client_name: str = "kvbm-client") -> None:
        self.config = config or KvbmConfig.from_env()
        self.leader_address = leader_address or self.config.resolved_leader_address
        # With ETCD_ENDPOINTS and no explicit address, the node's leader is looked up in etcd.
        self._discover = not (leader_address or self.config.leader_address) and bool(self.config.etcd_endpoints)
        self.client_name = client_name
        self._session = SessionCore(client_name)
        self._regions: dict[WorkerId, RegionLease] = {}  # worker id -> our region there, held open
        self._channel: grpc.aio.Channel | None = None
        self._leader: Any = None  # rpc.LeaderStub (the generated stubs are untyped)
        self._worker_stubs: dict[WorkerId, tuple[grpc.aio.Channel, Any]] = {}
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False
        self.control_timeout = CONTROL_TIMEOUT

    # ------------------------------------------------------------------ state
    @property
    def session_id(self) -> SessionId:
        return self._session.session_id

    @property
    def max_hashes(self) -> int:
        return self._session.max_hashes

    @property
    def workers(self) -> dict[WorkerId, "pb.WorkerInfo"]:
        """The node's workers (as of the session's opening or the last :meth:`refresh_workers`)."""
        return self._session.workers

    @property
    def regions(self) -> Mapping[WorkerId, str]:
        """Region id of this client's engine memory on each worker (read-only)."""
        return MappingProxyType({w: lease.region_id for w, lease in self._regions.items()})

    def region_id(self, worker_id: str) -> str | None:
        """The region this client registered on ``worker_id``, or None."""
        lease = self._regions.get(WorkerId(worker_id))
        return lease.region_id if lease is not None else None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def connect(cls, config: KvbmConfig | None = None, leader_address: str | None = None,
                      client_name: str = "kvbm-client", timeout: float = CONTROL_TIMEOUT) -> "AsyncKvbmClient":
        client = cls(config, leader_address, client_name)
        client.control_timeout = timeout
        await client._open(timeout)
        return client

    async def _open(self, timeout: float) -> None:
        if self._discover:
            from .discovery import lookup_leader  # lazy: needs aetcd
            self.leader_address = (await lookup_leader(self.config, timeout))["endpoint"]
        self._channel = open_aio_channel(self.leader_address, self.config)
        self._leader = rpc.LeaderStub(self._channel)
        await self._open_session(timeout)
        self._keepalive = asyncio.ensure_future(self._keepalive_loop())

    async def _open_session(self, timeout: float = CONTROL_TIMEOUT) -> None:
        try:
            resp = await self._leader.OpenSession(self._session.open_request(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise self._session.open_error(exc, self.leader_address, timeout) from None
        self._session.opened(resp)

    async def _keepalive_loop(self) -> None:
        core = self._session
        while not self._closed:
            await asyncio.sleep(core.renew_every_s)
            try:
                resp = await self._leader.KeepAlive(core.keepalive_request(), timeout=core.renew_every_s)
            except grpc.RpcError as exc:
                if not core.reopen_after(exc):
                    log.debug("keepalive failed: %s", exc.code().name)
                    continue
                try:
                    await self._open_session()
                    log.warning("kvbm session re-opened")
                except Exception as reopen:
                    log.debug("re-open failed: %s", reopen)
                continue
            if resp.ready and not core.workers:
                # re-opened while the workers re-attached to a new leader: learn them again
                try:
                    await self.refresh_workers()
                    log.info("kvbm: workers known again: %s", ", ".join(sorted(core.workers)) or "none")
                except Exception as exc:  # noqa: BLE001 - the next keepalive tries again
                    log.debug("refreshing the workers failed: %s", exc)

    async def close(self) -> None:
        """Close the session (releasing pins) and the channels; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._leader is not None and self.session_id:
            try:
                await self._leader.CloseSession(self._session.close_request(), timeout=2)
            except grpc.RpcError:
                pass
        for lease in self._regions.values():
            lease.close()  # the workers drop our regions
        self._regions.clear()
        for channel, _ in self._worker_stubs.values():
            await channel.close()
        self._worker_stubs.clear()
        if self._channel is not None:
            await self._channel.close()

    # ------------------------------------------------------------------ calls
    async def _leader_call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        for attempt in (0, 1):
            self._session.stamp(request)
            try:
                return await getattr(self._leader, name)(request, timeout=timeout or self.control_timeout)
            except grpc.RpcError as exc:
                if self._session.retry_after(exc, attempt, request):
                    # The leader restarted (or our session expired): open a new session, retry once.
                    await self._open_session()
                    log.warning("kvbm session re-opened after: %s", exc.details())
                    continue
                raise from_rpc_error(exc, f"leader {name}") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _worker(self, worker_id: WorkerId) -> Any:
        """The worker's stub (``rpc.WorkerStub``), dialled on first use."""
        if worker_id not in self._worker_stubs:
            info = self.workers.get(worker_id)
            if info is None:
                raise KvbmRequestError(f"unknown worker {worker_id!r}; known: {', '.join(self.workers)}")
            channel = open_aio_channel(info.endpoint, self.config)
            self._worker_stubs[worker_id] = (channel, rpc.WorkerStub(channel))
        return self._worker_stubs[worker_id][1]

    async def status(self) -> "pb.StatusResponse":
        return await self._leader_call("Status", pb.StatusRequest())

    async def refresh_workers(self) -> None:
        status = await self.status()
        self._session.workers = {WorkerId(w.worker_id): w for w in status.workers}

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every worker of the node has allocated its pools; a leader that does not
        answer yet (starting, restarting) is waited for too, within ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            try:
                resp = await self._leader_call("KeepAlive", pb.KeepAliveRequest())
            except KvbmUnavailableError as exc:
                if time.monotonic() > end:
                    raise KvbmTimeoutError(f"kvbm not ready after {timeout:g}s: {exc}") from exc
                await asyncio.sleep(0.1)
                continue
            if resp.ready:
                await self.refresh_workers()
                return
            if time.monotonic() > end:
                raise KvbmTimeoutError(f"kvbm not ready after {timeout:g}s")
            await asyncio.sleep(0.05)

    async def register_region(self, worker_id: str, spec: RegionSpecLike) -> str:
        """Hand an engine KV region to a worker over its region socket (memfds or CUDA IPC
        handles; :mod:`.region_wire`); returns its region id. The region stays registered
        while this client holds it (until :meth:`unregister_region` or :meth:`close`). Waits
        (up to the control timeout) for a worker that has not attached to the leader yet.
        Registers afresh when called again (e.g. after the worker restarted and lost it)."""
        worker_id = WorkerId(worker_id)
        end = time.monotonic() + CONTROL_TIMEOUT
        while worker_id not in self.workers:
            await self.refresh_workers()
            if worker_id in self.workers:
                break
            if time.monotonic() > end:
                raise KvbmTimeoutError(f"worker {worker_id!r} did not attach to the leader within "
                                       f"{CONTROL_TIMEOUT:g}s; attached: {', '.join(self.workers) or 'none'}")
            await asyncio.sleep(0.05)
        old = self._regions.pop(worker_id, None)
        if old is not None:
            old.close()
        # NOTE: a region registered again usually means a restarted worker: dial it afresh, as
        # the old channel may sit in its reconnect backoff and fail the first call at once.
        stale = self._worker_stubs.pop(worker_id, None)
        if stale is not None:
            await stale[0].close()
        lease = await asyncio.to_thread(register, self.config.region_socket(worker_id), spec.to_request(),
                                        spec.fds, CONTROL_TIMEOUT)
        self._regions[worker_id] = lease
        return lease.region_id

    async def unregister_region(self, worker_id: str) -> None:
        """Drop our region on ``worker_id``; returns once the worker no longer holds it."""
        worker_id = WorkerId(worker_id)
        lease = self._regions.pop(worker_id, None)
        if lease is None:
            return
        try:
            await self._worker(worker_id).UnregisterRegion(pb.UnregisterRegionRequest(region_id=lease.region_id),
                                                           timeout=CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the worker dropped it already
                raise from_rpc_error(exc, f"worker {worker_id} UnregisterRegion") from None
        finally:
            lease.close()

    async def match(self, hashes: Sequence[BlockHash], tokens_per_block: int = 0,
                    count_hit: bool = True) -> MatchResult:
        resp = await self._leader_call("Match", pb.MatchRequest(
            hashes=list(hashes), count_hit=count_hit, tokens_per_block=tokens_per_block))
        return MatchResult.from_response(resp)

    # ------------------------------------------------------------------ transfers
    async def prepare_store(self, hashes: Sequence[BlockHash],
                            parents: Sequence[BlockHash] | None = None) -> TransferHandle:
        resp = await self._leader_call("PrepareStore", pb.PrepareStoreRequest(
            hashes=list(hashes), parent_hashes=list(parents or [])))
        return store_handle(resp)

    async def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                           tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0) -> TransferHandle:
        """Plan and pin the longest stored prefix of ``hashes`` (``count_hit``: also count it
        as a lookup, saving a separate :meth:`match` round trip; ``prefill_tokens_per_s`` > 0
        with ``tokens_per_block``: only as far as loading beats recomputing, see
        :mod:`kvbm_leader.onboard_cost`)."""
        resp = await self._leader_call("PrepareLoad", pb.PrepareLoadRequest(
            hashes=list(hashes), count_hit=count_hit, tokens_per_block=tokens_per_block,
            prefill_tokens_per_s=prefill_tokens_per_s))
        return load_handle(resp)

    def start(self, handle: TransferHandle, engine_blocks: Sequence[EngineBlockId] | Sequence[int],
              worker_ids: Sequence[str] | None = None) -> None:
        """Send the planned entries' engine blocks to each worker (one call per worker)."""
        if handle.is_empty:
            return
        blocks = list(engine_blocks)
        if len(blocks) != handle.num_blocks:
            raise KvbmRequestError(f"{len(blocks)} engine blocks for {handle.num_blocks} planned entries")
        targets = [WorkerId(w) for w in worker_ids or self.workers]
        if not targets:  # e.g. a session re-opened while the workers re-attached to a new leader
            raise KvbmUnavailableError("no worker of this node is known yet (a session re-opened before the workers "
                                       "attached learns them with a later keepalive, or call refresh_workers())")
        for worker_id in targets:
            lease = self._regions.get(worker_id)
            if lease is None:
                raise KvbmRequestError(f"no engine region registered on worker {worker_id}")
            request = pb.TransferRequest(region_id=lease.region_id, plan=handle.signed, engine_blocks=blocks)
            timeout = max(1.0, handle.deadline - time.monotonic()) * 2 + 5
            handle.tasks.append(asyncio.ensure_future(self._transfer(worker_id, request, timeout)))

    async def _transfer(self, worker_id: WorkerId, request: "pb.TransferRequest",
                        timeout: float) -> "pb.TransferResponse":
        try:
            return await self._worker(worker_id).Transfer(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._forget_worker_channel(worker_id)
            raise

    async def _forget_worker_channel(self, worker_id: WorkerId) -> None:
        """Drop a channel to a worker that went away, so a restarted worker is dialled afresh
        (instead of waiting out gRPC's reconnect backoff)."""
        entry = self._worker_stubs.pop(worker_id, None)
        if entry is not None:
            await entry[0].close()

    async def offload(self, hashes: Sequence[BlockHash], engine_blocks: Sequence[EngineBlockId] | Sequence[int],
                      parents: Sequence[BlockHash] | None = None) -> TransferHandle:
        """Store engine blocks under ``hashes``; entries already stored or not fitting are skipped."""
        if len(hashes) != len(engine_blocks):
            raise KvbmRequestError(f"{len(hashes)} hashes for {len(engine_blocks)} engine blocks")
        handle = await self.prepare_store(hashes, parents)
        self.start(handle, [engine_blocks[i] for i in handle.indices])
        return handle

    async def onboard(self, hashes: Sequence[BlockHash],
                      engine_blocks: Sequence[EngineBlockId] | Sequence[int]) -> TransferHandle:
        """Load the longest stored prefix of ``hashes`` into ``engine_blocks[:n]``."""
        if len(hashes) != len(engine_blocks):
            raise KvbmRequestError(f"{len(hashes)} hashes for {len(engine_blocks)} engine blocks")
        handle = await self.prepare_load(hashes)
        self.start(handle, list(engine_blocks[:handle.num_blocks]))
        return handle

    async def wait(self, handle: TransferHandle) -> TransferResult:
        """Wait for every worker's answer; raises a :class:`KvbmError` on any failure."""
        if handle.is_empty:
            return TransferResult(None, 0, 0, 0.0)
        results = await asyncio.gather(*handle.tasks, return_exceptions=True)
        answers: list[pb.TransferResponse] = []
        for r in results:
            if isinstance(r, grpc.RpcError):
                raise from_rpc_error(r, f"job {handle.job_id}") from None
            if isinstance(r, BaseException):
                raise KvbmUnavailableError(f"job {handle.job_id}: {r}") from r
            answers.append(r)
        return TransferResult(handle.job_id, handle.num_blocks, sum(r.bytes for r in answers),
                              max(r.seconds for r in answers))

    async def release(self, handle: TransferHandle) -> None:
        """Give back a prepared job that will not be started (unpins a load)."""
        if handle.is_empty or handle.tasks:
            return
        await self._leader_call("Release", pb.ReleaseRequest(job_id=handle.job_id))


class KvbmClient:
    """Synchronous facade: runs an :class:`AsyncKvbmClient` on a private event-loop thread."""

    def __init__(self, config: KvbmConfig | None = None, leader_address: str | None = None,
                 client_name: str = "kvbm-client", timeout: float = CONTROL_TIMEOUT) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvbm-client", daemon=True)
        self._thread.start()
        try:
            self.aio: AsyncKvbmClient = self._run(
                AsyncKvbmClient.connect(config, leader_address, client_name, timeout), timeout + 5)
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise KvbmTimeoutError(f"kvbm call did not finish within {timeout}s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.aio, name)
        if asyncio.iscoroutinefunction(attr):
            return lambda *a, **kw: self._run(attr(*a, **kw))
        return attr

    def start(self, handle: TransferHandle, engine_blocks: Sequence[EngineBlockId] | Sequence[int],
              worker_ids: Sequence[str] | None = None) -> None:
        async def _start() -> None:
            self.aio.start(handle, engine_blocks, worker_ids)
        self._run(_start())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.aio.close(), 10)
        finally:
            self._stop_loop()

    def __enter__(self) -> "KvbmClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
