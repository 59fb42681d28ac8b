"""Link probing: RTT and bulk throughput from this peer to others over a libp2p stream.

Wire protocol "fusionnode.probe.v1" (protocol/RECORDS.md, "Link probe"): the caller sends a 12-byte
header (magic b"FNPB", version 1, ping count, 2 zero bytes, payload length u32 big-endian); then
each ping is 8 bytes the server echoes; then the caller streams the payload and the server answers
with the byte count it read (u64 big-endian). Bandwidth is this peer's upload towards that peer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from fusionnode.errors import ConfigError, DeadlineError, PeerError, ProtocolError
from fusionnode.swarm.records import MAX_BANDWIDTH_BPS, MAX_LINKS, LinkMeasurement

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "fusionnode.probe.v1"
PROBE_MAGIC = b"FNPB"
PROBE_VERSION = 1
_HEADER = struct.Struct(">4sBBHI")  # magic, version, n_pings, reserved (0), payload bytes
_COUNT = struct.Struct(">Q")
PING_BYTES = 8

DEFAULT_PROBE_INTERVAL = 30.0  # seconds between probe rounds
DEFAULT_PROBE_BYTES = 1 << 20  # bytes sent per bandwidth probe (1 MiB)
RELAYED_PROBE_BYTES = 64 << 10  # bytes per probe of a relayed link (inside the relay's 128 KiB)
DEFAULT_PEERS_PER_ROUND = 3  # peers probed per round
DEFAULT_PINGS = 4  # RTT samples per probe (the minimum is kept)
DEFAULT_PROBE_TIMEOUT = 20.0  # seconds for one whole probe
MAX_PROBE_BYTES = 16 << 20  # bytes: a server refuses to read more in one probe (16 MiB)
MAX_PINGS = 16  # RTT samples a server answers in one probe
MAX_CONCURRENT_SERVES = 2  # probes served at once; more are refused so probes cannot saturate a link
SERVE_TIMEOUT = 60.0  # seconds a server spends on one probe stream
HEADER_TIMEOUT_S = 5.0  # seconds an opener has to send its probe header (after its auth preamble)
CHUNK_BYTES = 256 << 10  # bytes per write/read of the payload


@dataclass(frozen=True)
class ProbeConfig:
    """enabled=False turns probing off both ways (no outgoing probes, no handler): for metered links."""

    enabled: bool = True
    interval_s: float = DEFAULT_PROBE_INTERVAL  # seconds between rounds
    probe_bytes: int = DEFAULT_PROBE_BYTES  # bytes per bandwidth probe
    peers_per_round: int = DEFAULT_PEERS_PER_ROUND
    pings: int = DEFAULT_PINGS
    timeout_s: float = DEFAULT_PROBE_TIMEOUT  # seconds for one probe

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ConfigError("probe interval_s and timeout_s must be > 0 seconds")
        if not 1 <= self.probe_bytes <= MAX_PROBE_BYTES:
            raise ConfigError(f"probe_bytes must be in [1, {MAX_PROBE_BYTES}], got {self.probe_bytes}")
        if not 1 <= self.pings <= MAX_PINGS:
            raise ConfigError(f"pings must be in [1, {MAX_PINGS}], got {self.pings}")
        if self.peers_per_round < 1:
            raise ConfigError("peers_per_round must be >= 1")


class LinkProber:
    """Serves probes from others and measures links to others; keeps the latest measurement per peer."""

    def __init__(self, p2p: P2P, config: ProbeConfig = ProbeConfig()):
        self.p2p = p2p
        self.config = config
        self._results: dict[str, LinkMeasurement] = {}
        self._serving = asyncio.Semaphore(MAX_CONCURRENT_SERVES)
        self._serving_peers: set[str] = set()  # peers whose probe is being served (one each)
        self._started = False
        self._last_round = float("-inf")  # time.monotonic() of the last round that probed someone
        # private swarms: (write_preamble(writer, peer, proto), read_preamble(reader, peer, proto)) of the
        # Transport's authorizer, so an outsider cannot use our probe either
        self.auth: tuple[Any, Any] | None = None
        self.reach: Any = None  # swarm/reachability.py Reachability: relayed links are dialed and flagged

    async def start(self) -> None:
        """Register the probe handler (no-op when probing is disabled)."""
        if self._started or not self.config.enabled:
            return
        await self.p2p.add_binary_stream_handler(PROBE_PROTOCOL, self._serve)
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(PROBE_PROTOCOL)
            except Exception as exc:  # the daemon may already be gone at shutdown
                logger.debug("could not remove probe handler: %s", exc)

    def results(self) -> dict[str, LinkMeasurement]:
        """Latest measurement per peer id (base58), newest first, at most MAX_LINKS."""
        items = sorted(self._results.items(), key=lambda kv: kv[1].measured_at, reverse=True)
        return dict(items[:MAX_LINKS])

    # ---- server side ----

    async def _serve(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A probe takes one of the MAX_CONCURRENT_SERVES slots only once its opener has shown it is a
        member (the auth preamble, in a private swarm) and sent its probe header; one slot per peer. A
        silent or keyless opener holds no slot and is closed after HEADER_TIMEOUT_S."""
        peer = str(info.peer_id)
        try:
            if self.auth is not None:
                try:
                    await self.auth[1](reader, peer, PROBE_PROTOCOL)
                except Exception as exc:  # no valid preamble: closed without a byte back
                    logger.debug("refusing probe from %s: %s", peer, exc)
                    return
            head = await asyncio.wait_for(reader.readexactly(_HEADER.size), HEADER_TIMEOUT_S)
            if self._serving.locked() or peer in self._serving_peers:
                logger.debug("refusing probe from %s: busy", peer)
                return
            async with self._serving:
                self._serving_peers.add(peer)
                try:
                    await asyncio.wait_for(self._serve_one(head, reader, writer), SERVE_TIMEOUT)
                finally:
                    self._serving_peers.discard(peer)
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.debug("probe from %s ended: %r", peer, exc)
        finally:
            writer.close()

    @staticmethod
    async def _serve_one(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        magic, version, n_pings, reserved, n_bytes = _HEADER.unpack(head)
        if magic != PROBE_MAGIC or version != PROBE_VERSION or reserved != 0:
            raise ProtocolError(f"bad probe header {magic!r} v{version}")
        if n_pings > MAX_PINGS or n_bytes > MAX_PROBE_BYTES:
            raise ProtocolError(f"probe over limits: {n_pings} pings, {n_bytes} bytes")
        for _ in range(n_pings):
            writer.write(await reader.readexactly(PING_BYTES))
            await writer.drain()
        left = n_bytes
        while left > 0:
            chunk = await reader.read(min(left, CHUNK_BYTES))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(chunk)
        writer.write(_COUNT.pack(n_bytes))
        await writer.drain()

    # ---- client side ----

    async def probe(self, peer_id: str | PeerID) -> LinkMeasurement:
        """Measure RTT and upload throughput to ``peer_id``; PeerError if it refuses, DeadlineError on timeout."""
        pid = peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(peer_id)
        try:
            m = await asyncio.wait_for(self._probe(pid), self.config.timeout_s)
        except TimeoutError as exc:
            raise DeadlineError(f"link probe to {pid} took over {self.config.timeout_s} s") from exc
        self._results[pid.to_base58()] = m
        return m

    async def _probe(self, pid: PeerID) -> LinkMeasurement:
        cfg = self.config
        try:
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(pid, PROBE_PROTOCOL)
            except Exception:
                if self.reach is None or not await self.reach.dial(self.p2p, pid.to_base58()):
                    raise
                _, reader, writer = await self.p2p.call_binary_stream_handler(pid, PROBE_PROTOCOL)
        except (
            Exception
        ) as exc:  # the daemon reports an unreachable peer or missing handler as various errors
            raise PeerError(f"cannot open probe stream to {pid}: {exc}") from exc
        relayed = self.reach is not None and self.reach.is_relayed(pid.to_base58())
        # a relayed connection may be reset after 128 KiB (go-libp2p's relay terms): a smaller probe
        nbytes = min(cfg.probe_bytes, RELAYED_PROBE_BYTES) if relayed else cfg.probe_bytes
        try:
            if self.auth is not None:
                await self.auth[0](writer, pid.to_base58(), PROBE_PROTOCOL)
            writer.write(_HEADER.pack(PROBE_MAGIC, PROBE_VERSION, cfg.pings, 0, nbytes))
            rtts = []
            for _ in range(cfg.pings):
                nonce = os.urandom(PING_BYTES)
                t0 = time.perf_counter()
                writer.write(nonce)
                await writer.drain()
                echo = await reader.readexactly(PING_BYTES)
                rtts.append(time.perf_counter() - t0)
                if echo != nonce:
                    raise PeerError(f"{pid} echoed a wrong probe nonce")
            rtt = min(rtts)
            payload = bytes(min(nbytes, CHUNK_BYTES))
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                n = min(left, len(payload))
                writer.write(payload[:n] if n < len(payload) else payload)
                await writer.drain()
                left -= n
            (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
            elapsed = time.perf_counter() - t0
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise PeerError(
                f"{pid} closed the probe stream (busy or not a fusionnode peer): {exc!r}"
            ) from exc
        finally:
            writer.close()
        if count != nbytes:
            raise PeerError(f"{pid} acknowledged {count} of {nbytes} probe bytes")
        # elapsed ~= transfer + one RTT (first byte out, acknowledgement back); never credit more than 2x.
        transfer = max(elapsed - rtt, elapsed / 2)
        bandwidth = min(8.0 * nbytes / transfer, MAX_BANDWIDTH_BPS)
        return LinkMeasurement(
            bandwidth_bps=bandwidth, rtt_s=max(rtt, 1e-9), measured_at=time.time(), relayed=relayed
        )

    def due(self) -> bool:
        """Whether a round is due (interval elapsed since the last round that probed someone)."""
        return self.config.enabled and time.monotonic() - self._last_round >= self.config.interval_s

    async def run_round(self, candidates: Iterable[str]) -> dict[str, LinkMeasurement]:
        """Probe up to peers_per_round of ``candidates``: never-measured first, then the stalest; one at a time."""
        if not self.config.enabled:
            return {}
        pool = list(dict.fromkeys(candidates))
        random.shuffle(pool)
        pool.sort(key=lambda p: self._results[p].measured_at if p in self._results else float("-inf"))
        chosen = pool[: self.config.peers_per_round]
        if not chosen:
            return {}
        self._last_round = time.monotonic()
        out = {}
        for peer in chosen:  # sequential: one probe stream at a time, so a round never floods our uplink
            try:
                out[peer] = await self.probe(peer)
            except (PeerError, ValueError) as exc:
                logger.info("link probe to %s failed: %s", peer, exc)
        return out
