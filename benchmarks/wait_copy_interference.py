"""Does the engine's GPU side slow the daemon's host -> GPU copy? A load's copy, timed on the GPU,
alone and while another process (the engine: its own CUDA context) keeps the GPU busy.

    python3 benchmarks/wait_copy_interference.py [--reps 5] [--json out.json]

Why: with GPU layer waits (``gpu_layer_waits`` true) the daemon's copy of a layer-pipelined load
took ~8 ms longer than with the waits on the CPU, on 8K (27.7 against 19.8 ms) and 20K (63.7
against 54.9 ms) alike (H200, 2026-11-26 eighth session, after the signal-word writes were made
asynchronous); the later pieces of a load slowed, not the first ones. Two candidates: the wait
kernel, which reads its word in host memory over PCIe every ``poll_ns`` (2 us by default), and the
forward's kernels, which GPU waits let run as densely as the GPU allows beside the copy. The copy
here: ~1 GiB from a pinned pool into device memory in 384 KiB pieces (a 6-group load's pieces of
Qwen3-4B's 2.25 MiB blocks), issued with ``cudaMemcpyAsync`` before the timing starts, timed
with events on its stream. Conditions (the other process runs for the whole copy):

* ``alone``;
* ``wait_<ns>``: a wait kernel of ``kvbm_client.signal_page`` polling a word nobody writes, every
  ``<ns>`` ns (2000: the default; 20000; 200000);
* ``matmul``: bf16 8192^2 matmuls back to back (compute-bound, like the forward's GEMMs);
* ``stream``: a 4 GiB device-to-device copy kernel over and over (HBM-bound, like attention);
* ``wait_2000+matmul``: both (what the engine does with GPU waits).

And, alone and beside ``wait_2000+matmul``, the copy with a signal word written after each sixth
of it (the daemon's word writes: host -> GPU -> a CUDA-registered page, two 4-byte copies):
``words=stream`` on the copy stream itself (until 2026-11-26's eighth session), ``words=beside``
on a stream of its own that waits for the copy stream's event (``handlers/signal_words.py``'s
``SignalWords``, the daemon's own code).

Reports per condition the copy's GPU time (median over ``--reps``) and its ratio to ``alone``.
H100, 2026-11-26 ninth session (``results/wait_copy_interference_h100_2026-11-26m.json``): a wait
kernel polling every 2 us 1.03x, matmuls 1.05x, the HBM loop 1.50x; words on the copy stream beside
a wait and matmuls 1.45x, beside it 1.05x.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

PIECE, PIECES = 384 << 10, 2730  # ~1 GiB
CONDITIONS = ("alone", "wait_2000", "wait_20000", "wait_200000", "matmul", "stream", "wait_2000+matmul")


def engine(conn: Any) -> None:
    """The other process: on ("run", condition, seconds) keeps the GPU busy so for ``seconds``,
    answering "on" once its work is enqueued and "off" when it is done."""
    import torch

    from kvbm_client.signal_page import EngineSignals
    torch.cuda.set_device(0)
    pages: dict[int, EngineSignals] = {}
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
    other = torch.empty_like(big)
    waits, work = torch.cuda.Stream(), torch.cuda.Stream()
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        _, condition, seconds = msg
        signal = None
        if "wait_" in condition:
            ns = int(condition.split("wait_")[1].split("+")[0])
            if ns not in pages:
                pages[ns] = EngineSignals(poll_ns=ns)
                why = pages[ns].enable_gpu(0, lazy_loading=True)
                assert why is None, why
            signal = pages[ns].take(8)
            assert signal is not None
            pages[ns].wait(signal, 5, waits.cuda_stream, seconds)  # nobody writes: ends at its limit
        conn.send("on")
        t0 = time.perf_counter()
        with torch.cuda.stream(work):
            while time.perf_counter() - t0 < seconds:
                if "matmul" in condition:
                    for _ in range(4):
                        torch.mm(a, a)
                if condition == "stream":
                    other.copy_(big)
                work.synchronize()
                if "matmul" not in condition and condition != "stream":
                    time.sleep(0.01)
        torch.cuda.synchronize()
        if signal is not None:
            page = pages[int(condition.split("wait_")[1].split("+")[0])]
            page.release(signal)
            page.give_back(signal)
        conn.send("off")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import torch
    from gpu_bench import registered_page, write_result

    from kvbm_worker.cuda_region import check, cudart
    from kvbm_worker.handlers.signal_words import SignalWords
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child,), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    rt = cudart()
    src = torch.empty(PIECE * PIECES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(PIECE * PIECES, dtype=torch.uint8, device="cuda:0")
    order = torch.randperm(PIECES).tolist()  # scattered sources, as G2 slots are
    stream = torch.cuda.Stream()
    h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    page = contextlib.ExitStack()
    _, page_ptr = page.enter_context(registered_page())
    word_src = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    word_dev = torch.zeros(8, dtype=torch.int64, device="cuda:0")
    default = rt.cudaMemcpyKind.cudaMemcpyDefault

    def record(on: Any) -> Any:
        event = torch.cuda.Event()
        event.record(on)
        return event

    beside = SignalWords(0, record, lambda on, event: on.wait_event(event))  # the daemon's words

    def on_stream() -> None:  # the words before d547f23: the same two copies, on the copy stream
        check(rt.cudaMemcpyAsync(word_dev.data_ptr(), word_src.data_ptr(), 4, default, stream.cuda_stream), "word")
        check(rt.cudaMemcpyAsync(page_ptr, word_dev.data_ptr(), 4, default, stream.cuda_stream), "word")

    def copy_ms(words: str = "") -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # holds the stream while the pieces are issued (~25 ms)
            start.record(stream)
            for i, j in enumerate(order):
                check(rt.cudaMemcpyAsync(dst.data_ptr() + i * PIECE, src.data_ptr() + j * PIECE, PIECE, h2d,
                                         stream.cuda_stream), "cudaMemcpyAsync")
                if words and (i + 1) % (PIECES // 6) == 0:
                    if words == "stream":
                        on_stream()
                    else:
                        beside.write(stream, page_ptr, i)
            end.record(stream)
        end.synchronize()
        beside.synchronize()
        return start.elapsed_time(end)

    copy_ms()  # warm
    rows: list[dict[str, Any]] = []
    cases = [(c, "") for c in CONDITIONS]
    cases += [(c, w) for c in ("alone", "wait_2000+matmul") for w in ("stream", "beside")]
    for condition, words in cases:
        times = []
        for _ in range(args.reps):
            if condition != "alone":
                parent.send(("run", condition, 0.5))
                assert parent.recv() == "on"
                time.sleep(0.05)
            times.append(copy_ms(words))
            if condition != "alone":
                assert parent.recv() == "off"
        rows.append({"condition": condition, "words": words or "none",
                     "copy_ms_median": round(statistics.median(times), 2), "copy_ms": [round(t, 2) for t in times]})
        print(rows[-1], flush=True)
    base = rows[0]["copy_ms_median"]
    for row in rows:
        row["ratio_to_alone"] = round(row["copy_ms_median"] / base, 3)
    parent.send("stop")
    proc.join(30)
    page.close()
    write_result(args.json, args, rows)


if __name__ == "__main__":
    main()
