"""Launch disaggregated (1P1D) and aggregated vLLM deployments, with and without kvbm.

Runs in the test or benchmark process; it owns the processes it starts (vLLM OpenAI servers, the
proxy, the kvbm node) and stops them, by pid, in reverse order. The same code serves the CPU
build (0.32, tiny float32 model, CI) and two GPUs (0.26, one engine per GPU): only
:class:`Platform` differs.

A deployment (:class:`System`) is one of:

* ``agg``: one engine, no connector (vLLM's own prefix caching only);
* ``agg_kvbm``: one engine with ``KvbmConnector`` (the README's aggregated line);
* ``pd``: a prefill engine and a decode engine with ``NixlConnector``, behind the proxy
  (``kvbm_client.tools.disagg_proxy``);
* ``pd_kvbm``: the same, the prefill engine composing ``MultiConnector(NixlConnector,
  KvbmConnector)`` and served by one kvbm node.

The ``--kv-transfer-config`` of each role is :func:`kv_transfer_config` (the README shows the
same JSON; ``tests/disagg/test_configs.py`` checks they agree).
"""
from __future__ import annotations

import enum
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KVBM_CONNECTOR = {"kv_connector": "KvbmConnector", "kv_connector_module_path": "kvbm_client.connectors.vllm",
                  "kv_role": "kv_both"}
SERVED_NAME = "model"
#: Extra engine flags both roles of a 1P1D pair need. NOTE: NixlConnector refuses a handshake
#: between engines whose "compatibility hash" differs, and the hash includes whether the hybrid
#: KV cache manager (HMA) is on; vLLM keeps it on for a MultiConnector only if every child
#: subclasses SupportsHMA. KvbmConnector does (tests/disagg/test_hma_agreement.py), so the
#: prefill and decode engines agree without flags.
DISAGG_ENGINE_ARGS: tuple[str, ...] = ()


