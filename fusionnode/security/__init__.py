"""Private swarms, per-peer limits and defences against hostile contributions (SECURITY.md)."""

from fusionnode.security.auth import (
    AUTH_FIELD,
    AuthenticationError,
    DHTSwarmAuthorizer,
    NonceCache,
    SwarmAuthorizer,
)
from fusionnode.security.guard import BanList, GuardConfig, NormBound
from fusionnode.security.keys import (
    SWARM_KEY_ENV,
    SwarmKey,
    load_swarm_key,
    swarm_key_from_env_or_path,
    write_swarm_key,
)
from fusionnode.security.limits import DEFAULT_PEER_LIMITS, PeerLimiter, PeerLimits

__all__ = [
    "AUTH_FIELD",
    "DEFAULT_PEER_LIMITS",
    "SWARM_KEY_ENV",
    "AuthenticationError",
    "BanList",
    "DHTSwarmAuthorizer",
    "GuardConfig",
    "NonceCache",
    "NormBound",
    "PeerLimiter",
    "PeerLimits",
    "SwarmAuthorizer",
    "SwarmKey",
    "load_swarm_key",
    "swarm_key_from_env_or_path",
    "write_swarm_key",
]
