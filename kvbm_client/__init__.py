"""kvbm_client: what every side shares (config, hashing, the gRPC contract) and the light
clients engines use (:class:`KvbmClient`, :class:`LeaderSession`, connectors). Never owns data."""
from .client import AsyncKvbmClient, KvbmClient
from .config import KvbmConfig
from .contract import MatchResult
from .errors import (KvbmConfigError, KvbmError, KvbmRequestError, KvbmTimeoutError, KvbmTransferError,
                     KvbmUnavailableError)
from .handles import TransferHandle, TransferResult
from .hashing import BlockIdentity, MultimodalSpan, RequestExtras, engine_hashes, salt_hash, sequence_hashes
from .ids import BlockHash, EngineBlockId, JobId, Tier, WorkerId
from .leader_session import LeaderSession
from .regions import RegionSpec, ShmKvBuffer

__all__ = ["AsyncKvbmClient", "KvbmClient", "LeaderSession", "MatchResult", "TransferHandle", "TransferResult",
           "KvbmConfig", "KvbmError", "KvbmConfigError", "KvbmRequestError", "KvbmTimeoutError", "KvbmTransferError",
           "KvbmUnavailableError", "BlockIdentity", "RequestExtras", "MultimodalSpan", "engine_hashes", "salt_hash",
           "sequence_hashes", "BlockHash", "EngineBlockId", "JobId", "WorkerId", "Tier", "RegionSpec", "ShmKvBuffer"]
