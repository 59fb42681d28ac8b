"""The peer record every member advertises in the DHT: its data type, its schema and its validators.

Spec: protocol/RECORDS.md. One DHT dictionary key (PEERS_KEY) holds one entry per peer; the subkey is
the owner's ``[owner:<ssh-rsa public key>]`` tag, so only that key's holder can write the entry
(hivemind RSASignatureValidator), and the public key hashes to the peer id the entry claims
(PeerBindingValidator). Entries are msgpack maps checked by a strict pydantic schema
(SchemaValidator) and may not expire further ahead than a cap (ExpirationCapValidator).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from fusionnode.errors import ProtocolError
from fusionnode.swarm.identity import peer_id_from_public_key
from fusionnode.swarm.profile import DeviceProfile
from fusionnode.wire.frames import PROTOCOL_MAJOR

logger = logging.getLogger(__name__)

RECORD_KEY_PREFIX = "fusionnode_v1"  # SchemaValidator prefix: DHT key = f"{prefix}_{field}"
PEERS_FIELD = "peers"
PEERS_KEY = f"{RECORD_KEY_PREFIX}_{PEERS_FIELD}"  # the DHT key of the membership dictionary
PEERS_KEY_ID = DHTID.generate(source=PEERS_KEY).to_bytes()

WIRE_PROTOCOL_MAJOR = PROTOCOL_MAJOR  # the protocol_version a peer advertises: the wire major it speaks

MAX_RECORD_TTL = 300.0  # seconds: a peer record may not expire further ahead than this
MAX_ANY_TTL = 7 * 86400.0  # seconds: cap for every other key in the DHT
CLOCK_SKEW_ALLOWANCE = 10.0  # seconds of clock difference tolerated on top of a TTL cap

MAX_MADDRS = 16  # multiaddrs in one record
MAX_MADDR_LEN = 256  # characters in one multiaddr
MAX_LINKS = 64  # link measurements in one record
MAX_JOBS = 16  # job ids in one record
MAX_JOB_ID_LEN = 64  # characters
MAX_NAME_LEN = 128  # characters of a device name
MAX_VERSION_LEN = 64  # characters of a version string
MAX_WINDOW_LEN = 64  # characters of next_window
MAX_PEER_ID_LEN = 128  # characters of a base58 peer id
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: above any single device
MAX_TFLOPS = 1e5  # TFLOP/s: above any single device
MAX_BANDWIDTH_BPS = 1e13  # bits per second (10 Tbit/s)
MAX_RTT = 600.0  # seconds
MAX_CPU_COUNT = 1 << 16
MAX_PROTOCOL_VERSION = 1 << 16

ROLES = ("worker", "optimizer")
AVAILABILITIES = ("available", "paused", "leaving")
DEVICE_KINDS = ("cuda", "mps", "cpu")

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
PEER_ID_REGEX = f"^[{_B58}]{{10,{MAX_PEER_ID_LEN}}}$"


@dataclass(frozen=True)
class LinkMeasurement:
    """This peer -> that peer: throughput of a bulk stream and round-trip time of a small message."""

    bandwidth_bps: float  # bits per second
    rtt_s: float  # seconds
    measured_at: float  # unix time, seconds
    relayed: bool = False  # the link ran through a circuit relay (a peer behind NAT; relay limits apply)


@dataclass(frozen=True)
class PeerRecord:
    """What a member advertises about itself (protocol/RECORDS.md, "Record")."""

    peer_id: str  # base58 libp2p peer id
    maddrs: tuple[str, ...]
    software_version: str
    protocol_version: int
    device: DeviceProfile
    roles: tuple[str, ...]
    capacity_bytes: int  # memory the user offers to the swarm
    links: Mapping[str, LinkMeasurement] = field(default_factory=dict)
    availability: str = "available"
    next_window: str | None = None
    jobs: tuple[str, ...] = ()
    updated_at: float = 0.0  # DHT time (hivemind get_dht_time, unix seconds)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map stored in the DHT; every number has its exact wire type."""
        d = self.device
        return {
            "peer_id": str(self.peer_id),
            "maddrs": [str(m) for m in self.maddrs],
            "software_version": str(self.software_version),
            "protocol_version": int(self.protocol_version),
            "device": {
                "kind": str(d.kind),
                "name": str(d.name),
                "memory_total_bytes": int(d.memory_total_bytes),
                "memory_free_bytes": int(d.memory_free_bytes),
                "tflops_fp32": float(d.tflops_fp32),
                "tflops_bf16": None if d.tflops_bf16 is None else float(d.tflops_bf16),
                "tflops_fp16": None if d.tflops_fp16 is None else float(d.tflops_fp16),
                "torch_version": str(d.torch_version),
                "cpu_count": int(d.cpu_count),
                "measured_at": float(d.measured_at),
            },
            "roles": [str(r) for r in self.roles],
            "capacity_bytes": int(self.capacity_bytes),
            "links": {
                str(pid): {
                    "bandwidth_bps": float(m.bandwidth_bps),
                    "rtt_s": float(m.rtt_s),
                    "measured_at": float(m.measured_at),
                    "relayed": bool(m.relayed),
                }
                for pid, m in self.links.items()
            },
            "availability": str(self.availability),
            "next_window": None if self.next_window is None else str(self.next_window),
            "jobs": [str(j) for j in self.jobs],
            "updated_at": float(self.updated_at),
        }

    @classmethod
    def from_wire(cls, value: Any) -> PeerRecord:
        """Parse and schema-check a wire map; ProtocolError if it does not match protocol/RECORDS.md."""
        if not isinstance(value, dict):
            raise ProtocolError(f"peer record must be a map, got {type(value).__name__}")
        try:
            model = PeerModel.parse_obj(value)
        except pydantic.ValidationError as exc:
            raise ProtocolError(f"peer record violates the schema: {exc}") from exc
        for link in value.get("links", {}).values() if isinstance(value.get("links"), dict) else ():
            if isinstance(link, dict):
                link.setdefault("relayed", False)  # records of peers from before issue 22
        if model.dict() != value:
            raise ProtocolError("peer record needed type conversions to match the schema")
        dev = value["device"]
        return cls(
            peer_id=value["peer_id"],
            maddrs=tuple(value["maddrs"]),
            software_version=value["software_version"],
            protocol_version=value["protocol_version"],
            device=DeviceProfile(**dev),
            roles=tuple(value["roles"]),
            capacity_bytes=value["capacity_bytes"],
            links={pid: LinkMeasurement(**m) for pid, m in value["links"].items()},
            availability=value["availability"],
            next_window=value["next_window"],
            jobs=tuple(value["jobs"]),
            updated_at=value["updated_at"],
        )


