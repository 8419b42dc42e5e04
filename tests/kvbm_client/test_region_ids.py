"""How an engine's scheduler side learns its worker side's region ids (``connectors/core/region_ids.py``):
a private file per engine, believed only when its writer is the reader or a descendant."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from kvbm_client.connectors.core.region_ids import EngineRegionIds


@pytest.fixture
def socket_dir(tmp_path):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    return str(d)


def test_the_worker_side_publishes_and_the_scheduler_side_reads(socket_dir):
    ids = EngineRegionIds(socket_dir, "engine-1")
    assert ids.lookup("0") is None
    ids.publish("0", "region-aa")
    ids.publish("1", "region-bb")
    assert ids.lookup("0") == "region-aa" and ids.lookup("1") == "region-bb"
    ids.publish("0", "region-cc")  # re-registered
    assert ids.lookup("0") == "region-cc"
    assert EngineRegionIds(socket_dir, "engine-2").lookup("0") is None, "another engine read our record"
    for path in (ids.root, ids.directory):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(os.path.join(ids.directory, f)).st_mode) == 0o600
               for f in os.listdir(ids.directory))
    ids.withdraw("0")
    ids.withdraw("1")
    assert ids.lookup("0") is None and not os.path.exists(ids.directory)


def test_a_worker_process_started_by_the_scheduler_is_believed(socket_dir):
    code = (f"import sys; from kvbm_client.connectors.core.region_ids import EngineRegionIds; "
            f"EngineRegionIds({socket_dir!r}, 'e').publish('0', 'region-child'); print(flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"\n", "the child did not publish"
        assert EngineRegionIds(socket_dir, "e").lookup("0") == "region-child"
    finally:
        child.stdin.close()
        child.wait(10)
    assert EngineRegionIds(socket_dir, "e").lookup("0") is None, "a dead process's record was believed"


def test_records_of_other_processes_and_open_files_are_ignored(socket_dir):
    ids = EngineRegionIds(socket_dir, "e")
    ids.publish("0", "region-mine")
    mine = os.listdir(ids.directory)[0]
    # Another engine given the same engine_id (its pid is not in our process tree: pid 1).
    foreign = os.path.join(ids.directory, mine.replace(f"-{os.getpid()}-", "-1-"))
    with open(foreign, "w") as f:
        json.dump({"worker_id": "0", "region_id": "region-foreign"}, f)
    os.chmod(foreign, 0o600)
    os.utime(foreign, (2e9, 2e9))  # newest: it would win if it were believed
    assert ids.lookup("0") == "region-mine"
    os.chmod(os.path.join(ids.directory, mine), 0o644)  # readable by others: not ours to trust
    assert ids.lookup("0") is None
