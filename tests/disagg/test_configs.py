"""The README's disaggregated-serving lines are the ones the tests and the benchmark run.

Reads the section "Disaggregated serving with kvbm" of README.md and checks that every ``--kv-transfer-config``
there is valid JSON equal to :func:`harness.kv_transfer_config` of its role, and that both engine
lines carry :data:`harness.DISAGG_ENGINE_ARGS`.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

SECTION = "## Disaggregated serving with kvbm"


def section() -> str:
    text = (harness.REPO / "README.md").read_text()
    if SECTION not in text:
        pytest.fail(f"no '{SECTION}' section in README.md")
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def engine_lines(text: str) -> dict[str, str]:
    """The first ``vllm serve`` command after each "# prefill engine" / "# decode engine" comment."""
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    lines = {}
    for role in ("prefill", "decode"):
        part = block.split(f"# {role} engine", 1)[1]
        command = part.split("\n\n", 1)[0]
        lines[role] = command.replace("\\\n", " ")
    return lines


def test_readme_lines_are_the_harness_configs():
    lines = engine_lines(section())
    expected = {"prefill": harness.kv_transfer_config(harness.Role.PREFILL, kvbm=True),
                "decode": harness.kv_transfer_config(harness.Role.DECODE, kvbm=False)}
    for role, line in lines.items():
        found = re.findall(r"--kv-transfer-config '([^']+)'", line)
        assert len(found) == 1, line
        assert json.loads(found[0]) == expected[role], role
        for arg in harness.DISAGG_ENGINE_ARGS:
            assert arg in line.split(), f"the {role} line lacks {arg}"
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT=" in line
    ports = [re.search(r"VLLM_NIXL_SIDE_CHANNEL_PORT=(\d+)", line).group(1) for line in lines.values()]
    assert len(set(ports)) == 2, "two engines on one host need two side-channel ports"


def test_prefill_composes_nixl_first_then_kvbm():
    config = harness.kv_transfer_config(harness.Role.PREFILL, kvbm=True)
    children = config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "KvbmConnector"]
    assert config["kv_load_failure_policy"] == "recompute"  # the scheduler reads the outer config only
    assert all("kv_load_failure_policy" not in c for c in children)
