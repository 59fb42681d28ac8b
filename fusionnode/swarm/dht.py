"""Start hivemind's DHT with FusionNode's identity and record validators, without blocking the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path
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


_TCP_LISTEN = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)(/|$)")


def ensure_listen_ports_free(listen: Sequence[str]) -> None:
    """Raises ConfigError if a fixed TCP port in `listen` is already taken on this host.

    p2pd binds with SO_REUSEPORT, so a second daemon on the same fixed port would start and share
    the port with the first (and peers dialling it would reach either). A plain bind (SO_REUSEADDR
    only, so a port in TIME_WAIT still counts as free) fails while anything listens there."""
    for addr in listen:
        m = _TCP_LISTEN.match(str(addr))
        if m is None or int(m.group(3)) == 0:
            continue
        family = socket.AF_INET if m.group(1) == "ip4" else socket.AF_INET6
        port = int(m.group(3))
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((m.group(2), port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue  # not ours to judge (an address this host lacks, say): p2pd will say
                free = str(addr).replace(f"/tcp/{port}", "/tcp/0", 1)
                raise ConfigError(
                    f"listen address {addr}: TCP port {port} is already in use on this host (another "
                    f"fusionnode daemon?); give this daemon another port, e.g. --listen {free} "
                    "(0 = a free port, shown in the READY line and by `fusionnode status`)"
                ) from None


P2PD_SOCKET_GLOB = "hivemind-p2pd-*.sock"  # hivemind's p2pd control socket, always under /tmp


def remove_stale_p2pd_sockets(since: float, directory: Path = Path("/tmp")) -> list[Path]:
    """Removes p2pd control sockets created at or after `since` (epoch seconds) that no process has
    bound any more; returns them.

    A p2pd that exits on its own (it could not reach its bootstrap peers, say) leaves its socket
    file: hivemind removes it only when it terminates p2pd itself. Whether a path is still bound
    comes from /proc/net/unix (Linux; elsewhere nothing is removed)."""
    try:
        bound = {
            line.split()[-1]
            for line in Path("/proc/net/unix").read_text().splitlines()[1:]
            if len(line.split()) >= 8
        }
    except OSError:
        return []
    removed = []
    for path in directory.glob(P2PD_SOCKET_GLOB):
        try:
            if path.lstat().st_ctime < since - 1.0 or str(path) in bound:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    if removed:
        logger.debug("removed stale p2pd sockets %s", removed)
    return removed


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
    started_at = time.time()
    try:
        try:
            dht = await asyncio.to_thread(
                _start_blocking,
                identity,
                listen,
                initial_peers,
                startup_timeout,
                announce,
                authorizer,
                options,
            )
        except BaseException:
            remove_stale_p2pd_sockets(since=started_at)
            raise
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
            if authorizer is None:
                hint = (
                    "they run, but if that swarm is private (started with --swarm-key) this peer needs "
                    "the same key: --swarm-key FILE"
                )
            else:
                hint = (
                    "they run, but they may not hold this peer's swarm key: check that --swarm-key is "
                    "the file the swarm was started with (or that the swarm is private at all)"
                )
            raise DaemonError(
                f"none of the initial peers {initial_peers} answered a DHT ping; {hint}"
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
