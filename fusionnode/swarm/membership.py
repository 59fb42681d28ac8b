"""Swarm membership: publish this peer's signed record on a heartbeat, read and verify everyone's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.utils.timed_storage import get_dht_time

import fusionnode
from fusionnode.errors import ConfigError, DeadlineError, ProtocolError
from fusionnode.swarm.identity import Identity
from fusionnode.swarm.probe import LinkProber, ProbeConfig
from fusionnode.swarm.profile import DeviceProfile
from fusionnode.swarm.records import (
    AVAILABILITIES,
    MAX_JOB_ID_LEN,
    MAX_JOBS,
    MAX_MADDRS,
    MAX_RECORD_TTL,
    MAX_WINDOW_LEN,
    PEERS_KEY,
    ROLES,
    WIRE_PROTOCOL_MAJOR,
    PeerRecord,
    verify_entry,
)

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT = 5.0  # seconds between publications of our record
DEFAULT_RECORD_TTL = 15.0  # seconds a published record stays valid
DEFAULT_LEAVE_TTL = 3.0  # seconds the "leaving" record of a graceful leave stays valid
DEFAULT_DHT_TIMEOUT = 10.0  # seconds for one DHT store or get
EXPIRATION_EPSILON = 1e-3  # seconds: a newer record must expire strictly later than the one it replaces
PUBLISH_FAILURES_WARN = 3  # refused publications in a row before a warning (a lone peer: none to store with)


@dataclass(frozen=True)
class MembershipConfig:
    heartbeat_s: float = DEFAULT_HEARTBEAT  # seconds
    record_ttl_s: float = DEFAULT_RECORD_TTL  # seconds; >= 2 heartbeats so one lost store does not drop us
    leave_ttl_s: float = DEFAULT_LEAVE_TTL  # seconds
    dht_timeout_s: float = DEFAULT_DHT_TIMEOUT  # seconds
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.leave_ttl_s <= 0 or self.dht_timeout_s <= 0:
            raise ConfigError("heartbeat_s, leave_ttl_s and dht_timeout_s must be > 0 seconds")
        if self.record_ttl_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"record_ttl_s ({self.record_ttl_s}) must be >= 2 x heartbeat_s ({self.heartbeat_s})"
            )
        if self.record_ttl_s > MAX_RECORD_TTL or self.leave_ttl_s > MAX_RECORD_TTL:
            raise ConfigError(f"TTLs must be <= {MAX_RECORD_TTL} s (peers reject longer ones)")


async def _await_mp(future, timeout: float, what: str):
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError as exc:
        future.cancel()
        raise DeadlineError(f"DHT {what} took over {timeout} s") from exc


class Membership:
    """Publishes this peer's PeerRecord and lists the verified, unexpired records of the swarm."""

    def __init__(
        self,
        dht: DHT,
        p2p: P2P,
        identity: Identity,
        profile: DeviceProfile,
        *,
        roles: Iterable[str],
        capacity_bytes: int,
        maddrs: Iterable[str],
        config: MembershipConfig = MembershipConfig(),
        software_version: str = fusionnode.__version__,
        protocol_version: int = WIRE_PROTOCOL_MAJOR,
    ):
        roles = tuple(dict.fromkeys(roles))
        if not set(roles) <= set(ROLES):
            raise ConfigError(f"roles must be a subset of {ROLES}, got {roles}")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.dht = dht
        self.p2p = p2p
        self.identity = identity
        self.profile = profile
        self.config = config
        self.prober = LinkProber(p2p, config.probe)
        self._roles = roles
        self._capacity = capacity_bytes
        self._maddrs = tuple(str(m) for m in maddrs)[:MAX_MADDRS]
        self._software_version = software_version
        self._protocol_version = protocol_version
        self._availability = "available"
        self._next_window: str | None = None
        self._jobs: tuple[str, ...] = ()
        self._known: list[PeerRecord] = []
        self._wake = asyncio.Event()
        self._left = False
        self._publish_lock = asyncio.Lock()
        self._last_expiration = float("-inf")  # DHT time of our last published record's expiration

    # ---- state the daemon changes ----

    def set_availability(self, availability: str, next_window: str | None = None) -> None:
        if availability not in AVAILABILITIES:
            raise ConfigError(f"availability must be one of {AVAILABILITIES}, got {availability!r}")
        if next_window is not None and len(next_window) > MAX_WINDOW_LEN:
            raise ConfigError(f"next_window is longer than {MAX_WINDOW_LEN} characters")
        self._availability, self._next_window = availability, next_window
        self._wake.set()  # publish now, not at the next heartbeat

    def set_maddrs(self, maddrs: Iterable[str]) -> None:
        """The addresses our record advertises from the next heartbeat on (a relay slot gained or lost)."""
        self._maddrs = tuple(str(m) for m in maddrs)[:MAX_MADDRS]

    def set_jobs(self, job_ids: Iterable[str]) -> None:
        jobs = tuple(dict.fromkeys(job_ids))
        if len(jobs) > MAX_JOBS or any(not j or len(j) > MAX_JOB_ID_LEN for j in jobs):
            raise ConfigError(f"at most {MAX_JOBS} job ids of 1..{MAX_JOB_ID_LEN} characters")
        self._jobs = jobs
        self._wake.set()

    def own_record(self) -> PeerRecord:
        return PeerRecord(
            peer_id=self.identity.peer_id.to_base58(),
            maddrs=self._maddrs,
            software_version=self._software_version,
            protocol_version=self._protocol_version,
            device=self.profile,
            roles=self._roles,
            capacity_bytes=self._capacity,
            links=self.prober.results(),
            availability=self._availability,
            next_window=self._next_window,
            jobs=self._jobs,
            updated_at=get_dht_time(),
        )

    # ---- DHT I/O ----

    async def publish(self, ttl_s: float | None = None) -> bool:
        """Store our record now with expiration now + ttl_s (default record_ttl_s). True if any replica took it.

        hivemind keeps the entry with the LATER expiration, so a record is never published with an
        expiration earlier than the previous one (it would be ignored): the floor is the last expiration.
        """
        async with self._publish_lock:
            if self._left and ttl_s is None:
                return False  # withdrawn: no more heartbeats
            record = self.own_record()
            ttl = self.config.record_ttl_s if ttl_s is None else ttl_s
            expiration = max(record.updated_at + ttl, self._last_expiration + EXPIRATION_EPSILON)
            future = self.dht.store(
                PEERS_KEY,
                record.to_wire(),
                expiration_time=expiration,
                subkey=self.identity.owner_tag,
                return_future=True,
            )
            ok = await _await_mp(future, self.config.dht_timeout_s, "store")
            self._last_expiration = expiration
        if ok:
            self._publish_failures = 0
        else:
            # a peer alone in its swarm, or just started, has nobody to store with: say so only when
            # it persists
            self._publish_failures = getattr(self, "_publish_failures", 0) + 1
            logger.log(
                logging.WARNING if self._publish_failures >= PUBLISH_FAILURES_WARN else logging.DEBUG,
                "publishing our peer record was not accepted by any DHT node (%d times in a row)",
                self._publish_failures,
            )
        return bool(ok)

    async def peers(self, include_self: bool = True, include_leaving: bool = False) -> list[PeerRecord]:
        """Fresh from the DHT: every unexpired record whose schema and key-to-peer-id binding check out.

        Records with availability "leaving" are left out unless include_leaving.
        """
        future = self.dht.get(PEERS_KEY, latest=True, return_future=True)
        found = await _await_mp(future, self.config.dht_timeout_s, "get")
        now = get_dht_time()
        me = self.identity.peer_id.to_base58()
        out: dict[str, PeerRecord] = {}
        if found is not None and isinstance(found.value, dict):
            for owner_tag, item in found.value.items():
                if item.expiration_time <= now:
                    continue
                try:
                    record = verify_entry(owner_tag, item.value)
                except ProtocolError as exc:
                    logger.warning("dropping a peer record that fails verification: %s", exc)
                    continue
                if not include_self and record.peer_id == me:
                    continue
                if record.availability == "leaving" and not include_leaving:
                    continue
                prev = out.get(record.peer_id)
                if prev is None or record.updated_at > prev.updated_at:
                    out[record.peer_id] = record
        records = sorted(out.values(), key=lambda r: r.peer_id)
        self._known = records
        return records

    def known_peers(self) -> list[PeerRecord]:
        """The result of the last peers() call (no I/O)."""
        return list(self._known)

    async def withdraw(self) -> None:
        """Graceful leave: stop heartbeats and publish availability="leaving" with a short expiry.

        Readers drop "leaving" records at once; the entry itself expires leave_ttl_s from now, or when
        the last heartbeat's record would have (whichever is later: see publish).
        """
        self._left = True
        self._availability = "leaving"
        self._wake.set()
        await self.publish(ttl_s=self.config.leave_ttl_s)

    # ---- loop ----

    async def run(self) -> None:
        """Publish now and every heartbeat_s; probe links on the prober's schedule; until cancelled."""
        await self.prober.start()
        probe_task: asyncio.Task | None = None
        try:
            while not self._left:
                t0 = time.monotonic()
                self._wake.clear()
                try:
                    await self.publish()
                    if self._left:
                        break
                    await self.peers()
                except DeadlineError as exc:
                    logger.warning("membership heartbeat: %s", exc)
                if (probe_task is None or probe_task.done()) and self.prober.due():
                    others = [
                        r.peer_id
                        for r in self._known
                        if r.peer_id != self.identity.peer_id.to_base58() and r.availability != "leaving"
                    ]
                    if others:
                        probe_task = asyncio.create_task(self.prober.run_round(others), name="link-probe")
                wait = max(0.0, self.config.heartbeat_s - (time.monotonic() - t0))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
        finally:
            if probe_task is not None and not probe_task.done():
                probe_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe_task
            await self.prober.stop()