class Role(enum.Enum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


def kv_transfer_config(role: Role, kvbm: bool, kvbm_extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one engine.

    NOTE: in a MultiConnector the scheduler reads ``kv_load_failure_policy`` from the outer config
    only, so ``recompute`` is set there. NixlConnector comes first: on a decode engine a remote
    prefill must win ``get_num_new_matched_tokens`` (the first child that reports tokens loads
    them); on a prefill engine NixlConnector reports none, so kvbm's hit is the one loaded.
    """
    kvbm_child = {**KVBM_CONNECTOR, **({"kv_connector_extra_config": kvbm_extra} if kvbm_extra else {})}
    if role is Role.AGGREGATED:
        return {**kvbm_child, "kv_load_failure_policy": "recompute"} if kvbm else None
    nixl_role = "kv_producer" if role is Role.PREFILL else "kv_consumer"
    nixl = {"kv_connector": "NixlConnector", "kv_role": nixl_role}
    if not kvbm:
        return {**nixl, "kv_load_failure_policy": "recompute"}
    return {"kv_connector": "MultiConnector", "kv_role": nixl_role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [nixl, kvbm_child]}}


@dataclass(frozen=True)
class System:
    """One deployment to measure: which engines, and which of them kvbm serves."""

    name: str
    disaggregated: bool
    kvbm: bool  # kvbm on the aggregated engine, or on the prefill engine of a 1P1D pair


SYSTEMS = {s.name: s for s in (System("agg", False, False), System("agg_kvbm", False, True),
                               System("pd", True, False), System("pd_kvbm", True, True))}


@dataclass(frozen=True)
class Platform:
    """What differs between the CPU build and the GPUs.

    ``devices``: CUDA device of the aggregated/prefill engine and of the decode engine (None: CPU).
    ``engine_args``: extra OpenAI-server arguments (dtype, G1 size, dummy weights, ...).
    ``python``: the interpreter with vLLM; ``extra_pythonpath``: prepended to PYTHONPATH (the
    repo, and NIXL installed beside the CPU venv).
    """

    python: str
    model: str
    block_size: int
    max_model_len: int
    engine_args: tuple[str, ...] = ()
    devices: tuple[int | None, int | None] = (None, None)
    extra_pythonpath: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 400.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Wait for ``url/health``; fail at once (with the log's tail) when the process exited."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{log.name}: no answer on {url} after {timeout_s:.0f}s:\n{_tail(log)}")


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@dataclass
class Server:
    """One HTTP server process we started (a vLLM OpenAI server or the proxy), in a process group
    of its own, so that a vLLM server's EngineCore and workers stop with it."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(30)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group is the server's own (start_new_session)
    except ProcessLookupError:
        pass


def engine_env(platform: Platform, base: dict[str, str], device: int | None, side_channel_port: int,
               omp_core: int) -> dict[str, str]:
    env = {**base, **platform.env, "PYTHONUNBUFFERED": "1",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
    env["PYTHONPATH"] = os.pathsep.join([*platform.extra_pythonpath, str(REPO), base.get("PYTHONPATH", "")]).strip(
        os.pathsep)
    if device is None:
        # NOTE: one OMP thread per engine, so every engine reduces in the same order (greedy outputs
        # compare bit for bit). NixlConnector re-pins its engine's worker to the last core of each
        # NUMA node on the CPU build (vLLM's nixl/base_worker.py), whatever this says.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(omp_core))
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    return env


def start_engine(platform: Platform, role: Role, kvbm: bool, base_env: dict[str, str], log_dir: Path,
                 kvbm_extra: dict[str, Any] | None = None) -> Server:
    """Start one OpenAI server for ``role`` (not waiting for it: see :func:`wait_http`)."""
    port = free_port()
    device = platform.devices[1 if role is Role.DECODE else 0]
    cmd = [platform.python, "-m", "vllm.entrypoints.openai.api_server", "--model", platform.model,
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--block-size", str(platform.block_size), "--max-model-len", str(platform.max_model_len),
           "--enable-prompt-tokens-details", "--seed", "0", *platform.engine_args]
    if role is not Role.AGGREGATED:
        cmd += list(DISAGG_ENGINE_ARGS)
    ktc = kv_transfer_config(role, kvbm, kvbm_extra)
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    env = engine_env(platform, base_env, device, free_port(), omp_core=1 if role is Role.DECODE else 0)
    name = f"{role.value}{'-kvbm' if kvbm else ''}"
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}", proc, log)


def start_proxy(platform: Platform, prefill: Server, decode: Server, log_dir: Path) -> Server:
    port = free_port()
    cmd = [platform.python, "-m", "kvbm_client.tools.disagg_proxy", "--port", str(port),
           "--prefill", prefill.url, "--decode", decode.url]
    env = {**os.environ, "DYN_LOG": "debug",  # one line per request: prefill and decode times
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
    log = log_dir / "proxy.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Server("proxy", f"http://127.0.0.1:{port}", proc, log)


class Deployment:
    """A running :class:`System`: its engines (and proxy); ``url`` is where clients send requests.

    ``kvbm_env``: the environment that reaches the kvbm node serving this deployment (the node
    itself is the caller's, e.g. a :class:`kvbm_client.local_node.LocalNode`); required when
    ``system.kvbm``. Use as a context manager; ``close()`` stops the proxy, then the engines.
    """

    def __init__(self, platform: Platform, system: System, log_dir: Path, kvbm_env: dict[str, str] | None = None,
                 kvbm_extra: dict[str, Any] | None = None) -> None:
        assert kvbm_env is not None or not system.kvbm, "a kvbm system needs its node's environment"
        self.platform, self.system, self.log_dir = platform, system, log_dir
        self._kvbm_env = kvbm_env
        self._kvbm_extra = kvbm_extra
        self.engines: dict[Role, Server] = {}
        self.proxy: Server | None = None
        self._stack = ExitStack()

    def __enter__(self) -> "Deployment":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        base = dict(self._kvbm_env or os.environ)
        plain = dict(os.environ)
        roles = [(Role.PREFILL, self.system.kvbm), (Role.DECODE, False)] if self.system.disaggregated \
            else [(Role.AGGREGATED, self.system.kvbm)]
        for role, kvbm in roles:  # started together: each takes a minute on a CPU
            engine = start_engine(self.platform, role, kvbm, base if kvbm else plain, self.log_dir, self._kvbm_extra)
            self.engines[role] = engine
            self._stack.callback(engine.stop)
        for engine in self.engines.values():
            wait_http(engine.url, engine.proc, self.platform.start_timeout_s, engine.log)
        if self.system.disaggregated:
            self.proxy = start_proxy(self.platform, self.engines[Role.PREFILL], self.engines[Role.DECODE],
                                     self.log_dir)
            self._stack.callback(self.proxy.stop, 10.0)
            wait_http(self.proxy.url, self.proxy.proc, 30.0, self.proxy.log)

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy is not None else self.engines[Role.AGGREGATED].url

    @property
    def caching_engine(self) -> Server:
        """The engine whose prompt tokens kvbm may serve (aggregated, or prefill)."""
        return self.engines.get(Role.PREFILL) or self.engines[Role.AGGREGATED]

    def close(self) -> None:
        self._stack.close()
