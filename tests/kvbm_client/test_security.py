"""The node's credentials as pure logic: key files, derived keys, the access policy, signed
acknowledgements, socket directories checked the way ssh-agent checks them."""
from __future__ import annotations

import os

import grpc
import pytest

from kvbm_client.contract import pb
from kvbm_client.endpoints import check_socket_dir, ensure_socket_dir
from kvbm_client.errors import KvbmConfigError
from kvbm_client.security import (DAEMON_TOKEN_HEADER, AccessPolicy, NodeKey, ack_is_authentic, create_node_key,
                                  load_client_tokens, load_node_key, sign_ack)

KEY = NodeKey(b"k" * 32)


def test_node_key_is_created_private_and_loaded_again(tmp_path):
    path = str(tmp_path / "sock" / "node.key")
    key = create_node_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert create_node_key(path) == key == load_node_key(path)  # a second leader start reuses it
    assert "redacted" in repr(key) and key.secret.hex() not in repr(key)


def test_a_node_key_others_can_read_is_refused(tmp_path):
    path = str(tmp_path / "node.key")
    create_node_key(path)
    os.chmod(path, 0o640)
    with pytest.raises(KvbmConfigError, match="chmod 600"):
        load_node_key(path)


def test_derived_keys_differ_per_purpose_and_per_leader():
    assert KEY.plan_key("leader-a") != KEY.plan_key("leader-b")
    assert KEY.plan_key("leader-a") == NodeKey(b"k" * 32).plan_key("leader-a")
    assert len({KEY.daemon_token, KEY.ack_key.hex(), KEY.plan_key("x").hex()}) == 3
    assert NodeKey(b"j" * 32).daemon_token != KEY.daemon_token


def test_access_policy_daemon_methods_need_the_daemon_token():
    policy = AccessPolicy(KEY)
    attach = "/kvbm.v1.Leader/Attach"
    assert policy.check(attach, {}).code is grpc.StatusCode.UNAUTHENTICATED
    assert policy.check(attach, {DAEMON_TOKEN_HEADER: "0" * 64}).code is grpc.StatusCode.PERMISSION_DENIED
    assert policy.check(attach, {DAEMON_TOKEN_HEADER: KEY.daemon_token}).allowed
    for method in ("/kvbm.v1.Leader/CompleteTransfer", "/kvbm.v1.Leader/SetLayout", "/kvbm.v1.Leader/PoolsReady",
                   "/kvbm.v1.Leader/StartTransfer", "/kvbm.v1.Worker/Command"):
        assert not policy.check(method, {}).allowed, method
    # Client methods on a unix socket need no token.
    assert policy.check("/kvbm.v1.Leader/PrepareLoad", {}).allowed


def test_access_policy_client_tokens_on_tcp():
    policy = AccessPolicy(KEY, ("tenant-a", "tenant-b"))
    method = "/kvbm.v1.Leader/PrepareStore"
    assert policy.check(method, {}).code is grpc.StatusCode.UNAUTHENTICATED
    assert not policy.check(method, {"authorization": "Bearer tenant-c"}).allowed
    assert not policy.check(method, {"authorization": "tenant-a"}).allowed  # no scheme
    assert policy.check(method, {"authorization": "Bearer tenant-b"}).allowed
    assert policy.check(method, {DAEMON_TOKEN_HEADER: KEY.daemon_token}).allowed


def test_command_acknowledgements_verify_only_for_their_worker_and_job():
    sig = sign_ack(KEY, "0", 7, True, "")
    good = pb.CommandResponse(ok=True, worker_id="0", job_id=7, signature=sig)
    assert ack_is_authentic(KEY, good, "0", 7)
    assert not ack_is_authentic(KEY, good, "1", 7)  # another worker's job
    assert not ack_is_authentic(KEY, good, "0", 8)  # a replay for another job
    forged = pb.CommandResponse(ok=True, worker_id="0", job_id=7, signature=b"\0" * 32)
    assert not ack_is_authentic(KEY, forged, "0", 7)
    flipped = pb.CommandResponse(ok=False, worker_id="0", job_id=7, signature=sig)
    assert not ack_is_authentic(KEY, flipped, "0", 7)
    assert not ack_is_authentic(NodeKey(b"z" * 32), good, "0", 7)


def test_client_token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# tenants\n\nalpha\n beta \n")
    assert load_client_tokens(str(path)) == ("alpha", "beta")
    path.write_text("# nothing\n")
    with pytest.raises(KvbmConfigError, match="holds no token"):
        load_client_tokens(str(path))
    assert load_client_tokens(None) == ()


def test_socket_dir_checked_like_ssh_agent(tmp_path):
    good = tmp_path / "good"
    ensure_socket_dir(str(good))
    assert good.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with pytest.raises(KvbmConfigError, match="mode 777"):
        ensure_socket_dir(str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(KvbmConfigError, match="symlink"):
        check_socket_dir(str(link))
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)  # nobody's (the tests run as root)
    with pytest.raises(KvbmConfigError, match="belongs to uid 65534"):
        check_socket_dir(str(other))
