"""Watch a running leader daemon from outside: is it slow to answer because its event loop is
busy, or because the OS does not run it?

Every ``--period`` seconds a prober thread sends ``Status`` over one channel (timeout 30 s) and
records its latency; a sampler thread records, per thread of the leader (``/proc/PID/task``),
the CPU time it ran (``schedstat`` field 1) and the time it waited on a run queue while runnable
(``schedstat`` field 2), with its state, plus the machine's load and CPU pressure. A Status
outstanding for more than ``--dump-after`` seconds triggers ``py-spy dump`` of the leader (once
per slow call). Output: one JSON line per probe / sample / dump in ``--out``.

    python benchmarks/leader_watch.py --address unix:/.../leader.sock --pid PID --out W.jsonl

``--pid 0`` finds (waits for) the ``-m kvbm_leader`` process whose DYN_KVBM_SOCKET_DIR is the address's directory.
Diagnosis only: reads /proc, calls Status; needs py-spy on PATH for dumps (optional).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def find_leader(sock_dir: str) -> int | None:
    """The leader process whose environment names ``sock_dir`` (its DYN_KVBM_SOCKET_DIR)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvbm_leader" in cmd and b"-m" in cmd:
            try:
                if f"DYN_KVBM_SOCKET_DIR={sock_dir}".encode() in (p / "environ").read_bytes().split(b"\0"):
                    return int(p.name)
            except OSError:
                continue
    return None


def threads(pid: int) -> dict[str, dict]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (t / "comm").read_text().strip()
            run_ns, wait_ns, slices = (int(x) for x in (t / "schedstat").read_text().split())
            stat = (t / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            out[t.name] = {"comm": comm, "state": fields[0], "run_ms": run_ns / 1e6, "wait_ms": wait_ns / 1e6,
                           "slices": slices, "nice": int(fields[16]), "cpu": int(fields[36])}
        except (OSError, ValueError):
            continue
    return out


def machine() -> dict:
    load = Path("/proc/loadavg").read_text().split()
    psi = Path("/proc/pressure/cpu").read_text().split("\n")[0].split()
    stat = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {"load1": float(load[0]), "runnable": load[3], "cpu_some_total_us": int(psi[4].split("=")[1]),
            "ticks": dict(zip(names, stat))}


def processes() -> dict[str, list]:
    """Every process: [comm, utime+stime ticks, nice, policy, rt priority, threads]."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[p.name] = [stat[stat.index("(") + 1:stat.rindex(")")], int(f[11]) + int(f[12]), int(f[16]), int(f[38]),
                       int(f[37]), int(f[17])]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--pid", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--period", type=float, default=0.1)
    ap.add_argument("--dump-after", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=3600.0)
    args = ap.parse_args()
    from kvbm_client.channels import open_channel
    from kvbm_client.config import KvbmConfig
    from kvbm_client.contract import pb, rpc
    pid = args.pid
    while not pid:
        pid = find_leader(os.path.dirname(args.address.removeprefix("unix:"))) or 0
        time.sleep(0.2)
    out = open(args.out, "a", buffering=1)
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()

    def emit(kind: str, **kw: object) -> None:
        with lock:
            out.write(json.dumps({"kind": kind, "t": round(time.monotonic() - t0, 3), "wall": time.time(), **kw}) + "\n")

    outstanding: dict[str, float | None] = {"since": None}
    pyspy = shutil.which("py-spy") or str(Path(__import__("sys").executable).parent / "py-spy")

    def prober() -> None:
        while not os.path.exists(args.address.removeprefix("unix:")) and not stop.is_set():
            time.sleep(0.2)
        with open_channel(args.address, KvbmConfig.from_env()) as channel:
            stub = rpc.LeaderStub(channel)
            while not stop.is_set():
                start = time.monotonic()
                outstanding["since"] = start
                err = None
                try:
                    stub.Status(pb.StatusRequest(), timeout=30.0)
                except Exception as exc:  # noqa: BLE001 - recorded
                    err = type(exc).__name__ + ": " + str(getattr(exc, "code", lambda: "")())
                outstanding["since"] = None
                emit("probe", start=round(start - t0, 3), ms=round((time.monotonic() - start) * 1e3, 2), err=err)
                if err and not os.path.exists(f"/proc/{pid}"):
                    stop.set()
                time.sleep(args.period)

    def sampler() -> None:
        dumped_for = None
        while not stop.is_set():
            if not os.path.exists(f"/proc/{pid}"):
                stop.set()
                break
            n_samples = getattr(sampler, "n", 0)
            sampler.n = n_samples + 1  # type: ignore[attr-defined]
            emit("sample", m=machine(), th=threads(pid), **({"procs": processes()} if n_samples % 5 == 0 else {}))
            since = outstanding["since"]
            if since is not None and time.monotonic() - since > args.dump_after and dumped_for != since \
                    and os.path.exists(pyspy):
                dumped_for = since
                r = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
                emit("dump", probe_start=round(since - t0, 3), text=r.stdout + r.stderr)
                top = subprocess.run(["top", "-H", "-b", "-n", "2", "-d", "0.5", "-w", "180"], capture_output=True,
                                     text=True, timeout=30).stdout
                emit("top", probe_start=round(since - t0, 3), text=top[top.rindex("top - "):][:6000])
                ps = subprocess.run(["ps", "-eLo", "pid,tid,cls,rtprio,ni,pri,stat,psr,comm"], capture_output=True,
                                    text=True, timeout=30).stdout
                emit("ps", probe_start=round(since - t0, 3),
                     text="\n".join(l for l in ps.splitlines() if " TS " not in l or " 0 " not in l.split("TS")[1][:8]))
            time.sleep(args.period)

    ths = [threading.Thread(target=prober, daemon=True), threading.Thread(target=sampler, daemon=True)]
    for th in ths:
        th.start()
    stop.wait(args.duration)
    stop.set()
    for th in ths:
        th.join(35)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
