"""Persistent peer identity: one RSA key that is both the libp2p identity and the record-signing key.

The key file is the libp2p protobuf ``PrivateKey{key_type: RSA, data: PKCS#1 DER}`` that p2pd reads
with ``-id`` (hivemind's ``P2P.generate_identity`` writes the same format). Because the libp2p
identity is RSA, the peer id is a hash of the very public key that signs our DHT records, so a
reader derives the peer id from the ``[owner:<pubkey>]`` subkey of a record and compares it with
the record's ``peer_id`` (see protocol/RECORDS.md, "Binding").
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

P2P_KEY_FILENAME = "p2p_identity.key"
RSA_KEY_BITS = 2048  # bits; what hivemind uses for its own RSA keys
KEY_FILE_MODE = 0o600  # owner read/write only


@dataclass(frozen=True)
class Identity:
    """Who this node is. ``private_key`` signs DHT records; ``p2p_key_path`` is p2pd's identity file."""

    state_dir: Path
    p2p_key_path: Path
    peer_id: PeerID
    private_key: RSAPrivateKey = field(repr=False, compare=False)

    @property
    def public_key(self) -> RSAPublicKey:
        return self.private_key.get_public_key()

    @property
    def owner_tag(self) -> bytes:
        """The ``[owner:<ssh-rsa ...>]`` tag hivemind's RSASignatureValidator looks for in a subkey."""
        return b"[owner:" + self.public_key.to_bytes() + b"]"


def peer_id_from_public_key(public_key: RSAPublicKey | rsa.RSAPublicKey) -> PeerID:
    """libp2p peer id of an RSA key: multihash(sha2-256, protobuf PublicKey{RSA, SubjectPublicKeyInfo DER})."""
    raw = public_key._public_key if isinstance(public_key, RSAPublicKey) else public_key
    der = raw.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def _private_key_from_der(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # the documented pickling path: DER -> cryptography key
    if not isinstance(key._private_key, rsa.RSAPrivateKey):
        raise ConfigError("identity key is not an RSA key")
    return key


def _write_new_key(path: Path) -> None:
    der = rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_BITS).private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if another process created the key meanwhile; theirs wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def load_or_create_identity(state_dir: Path) -> Identity:
    """Load the node key from ``state_dir`` or create it (mode 0600). The peer id survives restarts."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / P2P_KEY_FILENAME
    if not path.exists():
        logger.info("creating a new node identity in %s", path)
        _write_new_key(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"identity key {path} is readable by others (mode {mode:o}); chmod 600 it")
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception as exc:  # protobuf raises DecodeError, a bare Exception subclass
        raise ConfigError(f"identity key {path} is not a libp2p private key: {exc}") from exc
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise ConfigError(
            f"identity key {path} is not RSA (key type {proto.key_type}); FusionNode signs records with the "
            "libp2p identity key and needs RSA; move the file away to generate a new identity"
        )
    try:
        private_key = _private_key_from_der(proto.data)
    except ValueError as exc:
        raise ConfigError(f"identity key {path} is corrupt: {exc}") from exc
    peer_id = peer_id_from_public_key(private_key.get_public_key())
    return Identity(state_dir=state_dir, p2p_key_path=path, peer_id=peer_id, private_key=private_key)