# ---- schema (pydantic v1, as hivemind.dht.schema requires; strict types, bounded sizes) ----


def _float(lo: float, hi: float | None = None) -> type:
    return (
        pydantic.confloat(strict=True, ge=lo, le=hi)
        if hi is not None
        else pydantic.confloat(strict=True, ge=lo)
    )


def _int(lo: int, hi: int) -> type:
    return pydantic.conint(strict=True, ge=lo, le=hi)


def _str(max_length: int, regex: str | None = None, min_length: int = 0) -> type:
    return pydantic.constr(strict=True, min_length=min_length, max_length=max_length, regex=regex)


def _one_of(options: Iterable[str]) -> str:
    return "^(" + "|".join(re.escape(o) for o in options) + ")$"


class _Strict(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid


class DeviceModel(_Strict):
    kind: _str(8, _one_of(DEVICE_KINDS))
    name: _str(MAX_NAME_LEN)
    memory_total_bytes: _int(0, MAX_MEMORY_BYTES)
    memory_free_bytes: _int(0, MAX_MEMORY_BYTES)
    tflops_fp32: _float(0.0, MAX_TFLOPS)
    tflops_bf16: _float(0.0, MAX_TFLOPS) | None = pydantic.Field(...)
    tflops_fp16: _float(0.0, MAX_TFLOPS) | None = pydantic.Field(...)
    torch_version: _str(MAX_VERSION_LEN)
    cpu_count: _int(1, MAX_CPU_COUNT)
    measured_at: _float(0.0)


class LinkModel(_Strict):
    bandwidth_bps: _float(0.0, MAX_BANDWIDTH_BPS)
    rtt_s: _float(0.0, MAX_RTT)
    measured_at: _float(0.0)
    relayed: pydantic.StrictBool = False


class PeerModel(_Strict):
    peer_id: _str(MAX_PEER_ID_LEN, PEER_ID_REGEX)
    maddrs: pydantic.conlist(_str(MAX_MADDR_LEN, min_length=1), max_items=MAX_MADDRS)
    software_version: _str(MAX_VERSION_LEN)
    protocol_version: _int(0, MAX_PROTOCOL_VERSION)
    device: DeviceModel
    roles: pydantic.conlist(_str(16, _one_of(ROLES)), max_items=len(ROLES))
    capacity_bytes: _int(0, MAX_MEMORY_BYTES)
    links: dict[_str(MAX_PEER_ID_LEN, PEER_ID_REGEX), LinkModel]
    availability: _str(16, _one_of(AVAILABILITIES))
    next_window: _str(MAX_WINDOW_LEN) | None = pydantic.Field(...)
    jobs: pydantic.conlist(_str(MAX_JOB_ID_LEN, min_length=1), max_items=MAX_JOBS)
    updated_at: _float(0.0)

    @pydantic.validator("links")
    def _few_links(cls, v: dict) -> dict:
        if len(v) > MAX_LINKS:
            raise ValueError(f"at most {MAX_LINKS} links, got {len(v)}")
        return v

    @pydantic.validator("roles", "jobs")
    def _unique(cls, v: list) -> list:
        if len(set(v)) != len(v):
            raise ValueError("entries must be unique")
        return v


class PeersSchema(pydantic.BaseModel):
    """The DHT-level schema: key PEERS_KEY is a dictionary {owner tag: PeerModel}."""

    peers: dict[BytesWithPublicKey, PeerModel]


# ---- validators ----


def public_key_from_owner_tag(tag: bytes) -> RSAPublicKey:
    """Parse ``[owner:<ssh-rsa ...>]`` (the whole subkey must be exactly one tag)."""
    match = re.fullmatch(RSASignatureValidator.PUBLIC_KEY_REGEX, tag)
    if match is None:
        raise ProtocolError("subkey is not a single [owner:<public key>] tag")
    try:
        return RSAPublicKey.from_bytes(match.group(1))
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"subkey carries no valid RSA public key: {exc}") from exc


