"""The daemon: the composition root that wires a node's components and runs them.

One asyncio event loop per node. ``Node.create`` starts the DHT (libp2p through
p2pd), shares its P2P for FusionNode's own RPCs, and builds the components;
``Node.run`` runs them in one task group until ``stop()`` (first SIGINT/SIGTERM,
or ``fusionnode leave``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import fusionnode
from fusionnode.config import NodeConfig
from fusionnode.control import ControlServer
from fusionnode.errors import ConfigError, DaemonError, JobCancelled
from fusionnode.runtime.hooks import hook_from_env
from fusionnode.runtime.shaping import TokenBucket
from fusionnode.runtime.transport import Transport

logger = logging.getLogger(__name__)

READY_PREFIX = "FUSIONNODE READY "  # the one parseable startup line: prefix + JSON


class StateDirLock:
    """One daemon per state directory: an exclusive flock on state_dir/daemon.lock."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                pid = self.path.read_text().strip()
            except OSError:
                pid = "?"
            raise DaemonError(
                f"another fusionnode daemon (pid {pid}) already runs with state dir {self.path.parent}; "
                "stop it with `fusionnode leave` or pick another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.started_at = time.time()
        self.lock = StateDirLock(config.state_dir)
        self.identity: Any = None
        self.profile: Any = None
        self.dht: Any = None
        self.p2p: Any = None
        self.membership: Any = None
        self.transport: Transport | None = None
        self.worker: Any = None
        self.driver: Any = None
        self.host: Any = None
        self.verifier: Any = None  # train/verifier_peer.py VerifierService (`join --serve-checks`)
        self.control: ControlServer | None = None
        self.maddrs: list[str] = []
        self.swarm_fingerprint: str | None = None
        self.availability: Any = None
        self.reach: Any = None  # swarm/reachability.py Reachability
        self.direct_addrs: list[str] = []  # where the direct fast path listens (runtime/direct.py)
        self.dashboard: Any = None
        self.dashboard_url: str | None = None
        self._job_tasks: dict[str, asyncio.Task[Any]] = {}  # job id -> the control call that drives it
        self._cancelled: set[str] = set()  # jobs cancelled through the control API
        self._stop = asyncio.Event()

    @classmethod
    async def create(cls, config: NodeConfig) -> Node:
        self = cls(config)
        try:
            await self._start()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def _start(self) -> None:
        from fusionnode.optim.host import OptimizerHostService
        from fusionnode.runtime.worker import WorkerService
        from fusionnode.swarm.dht import ensure_listen_ports_free, start_dht
        from fusionnode.swarm.identity import load_or_create_identity
        from fusionnode.swarm.membership import Membership, MembershipConfig
        from fusionnode.swarm.probe import ProbeConfig
        from fusionnode.swarm.profile import load_or_measure_profile
        from fusionnode.swarm.reachability import DIALBACK_METHOD
        from fusionnode.train.driver import Driver

        cfg = self.config
        self.lock.acquire()
        ensure_listen_ports_free(cfg.listen)
        self.identity = load_or_create_identity(cfg.state_dir)
        self.profile = await asyncio.to_thread(load_or_measure_profile, cfg.state_dir, force=cfg.reprofile)
        from fusionnode.security import DHTSwarmAuthorizer, SwarmAuthorizer, swarm_key_from_env_or_path

        key = swarm_key_from_env_or_path(cfg.swarm_key_file)
        if key is not None:
            logger.info("private swarm %s", key.fingerprint)
        self.swarm_fingerprint = key.fingerprint if key is not None else None
        network = await self._find_reachability(SwarmAuthorizer(key) if key is not None else None)
        self.dht = await start_dht(
            self.identity,
            list(cfg.listen),
            list(cfg.initial_peers),
            startup_timeout=cfg.startup_timeout_s,
            announce=list(cfg.announce) or None,
            authorizer=DHTSwarmAuthorizer(key) if key is not None else None,
            options=network,
        )
        t0 = time.monotonic()
        self.p2p = await self.dht.replicate_p2p()
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        logger.info("P2P replicated in %.2f s", time.monotonic() - t0)
        self.reach.peer_id = self.peer_id
        await self.reach.keep_reservations(self.p2p)
        self.maddrs = [*self.reach.circuit_addrs, *self.maddrs][:12]  # advertised in our record
        logger.info("%s", self.reach.line())
        print(self.reach.line(), file=sys.stderr, flush=True)
        capacity = cfg.max_memory_bytes or self.profile.memory_free_bytes
        self.membership = Membership(
            self.dht,
            self.p2p,
            self.identity,
            self.profile,
            roles=list(cfg.roles),
            capacity_bytes=int(capacity),
            maddrs=self.maddrs,
            config=MembershipConfig(
                heartbeat_s=cfg.heartbeat_s,
                record_ttl_s=cfg.record_ttl_s,
                probe=ProbeConfig(enabled=cfg.probe, interval_s=cfg.probe_interval_s),
            ),
        )
        self.transport = Transport(
            self.p2p,
            rpc_timeout=cfg.rpc_timeout_s,
            authorizer=SwarmAuthorizer(key) if key is not None else None,
        )
        if cfg.egress_limit_bps:
            self.transport.egress_limit = TokenBucket(cfg.egress_limit_bps)
        if cfg.network.direct:
            await self._start_direct()
        self.transport.reach = self.reach
        self.reach.records = self.membership.known_peers
        self.transport.add_rpc(DIALBACK_METHOD, self._rpc_dialback)
        await self.transport.start()
        self.membership.prober.auth = self.transport.preamble_hooks()
        self.membership.prober.reach = self.reach
        self.worker = WorkerService(
            self.transport,
            capacity_bytes=int(capacity),
            config=cfg,
            can_work="worker" in cfg.roles,
            can_host="optimizer" in cfg.roles,
            state_dir=cfg.state_dir,
            on_jobs_changed=self.membership.set_jobs,
            hook=hook_from_env(cfg.state_dir),  # `join --debug` only (tests, testbed); None otherwise
        )
        if "optimizer" in cfg.roles:
            self.host = OptimizerHostService(
                self.transport, state_dir=cfg.state_dir, step_deadline_s=cfg.step_timeout_s
            )
        self.driver = Driver(self.transport, self.membership, config=cfg, state_dir=cfg.state_dir)
        from fusionnode.train.verifier_peer import VerifierService

        self.verifier = VerifierService(
            self.transport, serve=cfg.serve_checks, allow=cfg.serve_checks_for
        )  # verify.check
        self.driver.hosts.local = self.host  # its own host's parameters read in place (None: no host)
        from fusionnode.availability.activity import ActivityThresholds, build_monitor
        from fusionnode.availability.caps import apply_memory_cap, apply_util_cap
        from fusionnode.availability.controller import AvailabilityController
        from fusionnode.availability.policy import AvailabilityPolicy, describe
        from fusionnode.availability.schedule import Schedule

        if cfg.max_util_percent:
            apply_util_cap(cfg.max_util_percent, requested_threads=cfg.torch_threads)
        if cfg.max_memory_bytes and self.profile.kind == "cuda":
            apply_memory_cap(cfg.max_memory_bytes)
        monitor = (
            build_monitor(self.profile.kind, ActivityThresholds(cpu_cores=cfg.owner_cpu_cores))
            if cfg.when == "idle"
            else None
        )
        policy = AvailabilityPolicy(when=cfg.when, grace_s=cfg.idle_grace_s)
        schedule = Schedule.parse(cfg.schedule) if cfg.schedule else None
        self.availability = AvailabilityController(
            monitor, schedule, self._on_availability, policy=policy, interval_s=cfg.activity_interval_s
        )
        logger.info(describe(policy, schedule, monitor.signals if monitor else ()))
        self.control = ControlServer(
            cfg.control_path,
            {
                "status": self._rpc_status,
                "peers": self._rpc_peers,
                "leave": self._rpc_leave,
                "train": self._rpc_train,
                "set_link_limits": self._rpc_set_link_limits,
                "pause": lambda params, emit: self.availability.pause(),
                "resume": lambda params, emit: self.availability.resume(),
                "cancel": self._rpc_cancel,
            },
        )
        await self.control.start()
        if cfg.dashboard:
            from fusionnode.web import Dashboard

            host, _, port = cfg.dashboard.rpartition(":")
            actions = None
            if cfg.dashboard_actions:
                actions = {
                    "pause": lambda body: self.availability.pause(),
                    "resume": lambda body: self.availability.resume(),
                    "cancel": lambda body: self._rpc_cancel(body, None),
                }
            self.dashboard = Dashboard(
                lambda: self._rpc_status({}, None),
                host=host.strip("[]") or "127.0.0.1",
                port=int(port or 0),
                actions=actions,
            )
            self.dashboard_url = await self.dashboard.start()
            if self.dashboard.actions_url:
                # the token, once, where the user who started the daemon sees it
                print(f"dashboard with actions: {self.dashboard.actions_url}", file=sys.stderr, flush=True)
        logger.info("node components started in %.2f s", time.monotonic() - t0)

    async def _find_reachability(self, authorizer: Any) -> Any:
        """Whether this peer is reachable (swarm/reachability.py); the network options p2pd starts with."""
        import dataclasses

        from fusionnode.swarm.reachability import Reachability, Verdict, probe_before_start

        cfg = self.config
        net = cfg.network
        eff = net.resolve(list(cfg.listen))
        if eff["reachability"] == "local":
            verdict = Verdict("local", "loopback")
        elif net.reachability == "public":
            verdict = Verdict("public", "option")
        elif net.reachability == "private":
            verdict = Verdict("nat", "option")
        else:
            from fusionnode.swarm.reachability import ASK_TIMEOUT_S

            verdict = await probe_before_start(
                list(cfg.listen),
                list(cfg.initial_peers),
                make_transport=lambda p2p: Transport(p2p, rpc_timeout=ASK_TIMEOUT_S, authorizer=authorizer),
                startup_timeout=cfg.startup_timeout_s,
            )
        relays = list(net.relays) or (verdict.relays if verdict.state == "nat" else [])
        force = {"public": "public", "nat": "private"}.get(verdict.state, "auto")
        self.reach = Reachability(verdict, relays=relays, relay_service=bool(eff["relay_service"]))
        return dataclasses.replace(net, reachability=force, relays=tuple(relays))

    async def _start_direct(self) -> None:
        """The direct fast path (runtime/direct.py): a TLS listener on the listen address's host,
        advertised as `<ip>:<port>/tls/fusionnode-direct` in our record."""
        from fusionnode.runtime.direct import DIRECT_TAG, DirectPath
        from fusionnode.swarm.reachability import ip_of

        hosts = [ip_of(m) for m in self.config.listen if str(m).startswith("/ip4/")]
        host = next((h for h in hosts if h), "0.0.0.0")
        direct = DirectPath(self.identity.private_key, self.peer_id, host=host)
        await direct.start(self.transport._on_data_stream)
        ips = [ip for ip in dict.fromkeys(ip_of(m) for m in self.maddrs) if ip and ":" not in ip]
        if any(ip != "127.0.0.1" for ip in ips):
            ips = [ip for ip in ips if ip != "127.0.0.1"]
        if host != "0.0.0.0":
            ips = [host]
        self.transport.direct = direct
        self.direct_addrs = direct.addrs(ips[:4])  # in our record only (they are not libp2p addresses)
        self.membership.set_maddrs([*self.maddrs, *self.direct_addrs])

        def book(peer_id: str) -> list[str]:
            for rec in self.membership.known_peers():
                if rec.peer_id == peer_id:
                    return [m for m in rec.maddrs if m.endswith(DIRECT_TAG)]
            return []

        self.transport.direct_book = book

    async def _rpc_dialback(self, args: dict[str, Any], sender: str) -> dict[str, Any]:
        from fusionnode.swarm.reachability import answer_dialback, ip_of

        relays: list[str] = []
        if self.reach.relay_service and self.reach.state == "public":
            relays = [
                m
                for m in self.maddrs
                if "/p2p-circuit" not in m and ip_of(m) not in (None, "127.0.0.1", "::1") and "/p2p/" in m
            ]
        return await answer_dialback(self.p2p, sender, args, relays=relays)

    async def _watch_reachability(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.reach.refresh(self.p2p)
                await self.reach.keep_reservations(self.p2p)
                own = [m for m in self.maddrs if "/p2p-circuit" not in m]
                self.maddrs = [*self.reach.circuit_addrs, *own][:12]
                self.membership.set_maddrs([*self.maddrs, *self.direct_addrs])
            await asyncio.sleep(5.0)

    @property
    def peer_id(self) -> str:
        return str(self.identity.peer_id)

    def ready_line(self) -> str:
        return READY_PREFIX + json.dumps(
            {
                "peer_id": self.peer_id,
                "maddrs": self.maddrs,
                "control": str(self.config.control_path),
                "dashboard": self.dashboard_url,
                "libp2p": self.config.network.resolve(list(self.config.listen)),  # beyond the listen addrs
                "reachability": self.reach.status() if self.reach is not None else None,
                "dashboard_actions": self.dashboard.actions_url if self.dashboard is not None else None,
                "pid": os.getpid(),
                "version": fusionnode.__version__,
            }
        )

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            membership_task = tg.create_task(self.membership.run(), name="membership")
            worker_task = tg.create_task(self.worker.run(), name="worker")
            availability_task = tg.create_task(self.availability.run(), name="availability")
            reach_task = tg.create_task(self._watch_reachability(), name="reachability")
            await self._stop.wait()
            availability_task.cancel()  # before leaving, so a resume cannot re-advertise after the withdrawal
            await self.graceful_leave()
            membership_task.cancel()
            worker_task.cancel()
            reach_task.cancel()

    def stop(self) -> None:
        self._stop.set()

    async def graceful_leave(self) -> None:
        """Drains (steps in flight finish; new ones are refused with the code `leaving`), then waits,
        bounded, until the drivers have released this peer's stages: they learn of the leave from that
        refusal and re-plan, and the commit of a step already run still finds this peer here."""

        async def drain_and_wait_released() -> None:
            await self.worker.drain()
            while self.worker.jobs:
                await asyncio.sleep(0.1)

        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain_and_wait_released(), self.config.rpc_timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.membership.withdraw(), 5)

    async def shutdown(self) -> None:
        if self.dashboard is not None:
            await self.dashboard.close()
        if self.control is not None:
            await self.control.close()
        if self.transport is not None:
            await self.transport.close()
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
        if self.dht is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.dht.shutdown)
        self.lock.release()

    # ---- control API ---------------------------------------------------------------------------
    async def _rpc_peers(self, params: dict, emit) -> dict:
        peers = await self.membership.peers()
        return {
            "self": self.peer_id,
            "peers": [p.to_wire() for p in peers],
            "reachability": self.reach.status(),
        }

    async def _rpc_status(self, params: dict, emit) -> dict:
        peers = await self.membership.peers()
        return {
            "peer_id": self.peer_id,
            "maddrs": self.maddrs,
            "uptime_s": round(time.time() - self.started_at, 1),
            "roles": list(self.config.roles),
            "device": self.profile.to_dict()
            if hasattr(self.profile, "to_dict")
            else dict(vars(self.profile)),
            "peers": [p.to_wire() for p in peers],
            "serving": self.worker.status(),
            "hosting": self.host.status() if self.host is not None else [],
            "private_swarm": self.swarm_fingerprint,
            "availability": self.availability.status(),
            "security": self.transport.security_status(),
            "jobs": self.driver.status(),
            "reachability": self.reach.status(),
        }

    async def _rpc_leave(self, params: dict, emit) -> dict:
        asyncio.get_running_loop().call_later(0.2, self.stop)
        return {"leaving": True, "peer_id": self.peer_id}

    async def _on_availability(self, availability: str, next_window: str | None) -> None:
        """The owner came back (or left), a schedule window closed (or opened), or a manual pause/resume."""
        from fusionnode.availability.caps import free_accelerator_memory

        self.membership.set_availability(availability, next_window)  # planners skip a paused peer
        if availability == "paused":
            await self.worker.drain()  # steps in flight finish; new work is refused, so the driver re-plans
            self.worker.release_all()
            await asyncio.to_thread(free_accelerator_memory)
        else:
            self.worker.undrain()

    async def _rpc_set_link_limits(self, params: dict, emit) -> dict:
        """User-space bandwidth caps on this peer's tensor streams, per destination peer (bits/s; 0 = none),
        and `declared`: link bandwidths this peer is told but does not enforce (links shaped by tc), which
        the direct path's rule uses where no probe measured the link.

        Local control only: for testbeds."""
        limits = params.get("limits") or {}
        declared = params.get("declared") or {}
        if not isinstance(limits, dict) or not isinstance(declared, dict):
            raise ConfigError("limits and declared must map peer ids to bits per second")
        for peer, bps in limits.items():
            self.transport.set_rate_limit(str(peer), float(bps) if bps else None)
        for peer, bps in declared.items():  # shaped outside the daemon (tc): only told, not enforced
            if bps:
                self.transport.declared_bps[str(peer)] = float(bps)
            else:
                self.transport.declared_bps.pop(str(peer), None)
        return {
            "limited": len([v for v in limits.values() if v]),
            "declared": len(self.transport.declared_bps),
        }

    async def _rpc_train(self, params: dict, emit) -> dict:
        from fusionnode.train.spec import JobSpec

        job_id = JobSpec.from_dict(params.get("spec") or {}).job_id
        task = asyncio.current_task()
        if task is not None:
            self._job_tasks[job_id] = task
        try:
            return await self.driver.run_job(params, emit)
        except asyncio.CancelledError:
            if job_id not in self._cancelled:
                raise  # the client hung up, or the daemon stops
            if task is not None:
                task.uncancel()
            raise JobCancelled(f"job {job_id} was cancelled") from None
        finally:
            self._cancelled.discard(job_id)
            if self._job_tasks.get(job_id) is task:
                del self._job_tasks[job_id]

    async def _rpc_cancel(self, params: dict, emit) -> dict:
        """Cancels a job this node drives; returns once its stages are released."""
        job_id = str(params.get("job") or "")
        task = self._job_tasks.get(job_id)
        if task is None or task.done():
            running = sorted(self._job_tasks) or "none"
            raise ConfigError(f"no job {job_id!r} is running on this driver (running: {running})")
        self._cancelled.add(job_id)
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), self.config.rpc_timeout_s)
        job = self.driver.jobs.get(job_id)
        return {"job": job_id, "state": job.state if job is not None else "cancelled"}


async def run_node(config: NodeConfig, ready_out=None) -> int:
    """Runs a node until stopped; installs signal handlers (second signal exits at once)."""
    import signal

    loop = asyncio.get_running_loop()
    node = await Node.create(config)
    signals_seen = 0

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            logger.info("shutting down (send the signal again to exit at once)")
            node.stop()
        else:
            os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    out = ready_out or sys.stdout
    print(node.ready_line(), file=out, flush=True)
    try:
        await node.run()
    finally:
        await node.shutdown()
    return 0
