"""What a driver run reports: per-request results (tokens in/out, where the prefix came from)
and run-wide counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestResult:
    """One request attempt.

    Attributes:
        device_matched_tokens: Prompt tokens reused from the device (G1) prefix cache.
        connector_matched_tokens: Prompt tokens the connector said it would load.
        load_async: The connector loaded them asynchronously (the request was parked).
        error: Set when TensorRT-LLM would have failed the request (a connector hook raised).
    """

    name: str
    request_id: int
    attempt: int
    prompt_len: int
    output_tokens: list[int] = field(default_factory=list)
    device_matched_tokens: int = 0
    connector_matched_tokens: int = 0
    load_async: bool = False
    error: Optional[str] = None


@dataclass
class DriverStats:
    """Counters of one run.

    Attributes:
        verified_positions: Held positions checked against recompute (summed over layers' passes).
        onboarded_blocks: Connector-loaded blocks that passed the byte check when first read.
        delayed_frees: Requests whose ``request_finished`` returned True.
    """

    iterations: int = 0
    forward_passes: int = 0
    verified_positions: int = 0
    onboarded_blocks: int = 0
    connector_matched_tokens: int = 0
    async_loads: int = 0
    delayed_frees: int = 0
    failed_attempts: int = 0
    device_reused_blocks: int = 0
    device_evicted_blocks: int = 0


@dataclass
class DriverReport:
    results: dict[str, RequestResult] = field(default_factory=dict)
    failed_attempts: list[RequestResult] = field(default_factory=list)
    stats: DriverStats = field(default_factory=DriverStats)

    def outputs(self) -> dict[str, list[int]]:
        """Output tokens of every request that succeeded, by name."""
        return {n: r.output_tokens for n, r in self.results.items() if r.error is None}
