"""Frozen configuration of a node. Every timeout carries its unit; defaults are module constants."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
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
# libp2p beyond the listen addresses (README "Network"; applied by fusionnode.swarm.libp2p)
AUTO_CHOICES = ("auto", "on", "off")
DHT_MODES = ("server", "client")
DEFAULT_NAT_PORT_MAP = "auto"  # UPnP/NAT-PMP on the gateway: on unless every listen address is loopback
DEFAULT_AUTONAT = "auto"  # AutoNAT (swarm peers dial back to say whether we are reachable): same rule
DEFAULT_RELAY_CLIENT = True  # dial peers through circuit relays (sends nothing by itself)
DEFAULT_RELAY_SERVICE = False  # relay other peers' traffic over this uplink (p2pd's own default is on)
DEFAULT_DHT_MODE = "server"  # libp2p Kademlia: answer other peers' routing queries (hivemind's default)
REACHABILITY_CHOICES = ("auto", "public", "private")
DEFAULT_REACHABILITY = "auto"  # ask peers to dial back at start (swarm/reachability.py)
MAX_TRUSTED_RELAYS = 8
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


def is_loopback(maddr: str) -> bool:
    """True for /ip4/127.x, /ip6/::1 and /dns*/localhost multiaddrs (their first address part)."""
    parts = str(maddr).strip("/").split("/")
    if len(parts) < 2:
        return False
    proto, value = parts[0], parts[1]
    if proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(value).is_loopback
        except ValueError:
            return False
    return proto in ("dns", "dns4", "dns6") and value == "localhost"


def loopback_only(listen: tuple[str, ...] | list[str]) -> bool:
    """Whether a node listens on loopback only (so every peer it can reach runs on this machine)."""
    return bool(listen) and all(is_loopback(a) for a in listen)


@dataclasses.dataclass(frozen=True)
class NetworkOptions:
    """What the libp2p daemon may do beyond listening on its addresses. ``auto`` = on unless every
    listen address is loopback: a home peer behind a router needs its port mapped to be dialable; a
    loopback daemon (tests, demo, benchmarks) must send no packet off the machine."""

    nat_port_map: str = DEFAULT_NAT_PORT_MAP  # "auto" | "on" | "off": UPnP and NAT-PMP toward the gateway
    autonat: str = DEFAULT_AUTONAT  # "auto" | "on" | "off"
    relay_client: bool = DEFAULT_RELAY_CLIENT
    relay_service: bool = DEFAULT_RELAY_SERVICE
    dht_mode: str = DEFAULT_DHT_MODE  # "server" | "client"
    # "auto": find out at start by asking peers to dial back; "public"/"private": take the user's word
    reachability: str = DEFAULT_REACHABILITY
    relays: tuple[str, ...] = ()  # trusted relays (multiaddrs ending /p2p/<id>); none: relays among peers
    direct: bool = (
        True  # data streams over TCP + TLS to peers that can be dialed directly (runtime/direct.py)
    )

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY_CHOICES:
            raise ConfigError(
                f"reachability must be one of {', '.join(REACHABILITY_CHOICES)}, got {self.reachability!r}"
            )
        if len(self.relays) > MAX_TRUSTED_RELAYS:
            raise ConfigError(f"at most {MAX_TRUSTED_RELAYS} trusted relays, got {len(self.relays)}")
        for relay in self.relays:
            if not isinstance(relay, str) or "/p2p/" not in relay or "/p2p-circuit" in relay:
                raise ConfigError(
                    f"a trusted relay must be a multiaddr ending in /p2p/<peer id> (not a circuit), got {relay!r}"
                )
        if self.relay_service and self.reachability == "private":
            raise ConfigError(
                "a relay (--relay) must be publicly reachable: it cannot run with --reachability private"
            )
        for name in ("nat_port_map", "autonat"):
            if getattr(self, name) not in AUTO_CHOICES:
                raise ConfigError(
                    f"{name} must be one of {', '.join(AUTO_CHOICES)}, got {getattr(self, name)!r}"
                )
        if self.dht_mode not in DHT_MODES:
            raise ConfigError(f"dht_mode must be one of {', '.join(DHT_MODES)}, got {self.dht_mode!r}")
        if self.relay_service and not self.relay_client:
            raise ConfigError(
                "the relay service needs the relay client on (p2pd ties both to its -relay flag)"
            )

    def resolve(self, listen: tuple[str, ...] | list[str]) -> dict[str, bool | str]:
        """The effective settings for these listen addresses."""
        local = loopback_only(listen)

        def on(value: str) -> bool:
            return value == "on" or (value == "auto" and not local)

        return {
            "nat_port_map": on(self.nat_port_map),
            "autonat": on(self.autonat),
            "relay_client": self.relay_client,
            "relay_service": self.relay_service,
            "dht_mode": self.dht_mode,
            "reachability": "local" if local and self.reachability == "auto" else self.reachability,
            "relays": list(self.relays),
            "direct": self.direct,
        }


LOCAL_ONLY = NetworkOptions(nat_port_map="off", autonat="off", relay_service=False)
# the same as `fusionnode join` flags: the demo, the benchmarks and the tests pass them explicitly
LOCAL_JOIN_FLAGS = ("--nat-port-map", "off", "--autonat", "off", "--relay-service", "off")


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    """`join`'s flags for what libp2p may do beyond the listen addresses (README "Network")."""
    onoff = {True: "on", False: "off"}
    p.add_argument(
        "--nat-port-map",
        choices=AUTO_CHOICES,
        default=DEFAULT_NAT_PORT_MAP,
        help="ask the router to forward the listen port (UPnP/SSDP multicast, NAT-PMP to the gateway) so "
        "peers outside the home network can dial in; auto: on unless every --listen address is "
        "loopback (default %(default)s)",
    )
    p.add_argument(
        "--autonat",
        choices=AUTO_CHOICES,
        default=DEFAULT_AUTONAT,
        help="AutoNAT: ask swarm peers to dial back to learn whether this peer is reachable; auto: on "
        "unless every --listen address is loopback (default %(default)s)",
    )
    p.add_argument(
        "--relay-client",
        choices=["on", "off"],
        default=onoff[DEFAULT_RELAY_CLIENT],
        help="dial peers through libp2p circuit relays when they cannot be dialed directly (sends "
        "nothing by itself; a slot on a relay is reserved only when this peer finds itself behind NAT) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--relay-service",
        choices=["on", "off"],
        default=onoff[DEFAULT_RELAY_SERVICE],
        help="relay other peers' connections over this peer's uplink once it is publicly reachable "
        "(p2pd's own default is on; FusionNode's is %(default)s); needs --relay-client on",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="offer this peer as a circuit relay for peers behind NAT (the same as --relay-service on "
        "--reachability public: a relay must be dialable from the internet; it asks p2pd for 30 min and "
        "4 GiB per relayed connection, but the shipped p2pd may grant go-libp2p's 2 min and 128 KiB; "
        "16 circuits per peer, 128 slots)",
    )
    p.add_argument(
        "--reachability",
        choices=REACHABILITY_CHOICES,
        default=DEFAULT_REACHABILITY,
        help="auto: at start ask a peer to dial this one back, and behind NAT reserve a slot on a relay; "
        "public/private: take that as the answer (default %(default)s)",
    )
    p.add_argument(
        "--relay-via",
        action="append",
        default=[],
        metavar="MADDR",
        help="a trusted relay (multiaddr ending in /p2p/<peer id>) for this peer when it is behind NAT; "
        "repeatable; without one, the initial peers that offer relaying are used",
    )
    p.add_argument(
        "--direct",
        choices=["on", "off"],
        default="on",
        help="move tensor streams to a TCP + TLS 1.3 connection (keyed to the peers' libp2p identities) "
        "when the other peer can be dialed directly; libp2p otherwise (default %(default)s)",
    )
    p.add_argument(
        "--dht-mode",
        choices=DHT_MODES,
        default=DEFAULT_DHT_MODE,
        help="libp2p DHT: server answers other peers' routing queries (so peers on one LAN find each "
        "other), client only asks (default %(default)s)",
    )


