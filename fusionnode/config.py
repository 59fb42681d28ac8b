"""Frozen configuration of a node. Every timeout carries its unit; defaults are module constants."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import platformdirs

from fusionnode.errors import ConfigError

DEFAULT_PORT = 31337
DEFAULT_LISTEN = f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"
DEFAULT_STARTUP_TIMEOUT = (
    60.0  # seconds for p2pd and the DHT to come up (hivemind's 15 s is too short on busy hosts)
)
DEFAULT_HEARTBEAT = 5.0  # seconds between re-publications of this peer's record
DEFAULT_RECORD_TTL = 20.0  # seconds a record lives without a heartbeat (>= 2 heartbeats)
DEFAULT_PROBE_INTERVAL = 30.0  # seconds between link-probe rounds
DEFAULT_RPC_TIMEOUT = 30.0  # seconds for one control RPC between peers
DEFAULT_STEP_TIMEOUT = 120.0  # seconds a pipeline stage waits for one message before declaring failure
DEFAULT_LEASE = 60.0  # seconds a stage assignment lives without renewal by its driver
ROLES = ("worker", "optimizer")
ENV_STATE_DIR = "FUSIONNODE_STATE_DIR"


def default_state_dir() -> Path:
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("fusionnode")) / "default"


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """'12GB' -> 12e9 bytes, '512MiB' -> 512*2**20, '1000' -> 1000."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size (examples: 12GB, 512MiB, 1000000)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return int(value)


_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps|b)?(/s)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """'8Mbit' -> 8e6 bits/s, '1Gbit' -> 1e9, '500k' -> 5e5, '1000' -> 1000 (bits per second)."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read {text!r} as a rate (examples: 8Mbit, 100Mbit, 1Gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"rate {text!r} must be positive")
    return value


def parse_roles(text: str | list[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    roles = tuple(dict.fromkeys(r.strip() for r in items if r.strip()))
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ConfigError(f"unknown role(s) {bad or text!r}; choose from {', '.join(ROLES)}")
    return roles


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    state_dir: Path
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    initial_peers: tuple[str, ...] = ()
    announce: tuple[str, ...] = ()
    roles: tuple[str, ...] = ROLES
    max_memory_bytes: int | None = None  # capacity the user offers; None = what the device has free
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT  # seconds
    heartbeat_s: float = DEFAULT_HEARTBEAT  # seconds
    record_ttl_s: float = DEFAULT_RECORD_TTL  # seconds
    probe: bool = True  # measure links to other peers (off for metered links)
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL  # seconds
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT  # seconds
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT  # seconds
    lease_s: float = DEFAULT_LEASE  # seconds
    torch_threads: int = 1
    when: str = "always"  # "idle": yield the device to its owner; "always": contribute whenever running
    schedule: str | None = None  # "HH:MM-HH:MM[,...]" local time windows to contribute in; None = any time
    max_util_percent: float | None = None  # cap on this peer's compute, percent of the device
    idle_grace_s: float = 60.0  # seconds the owner must stay idle before we contribute again
    activity_interval_s: float = 2.0  # seconds between owner-activity checks
    owner_cpu_cores: float = 0.5  # cores busy in other processes that mean the owner is using the machine
    swarm_key_file: str | None = None  # private swarm: only peers with this secret are spoken to
    dashboard: str | None = None  # "host:port" of the read-only dashboard and /metrics; None = off
    dashboard_actions: bool = False  # the dashboard may pause/resume this node and cancel its jobs (token)
    egress_limit_bps: float | None = None  # user-space cap on this peer's outgoing tensor streams, bits/s
    reprofile: bool = False  # re-measure the device even if a cached profile exists

    def __post_init__(self) -> None:
        if self.record_ttl_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"record TTL ({self.record_ttl_s} s) must be at least twice the heartbeat ({self.heartbeat_s} s)"
            )
        from fusionnode.availability import AvailabilityPolicy, Schedule

        AvailabilityPolicy(when=self.when, grace_s=self.idle_grace_s)  # raises ConfigError on bad values
        if self.schedule:
            Schedule.parse(self.schedule)
        for name in ("startup_timeout_s", "heartbeat_s", "rpc_timeout_s", "step_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")

    @property
    def control_path(self) -> Path:
        return self.state_dir / "control.sock"
