"""The swarm secret of a private swarm: a 32-byte key in a 0600 file, and the keys derived from it.

File format (text, two lines): ``fusionnode-swarm-key/v1`` then 64 lowercase hex digits. The secret
itself never signs anything: each use gets its own key, HMAC-SHA256(secret, label), so a MAC made for
the transport can never pass as one made for the DHT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

SWARM_KEY_HEADER = "fusionnode-swarm-key/v1"
SWARM_KEY_BYTES = 32  # bytes of secret (256 bits)
SWARM_KEY_ENV = "FUSIONNODE_SWARM_KEY_FILE"  # environment variable naming the key file
LABEL_TRANSPORT = b"fusionnode/v1/transport"  # derivation label of the transport MAC key
LABEL_DHT = b"fusionnode/v1/dht"  # derivation label of the DHT MAC key


@dataclasses.dataclass(frozen=True, repr=False)
class SwarmKey:
    """A swarm secret. `repr` never shows it; `fingerprint` names it safely in logs and status."""

    secret: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != SWARM_KEY_BYTES:
            raise ConfigError(f"a swarm key is {SWARM_KEY_BYTES} bytes")

    def derive(self, label: bytes) -> bytes:
        """The 32-byte key for one use (LABEL_TRANSPORT, LABEL_DHT)."""
        return hmac.new(self.secret, label, hashlib.sha256).digest()

    @property
    def fingerprint(self) -> str:
        """First 8 bytes of SHA-256(secret), hex: equal on every member, reveals nothing usable."""
        return hashlib.sha256(b"fusionnode/v1/fingerprint" + self.secret).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint})"

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(SWARM_KEY_BYTES))

    def to_text(self) -> str:
        return f"{SWARM_KEY_HEADER}\n{self.secret.hex()}\n"

    @classmethod
    def from_text(cls, text: str, what: str = "swarm key") -> SwarmKey:
        lines = [ln.strip() for ln in text.strip().splitlines()]
        if len(lines) != 2 or lines[0] != SWARM_KEY_HEADER:
            raise ConfigError(
                f"{what}: not a swarm key file (expected '{SWARM_KEY_HEADER}' and one hex line)"
            )
        try:
            secret = bytes.fromhex(lines[1])
        except ValueError:
            raise ConfigError(f"{what}: the key line is not hex") from None
        if len(secret) != SWARM_KEY_BYTES:
            raise ConfigError(f"{what}: the key is {len(secret)} bytes, expected {SWARM_KEY_BYTES}")
        return cls(secret)


def write_swarm_key(path: Path, key: SwarmKey | None = None, *, overwrite: bool = False) -> SwarmKey:
    """Create a key file with mode 0600 (never briefly readable by others); returns the key written."""
    key = key or SwarmKey.generate()
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; refusing to overwrite a swarm key") from None
    except OSError as exc:
        raise ConfigError(f"cannot create swarm key file {path}: {exc}") from exc
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key.to_text())
    return key


def load_swarm_key(path: Path) -> SwarmKey:
    """Read a key file; refuses one that group or others can read or write (like ssh does)."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read swarm key file {path}: {exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"swarm key file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
            f"anyone who reads it joins the swarm: chmod 600 {path}"
        )
    return SwarmKey.from_text(text, str(path))


def swarm_key_from_env_or_path(path: str | os.PathLike[str] | None) -> SwarmKey | None:
    """The key named by `path`, else by $FUSIONNODE_SWARM_KEY_FILE, else None (a public swarm)."""
    chosen = path or os.environ.get(SWARM_KEY_ENV) or None
    return load_swarm_key(Path(chosen)) if chosen else None
