"""Faults the harness injects into the kvbm node while the engine serves the workload.

Runs in the harness (kvbm venv). A timed fault strikes ``delay_s`` after the engine marked
the start of wave ``wave`` (``wave-K.start`` in the marker directory) and lasts
``duration_s``: SIGSTOP then SIGCONT of the worker, or kill -9 of a daemon then its restart
(as ``kvbm serve`` would restart it). ``kill-mid-load`` strikes instead ``delay_s`` after the
worker's first layer-grouped load began holding back its later groups (the fault wrapper's
``KVBM_FAULT_GROUP_DELAY_SECS``, each group after the first ``spec`` seconds late, logged when a
group is held): the worker dies with that load's later layers not landed, every time. Disk,
stall and fail faults are no events: the worker runs with the test suite's fault wrapper
(``tests/support/faults``) for the whole pass.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from .node import Daemon, StressNode

#: what the fault wrapper logs when a layer-grouped load holds back a group (tests/support/faults)
GROUP_HELD = "group delay:"


class FaultKind(str, Enum):
    SIGSTOP = "sigstop"  # worker SIGSTOP for duration_s, then SIGCONT
    KILL_WORKER = "kill-worker"  # worker kill -9, restarted after duration_s
    #: worker kill -9 while a layer-grouped load holds back its later groups (spec: seconds each
    #: is held, KVBM_FAULT_GROUP_DELAY_SECS), restarted after duration_s
    KILL_MID_LOAD = "kill-mid-load"
    KILL_LEADER = "kill-leader"  # leader kill -9, restarted after duration_s
    DISK_EIO = "disk-eio"  # every K-th G3 read/write returns EIO (spec: K, KVBM_FAULT_DISK_EIO_EVERY)
    STALL = "stall"  # chosen copies sleep on their lane (spec: KVBM_FAULT_STALL)
    FAIL = "fail"  # chosen copies fail (spec: KVBM_FAULT_FAIL)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    wave: int = 1
    delay_s: float = 1.0
    duration_s: float = 2.0
    spec: str = ""

    @property
    def timed(self) -> bool:
        return self.kind in (FaultKind.SIGSTOP, FaultKind.KILL_WORKER, FaultKind.KILL_LEADER,
                             FaultKind.KILL_MID_LOAD)

    def worker_faults(self) -> tuple[tuple[str, str], ...]:
        """``(NAME, value)`` of the fault wrapper's ``KVBM_FAULT_<NAME>`` (tests/support/faults)."""
        if self.kind is FaultKind.DISK_EIO:
            return (("DISK_EIO_EVERY", self.spec),)
        if self.kind is FaultKind.STALL:
            return (("STALL", self.spec),)
        if self.kind is FaultKind.FAIL:
            return (("FAIL", self.spec),)
        if self.kind is FaultKind.KILL_MID_LOAD:
            return (("GROUP_DELAY_SECS", self.spec),)
        return ()

    def describe(self) -> dict:
        return {"kind": self.kind.value, "wave": self.wave, "delay_s": self.delay_s, "duration_s": self.duration_s,
                "spec": self.spec}


@dataclass
class FaultInjector:
    """Strikes the timed faults of one pass from a thread, and restarts a daemon that exited
    as ``kvbm serve`` would (after 0.4 s; a killed one after the fault's ``duration_s``: the
    connector may kill a worker that does not answer a load). Every wait is bounded by
    ``alive`` (the engine still runs) and :meth:`stop`."""

    node: StressNode
    faults: list[Fault]
    marker_dir: Path
    alive: "callable"  # -> bool: the engine still runs
    events: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    restart_after_s: float = 0.4
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fault-injector", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 120.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """Strike nothing more (a stopped worker still gets its SIGCONT), then join."""
        self._stop.set()
        self.join()

    def _event(self, what: str) -> None:
        self.events.append({"t": time.time(), "what": what})

    def _run(self) -> None:
        pending = [f for f in self.faults if f.timed]
        due: dict[Fault, float] = {}  # fault -> when it strikes (its wave has started)
        resume: list[tuple[float, object]] = []  # (when, process) to SIGCONT
        down_until: dict[Daemon, float] = {}  # a daemon not to restart before then
        try:
            while not self._stop.is_set() and (self.alive() or resume):
                now = time.monotonic()
                for fault in [f for f in pending if f not in due]:
                    if self._armed(fault):
                        due[fault] = now + fault.delay_s
                for fault in [f for f in pending if due.get(f, float("inf")) <= now]:
                    pending.remove(fault)
                    self._strike(fault, now, resume, down_until)
                for when, proc in [r for r in resume if r[0] <= now]:
                    resume.remove((when, proc))
                    proc.send_signal(signal.SIGCONT)  # a no-op on a process that exited meanwhile
                    self._event("worker SIGCONT")
                self._supervise(now, down_until)
                self._stop.wait(0.05)
            if pending:
                self.errors.append(f"engine ended before {[f.kind.value for f in pending]} struck")
        except Exception as exc:  # reported in the pass result, never lost in a thread
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            for _, proc in resume:
                proc.send_signal(signal.SIGCONT)

    def _armed(self, fault: Fault) -> bool:
        """Whether ``fault``'s clock runs: its wave started, or (kill-mid-load) a load is
        holding back a layer group (the wrapper logged it)."""
        if fault.kind is FaultKind.KILL_MID_LOAD:
            return any(GROUP_HELD in line for line in self.node.injected_faults())
        return (self.marker_dir / f"wave-{fault.wave}.start").exists()

    def _strike(self, fault: Fault, now: float, resume: list, down_until: dict) -> None:
        node = self.node
        if fault.kind is FaultKind.SIGSTOP:
            proc = node.process(Daemon.WORKER)
            proc.send_signal(signal.SIGSTOP)
            resume.append((now + fault.duration_s, proc))
            self._event("worker SIGSTOP")
            return
        what = Daemon.LEADER if fault.kind is FaultKind.KILL_LEADER else Daemon.WORKER
        down_until[what] = now + fault.duration_s
        node.kill(what)
        self._event(f"{what.value} kill -9" + (" while a load held back a layer group"
                                               if fault.kind is FaultKind.KILL_MID_LOAD else ""))

    def _supervise(self, now: float, down_until: dict) -> None:
        """Start a daemon that exited again, as ``kvbm serve`` would."""
        for what in Daemon:
            if not self.node.process(what).exited:
                continue
            if what not in down_until:
                down_until[what] = now + self.restart_after_s
                self._event(f"{what.value} exited ({self.node.process(what).returncode})")
            elif now >= down_until[what]:
                del down_until[what]
                self.node.restart(what)
                self._event(f"{what.value} restarted")
