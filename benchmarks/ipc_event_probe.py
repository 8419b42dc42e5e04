"""Can the engine's stream wait for the worker daemon's copies on a CUDA IPC event, without a
kernel of ours, and what happens to that wait when the daemon dies before its event fires?

    python3 benchmarks/ipc_event_probe.py [--sleep-s 2] [--hang-s 15] [--json out.json]

A child process ("the daemon") creates an interprocess event and exports it; on request it
enqueues ``--sleep-s`` of GPU work on its own stream (``torch.cuda._sleep``, standing in for a
group's copies) and records the event behind it, then says "recorded". This process ("the
engine") opens the event, and only after "recorded" enqueues on its own stream a wait on the
event and a marker event behind it (``cudaStreamWaitEvent``: the GPU waits, the CPU goes on).

Cases: ``alive`` (the child lives: when does the marker fire, against the child's own record?),
``killed`` (SIGKILL to the child right after "recorded": does the marker fire, and when, or is
the stream stuck for ``--hang-s``?). Why: GPU-side layer waits without the signal page's wait
kernel must never leave the engine's stream waiting forever on a dead daemon.

Measured 2026-11-26 (eighth session, H200, commit d8a6074, ``results/ipc_event_probe_h200_2026-11-26k.json``):
alive: the marker fired 1.919 s after the wait was enqueued, with the child's own record; killed:
the marker never fired within ``--hang-s`` (15 s) while another stream of the engine kept
working: a stream waiting on a dead process's IPC event stays stuck, so the layer waits keep the
wait kernel (which gives up at its limit).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from provenance import provenance


def daemon(conn: Any, sleep_s: float) -> None:
    torch.cuda.set_device(0)
    event = torch.cuda.Event(interprocess=True)
    stream = torch.cuda.Stream()
    conn.send(bytes(event.ipc_handle()))
    cycles = int(sleep_s * 1.9e9)  # (~the SM clock of an H100 / H200; the row reports the real time)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            event.record(stream)
        conn.send(time.monotonic())
        stream.synchronize()
        conn.send(time.monotonic())


def one(case: str, sleep_s: float, hang_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=daemon, args=(child, sleep_s), daemon=True)
    proc.start()
    handle = parent.recv()
    event = torch.cuda.Event.from_ipc_handle(0, handle)
    stream = torch.cuda.Stream()
    parent.send("go")
    recorded = parent.recv()
    with torch.cuda.stream(stream):
        stream.wait_event(event)
        marker = torch.cuda.Event()
        marker.record(stream)
    enqueued = time.monotonic()
    row: dict[str, Any] = {"case": case, "sleep_s": sleep_s, "enqueue_ms": round((enqueued - recorded) * 1e3, 2)}
    if case == "killed":
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        row["child_exit"] = proc.exitcode
    fired = None
    while time.monotonic() - enqueued < hang_s:
        if marker.query():
            fired = time.monotonic()
            break
        time.sleep(0.001)
    row["marker_fired_s"] = round(fired - enqueued, 4) if fired is not None else None
    if case == "alive":
        done = parent.recv()
        row["child_done_s"] = round(done - enqueued, 4)
        parent.send("stop")
        proc.join(10)
    row["stuck"] = fired is None
    try:  # after a stuck wait, other streams of this process must still work
        probe = torch.ones(4, device="cuda").sum().item()
        row["other_stream_ok"] = probe == 4.0
    except RuntimeError as exc:
        row["other_stream_ok"] = f"error: {exc}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sleep-s", type=float, default=2.0)
    ap.add_argument("--hang-s", type=float, default=15.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rows = []
    for case in ("alive", "killed"):
        row = one(case, args.sleep_s, args.hang_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"provenance": provenance(), "args": vars(args) | {"json": str(args.json)},
                                         "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
    os._exit(0)  # (a stream still waiting on a dead process's event must not hold the exit)
