"""The GPU worker's writes of an engine's signal words (``kvbm_worker/signals.py``).

A word is written once every copy issued before it on a copy stream has landed, without holding
that stream or the caller: on a stream of its own per copy stream, made to wait for an event of
the copy stream, a 4-byte DMA from a pinned word to its device copy, then one from there to the
word (the engine's page, CUDA-registered in this process).

Why this shape (each measured on an H200, 2026-11-26):
* not one host -> host copy: CUDA runs a copy between two host buffers synchronously, after every
  copy queued before it (``benchmarks/word_write_probe.py``: 19.4 ms behind a 1 GiB copy, against
  0.014 ms for the two copies);
* not on the copy stream: with the engine's GPU layer waits a layerwise load's copy took ~8 ms
  longer with its words on the copy stream (8K 27.7 against 19.8 ms, 20K 63.7 against 54.9; the
  piece after each later group's word landed up to 2 ms late); beside it, a late word delays only its
  wait, not the next group's bytes. Checked on an H100 (ninth session,
  ``benchmarks/wait_copy_interference.py``): beside an engine's wait kernel and matmuls a copy with
  its words on its stream took 1.45x as long as alone, with them beside it 1.05x.
* not a stream memory operation: they hang on some drivers (``benchmarks/stream_wait_probe.py``).

Invariant: the pinned and device words are a ring of :data:`WORDS` entries; a job waits for its
writes before it ends and writes far fewer than WORDS (``signals.MAX_TARGETS`` x groups +
catch-ups), so an entry is never rewritten while a write still reads it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..cuda_region import check, cudart

WORDS = 4096


class SignalWords:
    """The ring of words and the side streams of one copier (device ``device``); ``record(stream)``
    makes an event on a stream, ``wait(stream, event)`` makes a stream wait for one."""

    def __init__(self, device: int, record: Callable[[Any], Any], wait: Callable[[Any, Any], None]) -> None:
        import torch
        self.device, self._record, self._wait = device, record, wait
        self._host = torch.zeros(WORDS, dtype=torch.int64, pin_memory=True)
        self._dev = torch.zeros(WORDS, dtype=torch.int64, device=f"cuda:{device}")
        self._next = 0
        self._sides: dict[int, Any] = {}  # copy stream handle -> its word stream

    def write(self, stream: Any, address: int, value: int, after: Sequence[Any] = ()) -> Any:
        """``value`` (uint32) to ``address`` after every copy issued on ``stream`` so far and
        every event in ``after``; the event that marks it written."""
        import torch
        side = self._sides.get(stream.cuda_stream)
        if side is None:
            new: Any = torch.cuda.Stream  # (untyped constructor)
            side = self._sides[stream.cuda_stream] = new(device=self.device)
        self._wait(side, self._record(stream))
        for event in after:
            self._wait(side, event)
        i, self._next = self._next, (self._next + 1) % WORDS
        self._host[i] = value
        rt = cudart()
        default, on_device = rt.cudaMemcpyKind.cudaMemcpyDefault, self._dev.data_ptr() + 8 * i
        check(rt.cudaMemcpyAsync(on_device, self._host.data_ptr() + 8 * i, 4, default, side.cuda_stream),
              "cudaMemcpyAsync (signal word, to the GPU)")
        check(rt.cudaMemcpyAsync(address, on_device, 4, default, side.cuda_stream),
              "cudaMemcpyAsync (signal word, to the page)")
        return self._record(side)

    def synchronize(self) -> None:
        """Wait until every word written so far landed."""
        for side in self._sides.values():
            side.synchronize()
