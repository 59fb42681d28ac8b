"""Starting p2pd with FusionNode's `NetworkOptions` (what libp2p may do beyond the listen addresses):
the only ways FusionNode starts a libp2p daemon are `create_p2p` and `OptionsDHT`.

hivemind's ``P2P.create`` defaults to NAT port mapping and AutoNAT on, and passes p2pd no flag for
the relay service, which p2pd turns on by default. Here every p2pd gets the resolved NAT port
mapping, AutoNAT and relay flags explicitly (``-relayService`` through `_FlaggedP2P`); AutoRelay
stays off, as in hivemind. The defaults and the rule for ``auto`` are in `fusionnode.config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import hivemind.dht.node
from hivemind.dht import DHT
from hivemind.p2p import P2P

from fusionnode.config import LOCAL_ONLY, NetworkOptions
from fusionnode.errors import ConfigError

# What a relay carries. Measured with the shipped p2pd (tests/test_nat_e2e.py, test_reachability.py):
# every p2pd answers circuit-relay v2 reservations with go-libp2p's default limits (120 s and 128 KiB
# per relayed connection each way), even one started with -relayService=0; one started with
# -relayService=1 and the limits below also runs a relay with those (30 min, 4 GiB), and which of the
# two answered a reservation varied from run to run. Each reservation reports the terms actually
# granted (`fusionnode status`, reachability.reservations). A relayed connection cut at its limit
# breaks the data stream, which reopens on a new circuit and writes its unacknowledged messages again
# (runtime/transport.py): jobs go on, paying a new circuit per 128 KiB with the small terms.
RELAY_TIME_LIMIT = "30m0s"  # what a FusionNode relay (--relay) asks its p2pd for
RELAY_DATA_LIMIT_BYTES = 4 << 30
RELAY_GRANTED_TIME_S = 120.0  # go-libp2p's defaults, which any p2pd may grant instead
RELAY_GRANTED_DATA_BYTES = 128 << 10
RELAY_MAX_CIRCUITS = 16  # open relayed connections per peer
RELAY_MAX_RESERVATIONS = 128  # peers holding a slot on one relay
RELAY_LIMITS = {
    "time_limit_s": [RELAY_GRANTED_TIME_S, 1800.0],  # the two terms a shipped p2pd relay grants
    "data_limit_bytes": [RELAY_GRANTED_DATA_BYTES, RELAY_DATA_LIMIT_BYTES],
    "max_circuits_per_peer": RELAY_MAX_CIRCUITS,
    "max_reservations": RELAY_MAX_RESERVATIONS,
}


def p2p_kwargs(options: NetworkOptions, listen: Sequence[str]) -> dict[str, Any]:
    """Keyword arguments for hivemind's ``P2P.create`` (the relay service goes by `daemon_flags`)."""
    eff = options.resolve(list(listen))
    return {
        "nat_port_map": eff["nat_port_map"],
        "auto_nat": eff["autonat"],
        "use_relay": eff["relay_client"],
        "use_auto_relay": False,
        "dht_mode": eff["dht_mode"],
    }


def daemon_flags(options: NetworkOptions, listen: Sequence[str]) -> dict[str, Any]:
    """p2pd flags forced on every p2pd a `_FlaggedP2P` starts: the relay service, which
    ``P2P.create`` does not expose, and the two discovery options again (see `_FlaggedP2P`)."""
    eff = options.resolve(list(listen))
    flags: dict[str, Any] = {
        "natPortMap": eff["nat_port_map"],
        "autonat": eff["autonat"],
        "relayService": eff["relay_service"],
    }
    if eff["relay_service"]:
        flags.update(
            relayTimeLimit=RELAY_TIME_LIMIT,
            relayDataLimit=RELAY_DATA_LIMIT_BYTES,
            relayMaxCircuits=RELAY_MAX_CIRCUITS,
            relayMaxReservations=RELAY_MAX_RESERVATIONS,
        )
    if eff["reachability"] == "public":
        flags["forceReachabilityPublic"] = True
    elif eff["reachability"] == "private":
        # behind NAT: p2pd's AutoRelay reserves a slot on the trusted relays and serves circuits
        flags["forceReachabilityPrivate"] = True
        if eff["relay_client"] and eff["relays"]:
            flags["autoRelay"] = True
            flags["trustedRelays"] = ",".join(eff["relays"])
    return flags


_PROBE_FLAGS = daemon_flags(LOCAL_ONLY, ["/ip4/127.0.0.1/tcp/0"])


class _FlaggedP2P(P2P):
    """hivemind's P2P that puts `DAEMON_FLAGS` on p2pd's command line (``P2P.create`` passes only the
    flags it names; it has no parameter for p2pd's ``-relayService``).

    ``P2P.create`` with an existing identity file and initial peers first starts a second, anonymous
    p2pd (``is_identity_taken``) with hivemind's defaults (port mapping and AutoNAT on): that one
    gets `_PROBE_FLAGS` (everything off; it only dials the initial peers)."""

    DAEMON_FLAGS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def _make_process_args(cls, *args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **{**kwargs, **cls.DAEMON_FLAGS})

    @classmethod
    async def is_identity_taken(cls, identity_path: str, **kwargs: Any) -> bool:
        return await P2P.is_identity_taken.__func__(_p2p_class(_PROBE_FLAGS), identity_path, **kwargs)


def _p2p_class(flags: dict[str, Any]) -> type[P2P]:
    return type("FlaggedP2P", (_FlaggedP2P,), {"DAEMON_FLAGS": dict(flags)})


async def create_p2p(
    host_maddrs: Sequence[str],
    initial_peers: Sequence[str] | None = None,
    *,
    options: NetworkOptions = LOCAL_ONLY,
    **kwargs: Any,
) -> P2P:
    """``P2P.create`` with `options` applied (``LOCAL_ONLY`` unless told: for tests and benchmarks)."""
    listen = [str(a) for a in host_maddrs]
    cls = _p2p_class(daemon_flags(options, listen))
    return await cls.create(
        initial_peers=initial_peers, host_maddrs=listen, **p2p_kwargs(options, listen), **kwargs
    )


class OptionsDHT(DHT):
    """hivemind's DHT whose p2pd starts with `options` applied to its ``host_maddrs``.

    The DHT's own process (forked by ``start``) creates p2pd through ``hivemind.dht.node.P2P``; that
    process only, and before anything else runs in it, points that name at a `_FlaggedP2P`."""

    def __init__(self, *args: Any, options: NetworkOptions = LOCAL_ONLY, **kwargs: Any):
        listen = [str(a) for a in kwargs.get("host_maddrs") or ()]
        if not listen:
            raise ConfigError("OptionsDHT needs host_maddrs (p2pd's options depend on them)")
        if "p2p" in kwargs:
            raise ConfigError("OptionsDHT starts its own p2pd; pass no p2p")
        self._daemon_flags = daemon_flags(options, listen)
        kwargs.update(p2p_kwargs(options, listen))
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        hivemind.dht.node.P2P = _p2p_class(self._daemon_flags)
        super().run()
