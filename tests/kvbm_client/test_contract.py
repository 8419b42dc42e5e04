"""The gRPC contract: plan signing and the committed generated stubs."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from kvbm_client.contract import pb, plan_kind, plan_tiers, sign_plan, verify_plan
from kvbm_client.ids import PlanKind, Tier

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SECRET = b"leader-secret-0123456789abcdef"


def make_plan(**overrides) -> "pb.TransferPlan":
    fields = dict(job_id=42, kind=int(PlanKind.STORE), tiers=[int(Tier.HOST), int(Tier.DISK)], slots=[3, 7],
                  demote_host_slots=[1], demote_disk_slots=[9], deadline=1234.5, epoch=2, leader_id="leader-a")
    fields.update(overrides)
    return pb.TransferPlan(**fields)


def test_sign_then_verify_returns_the_same_plan() -> None:
    plan = make_plan()
    signed = sign_plan(plan, SECRET)

    got = verify_plan(signed, SECRET)

    assert got == plan
    assert plan_kind(got) is PlanKind.STORE
    assert plan_tiers(got) == [Tier.HOST, Tier.DISK]
    assert len(signed.signature) == 32  # HMAC-SHA256


def test_signing_is_deterministic_and_survives_the_wire() -> None:
    a, b = sign_plan(make_plan(), SECRET), sign_plan(make_plan(), SECRET)
    assert a.SerializeToString() == b.SerializeToString()
    wire = pb.SignedPlan.FromString(a.SerializeToString())
    assert verify_plan(wire, SECRET) == make_plan()


def test_different_plans_get_different_signatures() -> None:
    assert sign_plan(make_plan(), SECRET).signature != sign_plan(make_plan(job_id=43), SECRET).signature


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


@pytest.mark.parametrize("index", [0, 5, -1])
def test_tampered_plan_bytes_are_rejected(index: int) -> None:
    signed = sign_plan(make_plan(), SECRET)
    signed.plan = _flip(signed.plan, index % len(signed.plan))
    assert verify_plan(signed, SECRET) is None


def test_a_plan_reencoded_with_other_fields_is_rejected() -> None:
    signed = sign_plan(make_plan(), SECRET)
    signed.plan = make_plan(slots=[3, 8]).SerializeToString(deterministic=True)
    assert verify_plan(signed, SECRET) is None


@pytest.mark.parametrize("signature", [b"", b"\x00" * 32, "flip", "truncate"])
def test_tampered_signature_is_rejected(signature) -> None:
    signed = sign_plan(make_plan(), SECRET)
    if signature == "flip":
        signed.signature = _flip(signed.signature, 0)
    elif signature == "truncate":
        signed.signature = signed.signature[:-1]
    else:
        signed.signature = signature
    assert verify_plan(signed, SECRET) is None


@pytest.mark.parametrize("other", [b"", b"another-secret", SECRET + b"x", SECRET[:-1]])
def test_other_secret_is_rejected(other: bytes) -> None:
    assert verify_plan(sign_plan(make_plan(), SECRET), other) is None
    assert verify_plan(sign_plan(make_plan(), other), SECRET) is None


def test_generated_stubs_are_current() -> None:
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "current" in result.stdout
