"""Several vLLM engines, one kvbm node (CPU build, eager, greedy, tiny local model).

Engine processes run at the same time, each registering its own KV cache (a sealed memfd)
with worker 0 of one node. Engine A computes round 0 and pauses; the other engines start
their workload only then (their KV caches are registered beside A's by that time). Same
model and salt: the second engine's very first request is served from A's blocks. Another
model (another path, hence another namespace) or another ``cache_salt``: nothing is shared.
Every engine's outputs equal the baseline run without kvbm.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import outputs, run_engine

pytestmark = pytest.mark.timeout(900)
ROUNDS = 2
USERS = 4  # engine_run.py's default


class Engine:
    """One engine_run.py process against the node; ``start_after``: it waits for its go file."""

    def __init__(self, vllm_python: Path, model: Path, out: Path, node, *args: str, start_after: bool = False,
                 pause_after_round_0: bool = False, multiprocess: bool = False) -> None:
        self.out = out
        self.dir = out.with_suffix(".ctl")
        self.dir.mkdir()
        extra = list(args)
        if start_after:
            extra += ["--start-after", str(self.dir / "go")]
        if pause_after_round_0:
            extra += ["--pause-after-rounds", "0", "--pause-dir", str(self.dir)]
        self.proc: subprocess.Popen = run_engine(vllm_python, model, out, "--kvbm", "--rounds", str(ROUNDS), *extra,
                                                 env=node.env, wait=False, multiprocess=multiprocess)

    def wait_file(self, name: str, timeout: float = 400) -> None:
        end = time.monotonic() + timeout
        while not (self.dir / name).exists():
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.monotonic() < end, f"timed out waiting for {name}"
            time.sleep(0.1)

    def touch(self, name: str) -> None:
        (self.dir / name).touch()

    def result(self) -> dict:
        assert self.proc.wait(400) == 0, self.log()[-4000:]
        return json.loads(self.out.read_text())

    def log(self) -> str:
        return self.out.with_suffix(".log").read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def engines():
    started: list[Engine] = []
    yield started
    for e in started:
        e.kill()


def wait_regions(node, n: int, engines: list[Engine], timeout: float = 400) -> list:
    end = time.monotonic() + timeout
    while len(regions := node.worker_status().regions) < n:
        for e in engines:
            assert e.proc.poll() is None, e.log()[-3000:]
        assert time.monotonic() < end, f"{len(regions)} of {n} engine regions registered"
        time.sleep(0.2)
    return list(regions)


def test_two_engines_share_one_cache(vllm_python, tiny_model, baseline, kvbm_node, tmp_path, engines):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    a = Engine(vllm_python, tiny_model, tmp_path / "a.json", node, pause_after_round_0=True)
    b = Engine(vllm_python, tiny_model, tmp_path / "b.json", node, start_after=True)
    engines += [a, b]
    a.wait_file("paused-0")  # A computed (and kvbm stored) round 0
    regions = wait_regions(node, 2, engines)
    assert len({r.pid for r in regions}) == 2 and len({r.digest for r in regions}) == 2
    stored = node.counters()["kvbm_offload_blocks_d2h"]
    assert stored > 0
    b.touch("go")
    result_b = b.result()
    a.touch("resume-0")
    result_a = a.result()
    assert outputs(result_a) == outputs(baseline)[:ROUNDS * USERS]
    assert outputs(result_b) == outputs(baseline)[:ROUNDS * USERS]
    first = result_b["records"][0]
    assert first["cached"] > 0, "engine B's first request got none of engine A's blocks"
    assert first["cached"] >= first["prompt_len"] - 32, "engine B recomputed most of a prompt A had computed"
    assert result_b["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert node.counters()["kvbm_onboard_blocks_h2d"] > 0


def test_other_models_and_salts_never_share(vllm_python, tiny_model, baseline, kvbm_node, tmp_path, engines):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    other_model = tmp_path / "tiny-llama-copy"  # the same weights under another name: another model to kvbm
    shutil.copytree(tiny_model, other_model)
    a = Engine(vllm_python, tiny_model, tmp_path / "a.json", node, pause_after_round_0=True)
    model_b = Engine(vllm_python, other_model, tmp_path / "model_b.json", node, start_after=True)
    salt_b = Engine(vllm_python, tiny_model, tmp_path / "salt_b.json", node, "--salts", "tenant-b",
                    start_after=True)
    engines += [a, model_b, salt_b]
    a.wait_file("paused-0")
    wait_regions(node, 3, engines)
    assert node.counters()["kvbm_offload_blocks_d2h"] > 0
    model_b.touch("go")
    salt_b.touch("go")
    results = {"model": model_b.result(), "salt": salt_b.result()}
    a.touch("resume-0")
    result_a = a.result()
    for what, result in results.items():
        assert result["records"][0]["cached"] == 0, f"an engine of another {what} was served engine A's blocks"
        assert outputs(result) == outputs(baseline)[:ROUNDS * USERS]
    assert outputs(result_a) == outputs(baseline)[:ROUNDS * USERS]
