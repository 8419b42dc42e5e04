"""kvbm_client: what every side shares (config, hashing, the gRPC contract) and the light
clients engines use (:class:`KvbmClient`, connectors). Never owns data."""
from .client import AsyncKvbmClient, KvbmClient, MatchResult, TransferHandle, TransferResult
from .config import KvbmConfig
from .errors import (KvbmConfigError, KvbmError, KvbmRequestError, KvbmTimeoutError, KvbmTransferError,
                     KvbmUnavailableError)
from .hashing import engine_hashes, salt_hash, sequence_hashes
from .ids import BlockHash, Tier
from .regions import RegionSpec, ShmKvBuffer

__all__ = ["AsyncKvbmClient", "KvbmClient", "MatchResult", "TransferHandle", "TransferResult", "KvbmConfig",
           "KvbmError", "KvbmConfigError", "KvbmRequestError", "KvbmTimeoutError", "KvbmTransferError",
           "KvbmUnavailableError", "engine_hashes", "salt_hash", "sequence_hashes", "BlockHash", "Tier",
           "RegionSpec", "ShmKvBuffer"]
