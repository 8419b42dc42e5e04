"""The leader's presence filter (``kvbm_leader.presence``) and its clients' read-only view
(``kvbm_client.presence``): never "no" for a block the leader holds; gone blocks cleared by
rebuilds; a view maps only the announcing leader's file."""
from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from kvbm_client.presence import HEADER_BYTES, MIN_SLOTS, PresenceView, check_slots
from kvbm_leader import presence as presence_mod
from kvbm_leader.events import KvEventFeed, NullEvents
from kvbm_leader.presence import PresenceFilter, file_prefix, filter_path, remove_stale_files
from kvbm_leader.registry import BlockRegistry
from kvbm_client.ids import BlockHash, JobId, Tier

LEADER = "leader-0123456789ab"


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


@pytest.fixture
def pf(tmp_path):
    f = PresenceFilter(str(tmp_path / "p.bits"), MIN_SLOTS, LEADER)
    yield f
    f.close()


def test_added_blocks_are_seen_by_a_reader_and_others_mostly_not(pf):
    view = PresenceView.open(pf.path, MIN_SLOTS, LEADER)
    assert view is not None
    held = [key(i) for i in range(500)]
    pf.add(held)
    assert all(view.may_hold(k) for k in held), "never 'no' for a held block"
    false = sum(view.may_hold(key(i)) for i in range(10_000, 20_000))
    assert false < 300, f"{false} false 'maybe' of 10000 (expected ~2 % at 500 keys in 65536 slots)"
    short = BlockHash(b"\x01\x02\x03")  # a key shorter than 16 bytes is hashed first
    pf.add([short])
    assert view.may_hold(short)
    view.close()


def test_gone_blocks_are_cleared_by_a_rebuild_in_slices_and_the_live_ones_stay_set_throughout(pf, monkeypatch):
    monkeypatch.setattr(presence_mod, "REBUILD_SLICE", 100)
    monkeypatch.setattr(presence_mod, "MIN_STALE", 10)
    monkeypatch.setattr(presence_mod, "FILL_TO_REBUILD", 0.01)  # 700 keys' 1400 probes fill 2 % of 65536 slots
    view = PresenceView.open(pf.path, MIN_SLOTS, LEADER)
    live = {key(i): None for i in range(300)}
    gone = [key(i) for i in range(1000, 1400)]
    pf.add(list(live))
    pf.add(gone)
    assert all(view.may_hold(k) for k in gone)
    pf.gone(len(gone))
    pf.step(live)  # starts: 400 stale >= max(10, 300 // 4), 1400 probes >= 1 % of the bits; first slice
    added_meanwhile = [key(i) for i in range(5000, 5010)]
    pf.add(added_meanwhile)
    steps = 1
    while pf.rebuilds == 0:
        assert all(view.may_hold(k) for k in live), "a live block reads set during the rebuild"
        pf.step(live)
        steps += 1
    assert steps == 3, "300 blocks in slices of 100"
    assert all(view.may_hold(k) for k in live) and all(view.may_hold(k) for k in added_meanwhile)
    assert sum(view.may_hold(k) for k in gone) < 20, "the gone blocks' slots are cleared"
    pf.step(live)
    assert pf.rebuilds == 1, "no rebuild without stale blocks"
    pf.gone(400)
    pf.step(live)
    assert pf.rebuilds == 1 and pf._snapshot is None, "nor while the slots are emptier than FILL_TO_REBUILD"
    view.close()


def test_clear_zeroes_the_slots(pf):
    pf.add([key(i) for i in range(100)])
    pf.clear()
    view = PresenceView.open(pf.path, MIN_SLOTS, LEADER)
    assert not any(view.may_hold(key(i)) for i in range(100))
    view.close()


def test_a_view_maps_only_the_announced_leaders_file_of_the_announced_size(pf, tmp_path):
    assert PresenceView.open(pf.path, MIN_SLOTS, "leader-other") is None, "another leader's filter"
    assert PresenceView.open(pf.path, MIN_SLOTS * 2, LEADER) is None, "another size"
    assert PresenceView.open(str(tmp_path / "missing.bits"), MIN_SLOTS, LEADER) is None
    assert PresenceView.open("", MIN_SLOTS, LEADER) is None
    link = tmp_path / "link.bits"
    link.symlink_to(pf.path)
    assert PresenceView.open(str(link), MIN_SLOTS, LEADER) is None, "a symlink is not followed"
    forged = tmp_path / "forged.bits"
    forged.write_bytes(b"\0" * (HEADER_BYTES + MIN_SLOTS))
    assert PresenceView.open(str(forged), MIN_SLOTS, LEADER) is None, "no header: not a filter"
    assert os.stat(pf.path).st_mode & 0o777 == 0o600


