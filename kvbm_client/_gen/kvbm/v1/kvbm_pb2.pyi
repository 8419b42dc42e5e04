from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class PlanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_KIND_UNSPECIFIED: _ClassVar[PlanKind]
    PLAN_KIND_STORE: _ClassVar[PlanKind]
    PLAN_KIND_LOAD: _ClassVar[PlanKind]
    PLAN_KIND_DEMOTE: _ClassVar[PlanKind]
    PLAN_KIND_PROMOTE: _ClassVar[PlanKind]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
PLAN_KIND_UNSPECIFIED: PlanKind
PLAN_KIND_STORE: PlanKind
PLAN_KIND_LOAD: PlanKind
PLAN_KIND_DEMOTE: PlanKind
PLAN_KIND_PROMOTE: PlanKind

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "page_bytes", "dtype", "num_engine_blocks", "rank")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    page_bytes: int
    dtype: str
    num_engine_blocks: int
    rank: int
    def __init__(self, num_layers: _Optional[int] = ..., page_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., num_engine_blocks: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class RegionBuffer(_message.Message):
    __slots__ = ("shm_path", "cuda_ipc_handle", "fd_index", "size_bytes", "device", "offset_bytes")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    cuda_ipc_handle: bytes
    fd_index: int
    size_bytes: int
    device: int
    offset_bytes: int
    def __init__(self, shm_path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., fd_index: _Optional[int] = ..., size_bytes: _Optional[int] = ..., device: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class LayerPlacement(_message.Message):
    __slots__ = ("buffer_index", "offset_bytes", "block_stride_bytes")
    BUFFER_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    buffer_index: int
    offset_bytes: int
    block_stride_bytes: int
    def __init__(self, buffer_index: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ...) -> None: ...

class TransferPlan(_message.Message):
    __slots__ = ("job_id", "kind", "tiers", "slots", "demote_host_slots", "demote_disk_slots", "promote_host_slots", "promote_disk_slots", "deadline", "epoch", "leader_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_DISK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_DISK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    kind: PlanKind
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    slots: _containers.RepeatedScalarFieldContainer[int]
    demote_host_slots: _containers.RepeatedScalarFieldContainer[int]
    demote_disk_slots: _containers.RepeatedScalarFieldContainer[int]
    promote_host_slots: _containers.RepeatedScalarFieldContainer[int]
    promote_disk_slots: _containers.RepeatedScalarFieldContainer[int]
    deadline: float
    epoch: int
    leader_id: str
    def __init__(self, job_id: _Optional[int] = ..., kind: _Optional[_Union[PlanKind, str]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., slots: _Optional[_Iterable[int]] = ..., demote_host_slots: _Optional[_Iterable[int]] = ..., demote_disk_slots: _Optional[_Iterable[int]] = ..., promote_host_slots: _Optional[_Iterable[int]] = ..., promote_disk_slots: _Optional[_Iterable[int]] = ..., deadline: _Optional[float] = ..., epoch: _Optional[int] = ..., leader_id: _Optional[str] = ...) -> None: ...

class SignedPlan(_message.Message):
    __slots__ = ("plan", "signature")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    plan: bytes
    signature: bytes
    def __init__(self, plan: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "ttl_ms")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    ttl_ms: int
    def __init__(self, client_name: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "rank", "endpoint", "state", "layout", "host_bytes", "disk_bytes", "alloc_progress", "error", "stage_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOC_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    endpoint: str
    state: str
    layout: KvLayout
    host_bytes: int
    disk_bytes: int
    alloc_progress: float
    error: str
    stage_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., state: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., host_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., alloc_progress: _Optional[float] = ..., error: _Optional[str] = ..., stage_bytes: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "leader_id", "workers", "max_hashes", "ttl_ms", "presence_path", "presence_slots")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PATH_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    leader_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    max_hashes: int
    ttl_ms: int
    presence_path: str
    presence_slots: int
    def __init__(self, session_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., max_hashes: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., presence_path: _Optional[str] = ..., presence_slots: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "count_hit", "tokens_per_block")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COUNT_HIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    count_hit: bool
    tokens_per_block: int
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., count_hit: _Optional[bool] = ..., tokens_per_block: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("num_matched", "tiers")
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_matched: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, num_matched: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "parent_hashes", "unasked_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    UNASKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    unasked_blocks: int
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., parent_hashes: _Optional[_Iterable[bytes]] = ..., unasked_blocks: _Optional[int] = ...) -> None: ...

class PrepareStoreResponse(_message.Message):
    __slots__ = ("plan", "indices", "skipped_present", "skipped_full")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FULL_FIELD_NUMBER: _ClassVar[int]
    plan: SignedPlan
    indices: _containers.RepeatedScalarFieldContainer[int]
    skipped_present: int
    skipped_full: int
    def __init__(self, plan: _Optional[_Union[SignedPlan, _Mapping]] = ..., indices: _Optional[_Iterable[int]] = ..., skipped_present: _Optional[int] = ..., skipped_full: _Optional[int] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "count_hit", "tokens_per_block", "prefill_tokens_per_s", "unasked_blocks", "stage")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COUNT_HIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UNASKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    count_hit: bool
    tokens_per_block: int
    prefill_tokens_per_s: float
    unasked_blocks: int
    stage: LoadStage
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., count_hit: _Optional[bool] = ..., tokens_per_block: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., unasked_blocks: _Optional[int] = ..., stage: _Optional[_Union[LoadStage, _Mapping]] = ...) -> None: ...

class LoadStage(_message.Message):
    __slots__ = ("layer_groups", "targets")
    LAYER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    layer_groups: int
    targets: _containers.RepeatedCompositeFieldContainer[StageTarget]
    def __init__(self, layer_groups: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[StageTarget, _Mapping]]] = ...) -> None: ...

