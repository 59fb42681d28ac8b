"""Start hivemind's DHT with FusionNode's identity and record validators, without blocking the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any

from hivemind.dht import DHT
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from fusionnode.config import LOCAL_ONLY, NetworkOptions
from fusionnode.errors import ConfigError, DaemonError
from fusionnode.swarm.identity import Identity
from fusionnode.swarm.libp2p import OptionsDHT
from fusionnode.swarm.records import make_validators

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 30.0  # seconds for p2pd to start and the DHT to bootstrap
DHT_WAIT_TIMEOUT = 3.0  # seconds before a DHT RPC counts as lost (hivemind's default)
DHT_SHUTDOWN_TIMEOUT = 3.0  # seconds to wait for the DHT process before terminating it


def _check_maddrs(maddrs: Sequence[str], what: str, need_peer_id: bool) -> list[str]:
    out = []
    for addr in maddrs:
        try:
            ma = Multiaddr(str(addr))
        except Exception as exc:  # multiaddr raises several unrelated exception types
            raise ConfigError(f"{what}: {addr!r} is not a multiaddr: {exc}") from exc
        if need_peer_id:
            try:
                ma["p2p"]
            except Exception as exc:  # KeyError or multiaddr's ProtocolLookupError
                raise ConfigError(f"{what}: {addr!r} lacks /p2p/<peer id>") from exc
        out.append(str(addr))
    return out


def _start_blocking(
    identity: Identity,
    listen: list[str],
    initial_peers: list[str],
    startup_timeout: float,
    announce: list[str] | None,
    authorizer: Any = None,
    options: NetworkOptions = LOCAL_ONLY,
) -> DHT:
    dht = OptionsDHT(
        options=options,
        initial_peers=initial_peers or None,
        start=True,
        await_ready=False,
        host_maddrs=listen,
        announce_maddrs=announce or None,
        identity_path=str(identity.p2p_key_path),
        record_validators=make_validators(identity.private_key),
        startup_timeout=startup_timeout,
        wait_timeout=DHT_WAIT_TIMEOUT,
        shutdown_timeout=DHT_SHUTDOWN_TIMEOUT,
        authorizer=authorizer,
    )
    try:
        # p2pd start + identity check + bootstrap pings: give the child a little more than p2pd's own limit
        dht.wait_until_ready(timeout=startup_timeout + 2 * DHT_WAIT_TIMEOUT + 5.0)
    except BaseException:
        _stop(dht)
        raise
    return dht


def _stop(dht: DHT) -> None:
    try:
        dht.shutdown()
    finally:
        if dht.is_alive():
            dht.terminate()
            dht.join(DHT_SHUTDOWN_TIMEOUT)


async def start_dht(
    identity: Identity,
    listen: list[str],
    initial_peers: list[str],
    *,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    announce: list[str] | None = None,
    authorizer: Any = None,
    options: NetworkOptions = LOCAL_ONLY,
) -> DHT:
    """Start a DHT node (a forked process running p2pd) with this node's identity and record validators.

    Raises DaemonError if p2pd does not start, if none of ``initial_peers`` answers, or on timeout;
    ConfigError for malformed multiaddrs. Runs the blocking start in a thread so the loop stays live.
    ``authorizer`` (a `fusionnode.security.DHTSwarmAuthorizer`) makes every DHT RPC carry and require
    the swarm MAC: a private swarm. ``options``: what p2pd may do beyond listening (port mapping,
    AutoNAT, relays, DHT mode); nothing unless told (`fusionnode.swarm.libp2p.LOCAL_ONLY`).
    """
    listen = _check_maddrs(listen, "listen address", need_peer_id=False)
    initial_peers = _check_maddrs(initial_peers, "initial peer", need_peer_id=True)
    announce = _check_maddrs(announce, "announce address", need_peer_id=False) if announce else None
    if startup_timeout <= 0:
        raise ConfigError(f"startup_timeout must be > 0 s, got {startup_timeout}")
    t0 = time.monotonic()
    try:
        dht = await asyncio.to_thread(
            _start_blocking, identity, listen, initial_peers, startup_timeout, announce, authorizer, options
        )
    except (TimeoutError, concurrent.futures.TimeoutError) as exc:
        raise DaemonError(
            f"DHT did not start within {startup_timeout:.0f} s "
            f"(listen={listen}, initial peers={initial_peers or 'none'}); is p2pd blocked or very slow?"
        ) from exc
    except P2PDaemonError as exc:
        msg = str(exc)
        if "bootstrap" in msg and initial_peers:
            raise DaemonError(
                f"could not reach any initial peer {initial_peers}: {msg}; check the addresses and that "
                "those peers are running and reachable"
            ) from exc
        if "already taken" in msg:
            raise DaemonError(
                f"identity {identity.p2p_key_path} is already in use by a running peer ({identity.peer_id}); "
                "is another fusionnode running with the same state directory?"
            ) from exc
        raise DaemonError(f"libp2p daemon failed to start (listen={listen}): {msg}") from exc
    except RuntimeError as exc:
        if "bootstrap failed" in str(exc):
            raise DaemonError(
                f"none of the initial peers {initial_peers} answered a DHT ping: {exc}"
            ) from exc
        raise DaemonError(f"DHT failed to start: {exc}") from exc
    logger.info(
        "DHT started in %.2f s as %s; libp2p beyond the listen addresses: %s",
        time.monotonic() - t0,
        identity.peer_id,
        options.resolve(listen),
    )
    return dht


async def stop_dht(dht: DHT) -> None:
    """Shut the DHT process down (in a thread: it joins a process)."""
    await asyncio.to_thread(_stop, dht)
