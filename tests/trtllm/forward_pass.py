"""One forward pass of the driver's model on every rank, with TensorRT-LLM's connector hooks.

TensorRT-LLM registers a forward pre-hook and a forward hook on every decoder layer: before a
layer's work is enqueued it calls ``worker.wait_for_layer_load(layer_idx, stream)``, after it
``worker.save_kv_layer(layer_idx, stream)``; after the model it calls ``wait_for_save(stream)``
(``_forward_step``). Here, per layer, every rank's pre-hook runs, then the layer is checked and
computed on every rank, then every rank's post-hook runs.

The check: right after ``wait_for_layer_load`` (the moment the layer would read them) every
position a scheduled request does not compute in this pass - device-reused, connector-loaded, or
computed by earlier passes - must hold exactly the model's bytes, on every rank. A mismatch
raises :class:`KvMismatchError` naming the request, layer, rank, position, block and source.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .kv_model import POISON, KvModel
from .paged_kv import PagedKvCache


class KvMismatchError(AssertionError):
    """A KV byte the model would not have written was found where a layer reads it."""


class ConnectorHookError(RuntimeError):
    """A connector hook raised inside the forward pass (TensorRT-LLM fails the active requests)."""


@dataclass
class PassItem:
    """One scheduled request in a pass.

    Attributes:
        name: For messages.
        block_table: The request's block ids.
        seeds: Model seeds of positions ``0 .. stop-1``.
        start: Positions before ``start`` already hold KV (checked); ``start .. stop-1`` are computed.
        stop: End of this pass's positions.
        device_matched: Positions reused from the device cache (for messages).
        onboarded_until: End of the positions the connector loaded (for messages).
    """

    name: str
    block_table: Sequence[int]
    seeds: np.ndarray
    start: int
    stop: int
    device_matched: int = 0
    onboarded_until: int = 0

    def source(self, position: int) -> str:
        if position < self.device_matched:
            return "device-reused"
        if position < self.onboarded_until:
            return "connector-loaded"
        return "computed by an earlier pass"


class ForwardPass:
    """Runs passes over the ranks' KV caches; owns nothing but references.

    Args:
        workers: One connector worker per rank, or None without a connector.
        stream: The stream handed to the hooks (None on the CPU).
        on_end_of_forward: Callables registered by ``register_forward_pass_callable``.
    """

    def __init__(self, model: KvModel, caches: Sequence[PagedKvCache], workers: Optional[Sequence],
                 stream, verify: bool = True, on_end_of_forward: Sequence[Callable] = ()) -> None:
        self.model, self.caches, self.workers = model, list(caches), workers
        self.stream, self.verify = stream, verify
        self.on_end_of_forward = list(on_end_of_forward)
        self.verified_positions = 0

    def run(self, items: Sequence[PassItem]) -> None:
        """Raises ConnectorHookError (a hook raised) or KvMismatchError (a wrong byte)."""
        for layer in range(self.model.geometry.num_layers):
            self._hooks("wait_for_layer_load", layer)
            if self.verify:
                self._check_layer(items, layer)
            for it in items:
                for rank, cache in enumerate(self.caches):
                    values = self.model.expected(it.seeds[it.start:it.stop], rank, layer)
                    cache.write(layer, it.block_table, it.start, it.stop, values)
            self._hooks("save_kv_layer", layer)
        for callback in self.on_end_of_forward:
            self._call(callback)
        self._hooks("wait_for_save", None)

    def sample(self, item: PassItem) -> int:
        """The next token after positions ``0 .. item.stop-1``, read from the pool."""
        return self.model.next_token([cache.checksum(item.block_table, item.stop) for cache in self.caches])

    def _hooks(self, name: str, layer: Optional[int]) -> None:
        for worker in self.workers or ():
            args = (self.stream,) if layer is None else (layer, self.stream)
            self._call(getattr(worker, name), *args)

    @staticmethod
    def _call(fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - TensorRT-LLM catches everything the forward raises
            raise ConnectorHookError(f"{getattr(fn, '__qualname__', fn)} raised {exc!r}") from exc

    def _check_layer(self, items: Sequence[PassItem], layer: int) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        for it in items:
            if it.start == 0:
                continue
            for rank, cache in enumerate(self.caches):
                actual = cache.read(it.block_table, 0, it.start, layer).cpu()
                expected = self.model.expected(it.seeds[:it.start], rank, layer)
                if not torch.equal(actual, expected):
                    self._report(it, rank, layer, actual, expected)
            self.verified_positions += it.start

    def _report(self, it: PassItem, rank: int, layer: int, actual, expected) -> None:
        bad = (actual != expected).reshape(actual.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        pos = bad[0]
        block = it.block_table[pos // self.model.geometry.tokens_per_block]
        poisoned = bool((actual[pos] == POISON).all())
        raise KvMismatchError(
            f"request {it.name}: layer {layer} rank {rank}: {len(bad)} of {it.start} held positions differ "
            f"from recompute; first at position {pos} (block {block}, {it.source(pos)})"
            + (", which holds poison (never written)" if poisoned else ""))