def test_the_file_goes_with_close_and_stale_ones_with_the_next_leader(tmp_path):
    mine, other = file_prefix(str(tmp_path / "sock-a")), file_prefix(str(tmp_path / "sock-b"))
    assert mine != other and mine == file_prefix(str(tmp_path / "sock-a"))
    f = PresenceFilter(str(tmp_path / f"{mine}1-{LEADER}.bits"), MIN_SLOTS, LEADER)
    with pytest.raises(FileExistsError):
        PresenceFilter(f.path, MIN_SLOTS, LEADER)
    path = f.path
    f.close()
    f.close()
    assert not os.path.exists(path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [PresenceFilter(str(tmp_path / name), MIN_SLOTS, LEADER) for name in (
        f"{mine}{os.getpid()}-leader-crashed.bits",   # this socket dir's earlier leader
        f"{other}{dead.pid}-leader-killed.bits",     # another socket dir's, its process gone
        f"{other}{os.getpid()}-leader-running.bits")]  # another socket dir's, still running
    (tmp_path / "other.sock").touch()
    remove_stale_files(str(tmp_path), mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{other}{os.getpid()}-leader-running.bits",
                                                                  "other.sock"])
    for f in left:
        f.close()


def test_filters_live_in_a_private_directory_in_memory(tmp_path):
    directory, path = filter_path(str(tmp_path), LEADER)
    assert directory == f"/dev/shm/kvbm-{os.geteuid()}" and os.path.dirname(path) == directory
    assert os.path.basename(path) == f"{file_prefix(str(tmp_path))}{os.getpid()}-{LEADER}.bits"


@pytest.mark.parametrize("slots", [0, MIN_SLOTS - 1, MIN_SLOTS + 1, 3 << 20, 1 << 31])
def test_slots_must_be_a_power_of_two_in_range(slots):
    with pytest.raises(ValueError, match="power of two"):
        check_slots(slots)


def test_the_feed_adds_planned_blocks_counts_forgotten_ones_and_clears(pf):
    reg = BlockRegistry({Tier.HOST: 8})
    feed = KvEventFeed(NullEvents(), pf)
    view = PresenceView.open(pf.path, MIN_SLOTS, LEADER)
    a, b = key(1), key(2)
    feed.planned([a, b])
    assert view.may_hold(a) and view.may_hold(b)
    slot = reg.pools[Tier.HOST].allocator.allocate()
    assert slot is not None
    reg.add_copy_key(a, None, Tier.HOST, slot, JobId(1))
    reg.drop_copy_key(a, Tier.HOST)  # rolled back: forgotten
    feed.flush(reg)
    assert pf.stale == 1
    feed.restored([(key(3), None)])
    assert view.may_hold(key(3))
    feed.cleared()
    assert not view.may_hold(b) and not view.may_hold(key(3)) and pf.stale == 0


def test_rebuilds_advance_on_the_leaders_tick_not_on_a_requests_flush(pf, monkeypatch):
    monkeypatch.setattr(presence_mod, "MIN_STALE", 1)
    monkeypatch.setattr(presence_mod, "FILL_TO_REBUILD", 0.001)
    view = PresenceView.open(pf.path, MIN_SLOTS, LEADER)
    reg = BlockRegistry({Tier.HOST: 8})
    feed = KvEventFeed(NullEvents(), pf)
    gone = [key(i) for i in range(50)]
    feed.planned(gone)
    pf.gone(len(gone))  # (forgotten, as a flush reports them)
    feed.flush(reg)
    assert pf.rebuilds == 0 and all(view.may_hold(k) for k in gone), "a request's flush rebuilds nothing"
    feed.tick(reg)
    assert pf.rebuilds == 1 and sum(view.may_hold(k) for k in gone) == 0


@pytest.mark.parametrize("lengths", [(16,), (8,), (3, 8, 16, 20, 9)])
def test_the_leaders_vectorized_words_are_the_clients_words(lengths):
    from kvbm_client.presence import words
    from kvbm_leader.presence import key_words
    keys = [BlockHash(os.urandom(lengths[i % len(lengths)])) for i in range(64)]
    assert [int(w) for w in key_words(keys)] == [w for k in keys for w in words(k)]
