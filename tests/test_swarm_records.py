"""Swarm layer without the network: identity files, device profile, record schema and DHT validators."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from fusionnode.errors import ConfigError, ProtocolError
from fusionnode.swarm.identity import load_or_create_identity, peer_id_from_public_key
from fusionnode.swarm.profile import DeviceProfile, load_or_measure_profile, measure_profile
from fusionnode.swarm.records import (
    MAX_LINKS,
    MAX_RECORD_TTL,
    PEERS_KEY,
    PEERS_KEY_ID,
    ExpirationCapValidator,
    LinkMeasurement,
    PeerRecord,
    make_validators,
    verify_entry,
)

torch.set_num_threads(1)
SER = DHTProtocol.serializer

PROFILE = DeviceProfile(
    kind="cpu",
    name="test cpu",
    memory_total_bytes=16 << 30,
    memory_free_bytes=8 << 30,
    tflops_fp32=0.1,
    tflops_bf16=0.2,
    tflops_fp16=None,
    torch_version=torch.__version__,
    cpu_count=2,
    measured_at=1.0e9,
)


@pytest.fixture(scope="module")
def alice(tmp_path_factory):
    return load_or_create_identity(tmp_path_factory.mktemp("alice"))


@pytest.fixture(scope="module")
def mallory(tmp_path_factory):
    return load_or_create_identity(tmp_path_factory.mktemp("mallory"))


def make_record(peer_id: str, **changes) -> PeerRecord:
    rec = PeerRecord(
        peer_id=peer_id,
        maddrs=("/ip4/127.0.0.1/tcp/4000/p2p/" + peer_id,),
        software_version="0.1.0",
        protocol_version=1,
        device=PROFILE,
        roles=("worker",),
        capacity_bytes=4 << 30,
        links={peer_id: LinkMeasurement(bandwidth_bps=1e8, rtt_s=0.02, measured_at=1.0e9)},
        availability="available",
        next_window=None,
        jobs=("job-1",),
        updated_at=get_dht_time(),
    )
    return dataclasses.replace(rec, **changes)


def signed_record(
    signer, owner_tag: bytes, value, expiration: float | None = None
) -> tuple[DHTRecord, object]:
    """Sign like DHTNode.store does (validators of the signer), return (record as sent, signer's validator)."""
    validator = CompositeValidator(make_validators(signer.private_key))
    exp = get_dht_time() + 10 if expiration is None else expiration
    record = DHTRecord(PEERS_KEY_ID, SER.dumps(owner_tag), SER.dumps(value), exp)
    return dataclasses.replace(record, value=validator.sign_value(record)), validator


def honest_validator(identity) -> CompositeValidator:
    return CompositeValidator(make_validators(identity.private_key))


# ---- identity ----


def test_identity_persists_and_key_file_is_private(tmp_path):
    first = load_or_create_identity(tmp_path)
    assert (first.p2p_key_path.stat().st_mode & 0o777) == 0o600
    again = load_or_create_identity(tmp_path)
    assert again.peer_id == first.peer_id
    # the same peer id libp2p derives from the key file (hivemind's own derivation)
    assert PeerID.from_identity(first.p2p_key_path.read_bytes()) == first.peer_id
    assert peer_id_from_public_key(first.public_key) == first.peer_id
    assert first.peer_id.to_base58().startswith("Qm")  # RSA key -> sha2-256 multihash peer id


def test_identity_refuses_world_readable_or_garbage_key(tmp_path):
    ident = load_or_create_identity(tmp_path / "a")
    os.chmod(ident.p2p_key_path, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_or_create_identity(tmp_path / "a")
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / ident.p2p_key_path.name).write_bytes(b"\x08\x01\x12\x03abc")
    os.chmod(bad / ident.p2p_key_path.name, 0o600)
    with pytest.raises(ConfigError):
        load_or_create_identity(bad)


def test_identity_accepts_hivemind_0400_file(tmp_path):
    ident = load_or_create_identity(tmp_path)
    os.chmod(ident.p2p_key_path, 0o400)  # what hivemind's own generate_identity writes
    assert load_or_create_identity(tmp_path).peer_id == ident.peer_id


# ---- profile ----


def test_profile_measured_with_sane_values():
    p = measure_profile(duration_s=0.05)
    assert p.kind in ("cpu", "cuda", "mps")
    assert 0 < p.tflops_fp32 < 1e4
    assert p.tflops_bf16 is None or 0 < p.tflops_bf16 < 1e4
    assert 0 < p.memory_free_bytes <= p.memory_total_bytes
    assert p.cpu_count >= 1 and p.torch_version == torch.__version__


def test_profile_cached_until_stale(tmp_path):
    first = load_or_measure_profile(tmp_path, duration_s=0.05)
    assert (tmp_path / "device_profile.json").exists()
    cached = load_or_measure_profile(tmp_path, duration_s=0.05)
    assert cached.measured_at == first.measured_at and cached.tflops_fp32 == first.tflops_fp32
    fresh = load_or_measure_profile(tmp_path, duration_s=0.05, force=True)
    assert fresh.measured_at > first.measured_at
    (tmp_path / "device_profile.json").write_text("{not json")
    recovered = load_or_measure_profile(tmp_path, duration_s=0.05)
    assert recovered.measured_at > fresh.measured_at


# ---- record round trip and schema ----


def test_record_round_trip(alice):
    rec = make_record(alice.peer_id.to_base58())
    assert PeerRecord.from_wire(SER.loads(SER.dumps(rec.to_wire()))) == rec
    assert verify_entry(alice.owner_tag, rec.to_wire()) == rec


def _mutations(pid: str):
    def set_(path, v):
        def f(w):
            node = w
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = v

        return f

    b58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    link = {"bandwidth_bps": 1.0, "rtt_s": 0.1, "measured_at": 1.0}
    many_links = {pid[:-2] + b58[i // 58] + b58[i % 58]: dict(link) for i in range(MAX_LINKS + 1)}
    return {
        "negative memory": set_(["device", "memory_free_bytes"], -1),
        "bandwidth over 1e13": set_(["links", pid, "bandwidth_bps"], 2e13),
        "nan tflops": set_(["device", "tflops_fp32"], float("nan")),
        "int where float": set_(["updated_at"], 5),
        "float where int": set_(["capacity_bytes"], 5.0),
        "unknown top field": set_(["extra"], 1),
        "unknown device field": set_(["device", "watts"], 300.0),
        "unknown role": set_(["roles"], ["worker", "admin"]),
        "bad availability": set_(["availability"], "maybe"),
        "too many links": set_(["links"], many_links),
        "long name": set_(["device", "name"], "x" * 1000),
        "missing field": lambda w: w.pop("jobs"),
        "bad peer id": set_(["peer_id"], "not a peer id!"),
    }


@pytest.mark.parametrize("case", list(_mutations("QmPngUG3f5WH1TqvdP4CXjcNa7QyASuk5ZCYWtYpS683tf")))
def test_schema_rejects_bad_records_at_read_and_dht_level(alice, case):
    pid = alice.peer_id.to_base58()
    wire = make_record(pid).to_wire()
    _mutations(pid)[case](wire)
    with pytest.raises(ProtocolError):
        verify_entry(alice.owner_tag, wire)
    record, _ = signed_record(alice, alice.owner_tag, wire)
    assert not honest_validator(alice).validate(record)


def test_link_count_limit_is_exact(alice):
    pid = alice.peer_id.to_base58()
    wire = make_record(pid).to_wire()
    _mutations(pid)["too many links"](wire)
    wire["links"].popitem()  # exactly MAX_LINKS is fine
    assert len(verify_entry(alice.owner_tag, wire).links) == MAX_LINKS


def test_valid_record_passes_dht_validators(alice, mallory):
    record, _ = signed_record(alice, alice.owner_tag, make_record(alice.peer_id.to_base58()).to_wire())
    assert honest_validator(mallory).validate(record)  # any honest node accepts it


# ---- forgery ----


def test_forged_record_for_another_peer_id_is_rejected(alice, mallory):
    """Mallory signs correctly with her own key but claims Alice's peer id."""
    wire = make_record(alice.peer_id.to_base58()).to_wire()
    record, _ = signed_record(mallory, mallory.owner_tag, wire)
    assert not honest_validator(alice).validate(record)
    with pytest.raises(ProtocolError, match="claims peer id"):
        verify_entry(mallory.owner_tag, wire)


def test_record_under_someone_elses_owner_key_is_rejected(alice, mallory):
    """Mallory writes into Alice's subkey: she cannot produce Alice's signature."""
    wire = make_record(alice.peer_id.to_base58()).to_wire()
    validator = CompositeValidator(make_validators(mallory.private_key))
    raw = DHTRecord(PEERS_KEY_ID, SER.dumps(alice.owner_tag), SER.dumps(wire), get_dht_time() + 10)
    assert validator.sign_value(raw) == raw.value  # hivemind signs only records owned by the local key
    fake_sig = RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", mallory.private_key.sign(b"x"))
    for value in (raw.value, raw.value + fake_sig):
        assert not honest_validator(alice).validate(dataclasses.replace(raw, value=value))


def test_unowned_subkey_rejected(alice):
    wire = make_record(alice.peer_id.to_base58()).to_wire()
    raw = DHTRecord(PEERS_KEY_ID, SER.dumps(b"anyone"), SER.dumps(wire), get_dht_time() + 10)
    assert not honest_validator(alice).validate(raw)
    with pytest.raises(ProtocolError):
        verify_entry(b"anyone", wire)


# ---- expiration cap ----


def test_expiration_too_far_ahead_rejected(alice):
    wire = make_record(alice.peer_id.to_base58()).to_wire()
    ok, _ = signed_record(alice, alice.owner_tag, wire, expiration=get_dht_time() + MAX_RECORD_TTL)
    assert honest_validator(alice).validate(ok)
    far, _ = signed_record(alice, alice.owner_tag, wire, expiration=get_dht_time() + MAX_RECORD_TTL + 3600)
    assert not honest_validator(alice).validate(far)


def test_expiration_cap_scope():
    cap = ExpirationCapValidator(60.0, keys=(PEERS_KEY,), skew=0.0)
    other = DHTID.generate(source="someone_elses_key").to_bytes()
    later = get_dht_time() + 3600
    assert cap.validate(DHTRecord(other, b"", b"", later))
    assert not cap.validate(DHTRecord(PEERS_KEY_ID, b"", b"", later))
    everything = ExpirationCapValidator(60.0, keys=None, skew=0.0)
    assert not everything.validate(DHTRecord(other, b"", b"", later))