class StageTarget(_message.Message):
    __slots__ = ("worker_id", "region_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    region_id: str
    def __init__(self, worker_id: _Optional[str] = ..., region_id: _Optional[str] = ...) -> None: ...

class PrepareLoadResponse(_message.Message):
    __slots__ = ("plan", "num_planned", "num_skipped")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANNED_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    plan: SignedPlan
    num_planned: int
    num_skipped: int
    def __init__(self, plan: _Optional[_Union[SignedPlan, _Mapping]] = ..., num_planned: _Optional[int] = ..., num_skipped: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "job_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: int
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_id", "rank", "endpoint", "pid", "cuda")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    endpoint: str
    pid: int
    cuda: bool
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., pid: _Optional[int] = ..., cuda: _Optional[bool] = ...) -> None: ...

class PoolPlan(_message.Message):
    __slots__ = ("epoch", "host_slots", "disk_slots")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DISK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    host_slots: int
    disk_slots: int
    def __init__(self, epoch: _Optional[int] = ..., host_slots: _Optional[int] = ..., disk_slots: _Optional[int] = ...) -> None: ...

class LeaderEvent(_message.Message):
    __slots__ = ("welcome", "pools", "shutdown", "stage")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    pools: PoolPlan
    shutdown: Shutdown
    stage: TransferRequest
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., pools: _Optional[_Union[PoolPlan, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., stage: _Optional[_Union[TransferRequest, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("leader_id", "secret", "job_timeout_s")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    secret: bytes
    job_timeout_s: float
    def __init__(self, leader_id: _Optional[str] = ..., secret: _Optional[bytes] = ..., job_timeout_s: _Optional[float] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SetLayoutRequest(_message.Message):
    __slots__ = ("worker_id", "layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    layout: KvLayout
    def __init__(self, worker_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class SetLayoutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolsReadyRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "ok", "error", "disk_index")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DISK_INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    ok: bool
    error: str
    disk_index: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., disk_index: _Optional[str] = ...) -> None: ...

class PoolsReadyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("worker_id", "job_id", "ok", "error", "bytes", "seconds", "bad_disk_slots", "bad_host_slots")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BAD_DISK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BAD_HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    job_id: int
    ok: bool
    error: str
    bytes: int
    seconds: float
    bad_disk_slots: _containers.RepeatedScalarFieldContainer[int]
    bad_host_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., job_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., bad_disk_slots: _Optional[_Iterable[int]] = ..., bad_host_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class StartTransferRequest(_message.Message):
    __slots__ = ("worker_id", "job_id", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    job_id: int
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., job_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StartTransferResponse(_message.Message):
    __slots__ = ("deadline",)
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    deadline: float
    def __init__(self, deadline: _Optional[float] = ...) -> None: ...

class CompleteTransferResponse(_message.Message):
    __slots__ = ("committed", "accepted")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    accepted: bool
    def __init__(self, committed: _Optional[bool] = ..., accepted: _Optional[bool] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "capacity_blocks", "used_blocks", "pinned_blocks", "hit_rate")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    hit_rate: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("leader_id", "state", "tiers", "workers", "sessions", "pending_jobs", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_JOBS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    state: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    sessions: int
    pending_jobs: int
    counters: _containers.ScalarMap[str, float]
    def __init__(self, leader_id: _Optional[str] = ..., state: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., sessions: _Optional[int] = ..., pending_jobs: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("engine_id", "pid", "buffers", "layers", "page_bytes", "num_blocks", "dtype", "signals")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pid: int
    buffers: _containers.RepeatedCompositeFieldContainer[RegionBuffer]
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    page_bytes: int
    num_blocks: int
    dtype: str
    signals: RegionBuffer
    def __init__(self, engine_id: _Optional[str] = ..., pid: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[RegionBuffer, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., signals: _Optional[_Union[RegionBuffer, _Mapping]] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class RegionSocketReply(_message.Message):
    __slots__ = ("region_id", "code", "message")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    code: int
    message: str
    def __init__(self, region_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("region_id", "plan", "engine_blocks", "sent_at", "layer_groups", "signal_slot", "signal_base", "stage")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_SLOT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_BASE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    plan: SignedPlan
    engine_blocks: _containers.RepeatedScalarFieldContainer[int]
    sent_at: float
    layer_groups: int
    signal_slot: int
    signal_base: int
    stage: bool
    def __init__(self, region_id: _Optional[str] = ..., plan: _Optional[_Union[SignedPlan, _Mapping]] = ..., engine_blocks: _Optional[_Iterable[int]] = ..., sent_at: _Optional[float] = ..., layer_groups: _Optional[int] = ..., signal_slot: _Optional[int] = ..., signal_base: _Optional[int] = ..., stage: _Optional[bool] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("pages_landed", "pages_per_block", "done")
    PAGES_LANDED_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    pages_landed: int
    pages_per_block: int
    done: TransferResponse
    def __init__(self, pages_landed: _Optional[int] = ..., pages_per_block: _Optional[int] = ..., done: _Optional[_Union[TransferResponse, _Mapping]] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("job_id", "bytes", "seconds", "joined", "waited_seconds", "transit_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    bytes: int
    seconds: float
    joined: bool
    waited_seconds: float
    transit_seconds: float
    def __init__(self, job_id: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., joined: _Optional[bool] = ..., waited_seconds: _Optional[float] = ..., transit_seconds: _Optional[float] = ...) -> None: ...

class CommandRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: SignedPlan
    def __init__(self, plan: _Optional[_Union[SignedPlan, _Mapping]] = ...) -> None: ...

class CommandResponse(_message.Message):
    __slots__ = ("ok", "error", "worker_id", "job_id", "signature")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    worker_id: str
    job_id: int
    signature: bytes
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., worker_id: _Optional[str] = ..., job_id: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegionSummary(_message.Message):
    __slots__ = ("digest", "pid", "engine_id", "num_blocks")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    pid: int
    engine_id: str
    num_blocks: int
    def __init__(self, digest: _Optional[str] = ..., pid: _Optional[int] = ..., engine_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class WorkerStatusResponse(_message.Message):
    __slots__ = ("info", "region_id", "disk_path", "disk_backend", "counters", "region_digest", "region_socket", "region_pid", "regions")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    DISK_PATH_FIELD_NUMBER: _ClassVar[int]
    DISK_BACKEND_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    REGION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REGION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    REGION_PID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    region_id: str
    disk_path: str
    disk_backend: str
    counters: _containers.ScalarMap[str, float]
    region_digest: str
    region_socket: str
    region_pid: int
    regions: _containers.RepeatedCompositeFieldContainer[RegionSummary]
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., region_id: _Optional[str] = ..., disk_path: _Optional[str] = ..., disk_backend: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ..., region_digest: _Optional[str] = ..., region_socket: _Optional[str] = ..., region_pid: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[RegionSummary, _Mapping]]] = ...) -> None: ...