def network_options(args: argparse.Namespace) -> NetworkOptions:
    """The `NetworkOptions` of parsed `add_network_arguments` flags; ConfigError on a bad combination."""
    relay = bool(getattr(args, "relay", False))
    reachability = getattr(args, "reachability", DEFAULT_REACHABILITY)
    if relay and reachability == "auto":
        reachability = "public"
    return NetworkOptions(
        nat_port_map=args.nat_port_map,
        autonat=args.autonat,
        relay_client=args.relay_client == "on" or relay,
        relay_service=args.relay_service == "on" or relay,
        dht_mode=args.dht_mode,
        reachability=reachability,
        relays=tuple(getattr(args, "relay_via", None) or ()),
        direct=getattr(args, "direct", "on") == "on",
    )


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
    serve_checks: bool = False  # answer `verify.check`: judge checks for the drivers of serve_checks_for
    serve_checks_for: tuple[
        str, ...
    ] = ()  # the peer ids whose checks are judged (required with serve_checks)
    network: NetworkOptions = NetworkOptions()  # libp2p beyond the listen addresses

    def __post_init__(self) -> None:
        if self.record_ttl_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"record TTL ({self.record_ttl_s} s) must be at least twice the heartbeat ({self.heartbeat_s} s)"
            )
        from fusionnode.availability.policy import AvailabilityPolicy
        from fusionnode.availability.schedule import Schedule

        AvailabilityPolicy(when=self.when, grace_s=self.idle_grace_s)  # raises ConfigError on bad values
        if self.schedule:
            Schedule.parse(self.schedule)
        if self.serve_checks and not self.serve_checks_for:
            raise ConfigError(
                "--serve-checks needs --serve-checks-for PEER[,PEER]: the drivers whose checks it judges "
                "(any other peer of the swarm could hold its memory and queue)"
            )
        if self.serve_checks_for and not self.serve_checks:
            raise ConfigError("--serve-checks-for is given without --serve-checks")
        for peer in self.serve_checks_for:
            if not (peer.isalnum() and 16 <= len(peer) <= 128):
                raise ConfigError(f"--serve-checks-for takes peer ids, got {peer!r}")
        for name in ("startup_timeout_s", "heartbeat_s", "rpc_timeout_s", "step_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")

    @property
    def control_path(self) -> Path:
        return self.state_dir / "control.sock"