def check_binding(owner_tag: bytes, peer_id: str) -> None:
    """Raise ProtocolError unless the owner's public key hashes to ``peer_id`` (libp2p RSA peer id rule)."""
    derived = peer_id_from_public_key(public_key_from_owner_tag(owner_tag)).to_base58()
    if derived != peer_id:
        raise ProtocolError(f"record claims peer id {peer_id} but is owned by key of peer {derived}")


def verify_entry(owner_tag: Any, value: Any) -> PeerRecord:
    """Read-time check of one dictionary entry: schema, then key-to-peer-id binding."""
    if not isinstance(owner_tag, bytes):
        raise ProtocolError(f"subkey must be bytes, got {type(owner_tag).__name__}")
    record = PeerRecord.from_wire(value)
    check_binding(owner_tag, record.peer_id)
    return record


class PeerBindingValidator(RecordValidatorBase):
    """Rejects a PEERS_KEY entry whose owner key does not hash to the ``peer_id`` inside it.

    Runs after RSASignatureValidator (lower priority), so it sees the value with the signature stripped.
    """

    def validate(self, record: DHTRecord) -> bool:
        if record.key != PEERS_KEY_ID:
            return True
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return False  # the peers key holds only owner-tagged entries
        try:
            tag = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
            if not isinstance(tag, bytes) or not isinstance(value, dict):
                return False
            peer_id = value.get("peer_id")
            if not isinstance(peer_id, str):
                return False
            check_binding(tag, peer_id)
        except (ProtocolError, ValueError, TypeError) as exc:
            logger.debug("rejected peer record: %s", exc)
            return False
        except Exception as exc:  # msgpack raises its own exception types for garbage bytes
            logger.debug("rejected undecodable peer record: %s", exc)
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # between RSASignatureValidator (10) and SchemaValidator (0)


class ExpirationCapValidator(RecordValidatorBase):
    """Rejects records that expire more than ``max_ttl`` seconds (+ clock skew) from now.

    ``keys``: raw DHT keys this cap applies to; None = every key.
    """

    def __init__(
        self,
        max_ttl: float = MAX_RECORD_TTL,
        keys: Iterable[str] | None = (PEERS_KEY,),
        skew: float = CLOCK_SKEW_ALLOWANCE,
    ):
        if max_ttl <= 0 or skew < 0:
            raise ValueError("max_ttl must be > 0 and skew >= 0")
        self.max_ttl = max_ttl
        self.skew = skew
        self.key_ids = None if keys is None else frozenset(DHTID.generate(source=k).to_bytes() for k in keys)

    def validate(self, record: DHTRecord) -> bool:
        if self.key_ids is not None and record.key not in self.key_ids:
            return True
        ok = record.expiration_time <= get_dht_time() + self.max_ttl + self.skew
        if not ok:
            logger.debug("rejected record expiring %.0f s ahead", record.expiration_time - get_dht_time())
        return ok


def make_validators(identity_private_key: Any) -> list[RecordValidatorBase]:
    """The validator set every FusionNode DHT runs (signing with the node's persistent key)."""
    return [
        RSASignatureValidator(identity_private_key),
        PeerBindingValidator(),
        SchemaValidator(PeersSchema, allow_extra_keys=True, prefix=RECORD_KEY_PREFIX),
        ExpirationCapValidator(MAX_RECORD_TTL, keys=(PEERS_KEY,)),
        ExpirationCapValidator(MAX_ANY_TTL, keys=None),
    ]
