"""No packet leaves the machine from a loopback daemon: a capture in network namespaces, with a
positive control (hivemind's defaults) that shows the capture sees discovery traffic.

Each daemon runs in a namespace of its own whose only link, and default route, is a veth to a
capture namespace; tcpdump there records every packet the daemon's namespace sends, starting before
the daemon does. Addresses are TEST-NET ones (192.0.2.0/24, 198.51.100.0/24) that exist only inside
these namespaces; the capture namespaces have no other link and do not forward, so nothing the
daemons send goes further.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

WINDOW_S = 25.0  # seconds each daemon runs while the capture records
READY_TIMEOUT_S = 20.0  # the guarded daemon must be up well inside the window
REPO = Path(__file__).resolve().parent.parent
DISCOVERY = re.compile(r"239\.255\.255\.250\.1900|\.5351: ")  # SSDP multicast, NAT-PMP to the gateway

CONTROL_SCRIPT = """
import sys, time
from hivemind.dht import DHT  # hivemind's defaults: NAT port mapping, AutoNAT and relays on
dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, startup_timeout=30)
print("CONTROL UP", flush=True)
time.sleep(float(sys.argv[1]))
dht.shutdown()
"""


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs iproute2 (`ip`)"
    if not shutil.which("tcpdump"):
        return "needs tcpdump (`apt-get install tcpdump`; .ci/run installs it)"
    name = f"fnguard-probe-{os.getpid()}"
    if _run("ip", "netns", "add", name).returncode != 0:
        return "`ip netns add` failed (no CAP_SYS_ADMIN?)"
    _run("ip", "netns", "del", name)
    return None


class CapturedNamespace:
    """Namespace `daemon` (loopback, plus a veth whose far end is its default gateway) and namespace
    `capture` holding that far end, where tcpdump records what arrives from `daemon`."""

    def __init__(self, tag: str, subnet: str, workdir: Path):
        uid = uuid.uuid4().hex[:6]
        self.daemon = f"fng-{tag}-d-{uid}"
        self.capture = f"fng-{tag}-c-{uid}"
        self.subnet = subnet  # first three octets of a /24 that exists only in these namespaces
        self.pcap = workdir / f"{tag}.pcap"
        self.procs: list[subprocess.Popen] = []
        self._tcpdump: subprocess.Popen | None = None

    def __enter__(self) -> CapturedNamespace:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ip(self, *args: str) -> None:
        out = _run("ip", *args)
        if out.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def _setup(self) -> None:
        d, c = self.daemon, self.capture
        for ns in (d, c):
            self._ip("netns", "add", ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            # IPv6 off: the kernel's own router solicitations would otherwise show up in the capture
            for key in ("all", "default"):
                subprocess.run(
                    ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                    check=True,
                )
        subprocess.run(["ip", "netns", "exec", c, "sysctl", "-qw", "net.ipv4.ip_forward=0"], check=True)
        # both ends are made inside the namespaces: nothing appears in the caller's namespace
        self._ip("-n", d, "link", "add", "eth0", "type", "veth", "peer", "name", "cap0", "netns", c)
        self._ip("-n", d, "addr", "add", f"{self.subnet}.2/24", "dev", "eth0")
        self._ip("-n", c, "addr", "add", f"{self.subnet}.1/24", "dev", "cap0")
        self._ip("-n", d, "link", "set", "eth0", "up")
        self._ip("-n", c, "link", "set", "cap0", "up")
        self._ip("-n", d, "route", "add", "default", "via", f"{self.subnet}.1")
        links = _run("ip", "-n", c, "-o", "link").stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, re.M)) == ["cap0", "lo"], links
        # -Q in: only what arrives from the daemon's namespace; -U: each packet written as it comes
        tcpdump = ["tcpdump", "-i", "cap0", "-n", "-U", "-Q", "in", "-Z", "root", "-w", str(self.pcap)]
        self._tcpdump = subprocess.Popen(
            ["ip", "netns", "exec", c, *tcpdump],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._tcpdump.stderr.readline()  # "listening on cap0, ..." once it captures
        if "listening on" not in line:
            raise RuntimeError(f"tcpdump did not start: {line.strip()}")

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.daemon, *argv], start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def packets(self) -> list[str]:
        """Stops the capture; every packet that arrived from the daemon's namespace, as text."""
        if self._tcpdump is not None and self._tcpdump.poll() is None:
            self._tcpdump.send_signal(signal.SIGINT)
            self._tcpdump.wait(10)
        out = _run("tcpdump", "-n", "-r", str(self.pcap))
        return [line for line in out.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        for proc in [*self.procs, self._tcpdump]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL) if proc in self.procs else proc.kill()
                proc.wait(10)
        for ns in (self.daemon, self.capture):
            for pid in _run("ip", "netns", "pids", ns).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns)


def _wait_ready(proc: subprocess.Popen, prefix: str, deadline: float) -> str | None:
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line[len(prefix) :]
        if not line and proc.poll() is not None:
            return None
    return None


def test_a_loopback_daemon_sends_no_packet_off_the_machine(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    from fusionnode.node import READY_PREFIX

    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSIONNODE_")}  # not conftest's
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (
        CapturedNamespace("guard", "192.0.2", tmp_path) as guard,
        CapturedNamespace("ctl", "198.51.100", tmp_path) as ctl,
    ):
        t0 = time.monotonic()
        # the control first: it only has to start p2pd, while the guarded daemon also profiles the device
        control = ctl.start(
            [sys.executable, "-c", CONTROL_SCRIPT, str(WINDOW_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        # a daemon exactly as a user starts one on loopback: no network flags, the `auto` rule applies
        log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115 - closed below
        join = [
            "join",
            "--state-dir",
            str(tmp_path / "state"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-probe",
        ]
        daemon = guard.start(
            [sys.executable, "-m", "fusionnode", *join],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        ready = _wait_ready(daemon, READY_PREFIX, t0 + READY_TIMEOUT_S)
        assert ready is not None, (
            f"the daemon did not come up in {READY_TIMEOUT_S} s: {(tmp_path / 'daemon.log').read_text()[-2000:]}"
        )
        libp2p = json.loads(ready)["libp2p"]
        assert libp2p["nat_port_map"] is False and libp2p["autonat"] is False, libp2p
        time.sleep(max(0.0, t0 + WINDOW_S - time.monotonic()))
        assert daemon.poll() is None, "the daemon exited during the window"
        assert control.poll() is None or control.returncode == 0, control.stdout.read()
        leaked, control_packets = guard.packets(), ctl.packets()
        log.close()

    assert leaked == [], f"a loopback daemon sent {len(leaked)} packet(s) off its machine:\n" + "\n".join(
        leaked[:20]
    )
    discovery = [p for p in control_packets if DISCOVERY.search(p)]
    assert discovery, (
        "positive control: hivemind's defaults sent no SSDP/NAT-PMP packet, so the capture proves nothing; "
        f"captured: {control_packets[:20]}"
    )


def test_only_the_options_helper_starts_p2pd():
    """p2pd starts through fusionnode.swarm.libp2p (`create_p2p`, `OptionsDHT`) alone, so every daemon
    the code, the benchmarks and the tests start gets explicit network options."""
    direct = re.compile(r"\bP2P\.create\(|(?<![\w.])DHT\(|\(\s*DHT\s*[,)]")
    allowed = {REPO / "fusionnode" / "swarm" / "libp2p.py", Path(__file__).resolve()}
    offenders = []
    for path in sorted([*(REPO / "fusionnode").rglob("*.py"), *(REPO / "tests").rglob("*.py")]):
        if path.resolve() in allowed:
            continue
        text = path.read_text()
        for m in direct.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            offenders.append(f"{path.relative_to(REPO)}:{n}: {text.splitlines()[n - 1].strip()}")
    assert offenders == [], "start p2pd with fusionnode.swarm.libp2p instead:\n" + "\n".join(offenders)


def test_auto_is_off_exactly_when_every_listen_address_is_loopback():
    from fusionnode.config import LOCAL_ONLY, NetworkOptions, is_loopback

    assert all(map(is_loopback, ["/ip4/127.0.0.1/tcp/0", "/ip4/127.8.0.1/tcp/1", "/ip6/::1/tcp/0"]))
    assert is_loopback("/dns/localhost/tcp/1") and not is_loopback("/ip4/0.0.0.0/tcp/31337")
    assert not is_loopback("/ip4/10.77.0.1/tcp/1") and not is_loopback("/ip6/::/tcp/1")
    auto = NetworkOptions()
    local = auto.resolve(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert (local["nat_port_map"], local["autonat"]) == (False, False)
    public = auto.resolve(["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/31337"])
    assert public == {
        "nat_port_map": True,
        "autonat": True,
        "relay_client": True,
        "relay_service": False,
        "dht_mode": "server",
        "reachability": "auto",  # found out at start by a dial-back (issue 22)
        "relays": [],
        "direct": True,
    }
    off = LOCAL_ONLY.resolve(["/ip4/0.0.0.0/tcp/31337"])  # explicit off wins over a public address
    assert (off["nat_port_map"], off["autonat"], off["relay_service"]) == (False, False, False)
    assert NetworkOptions(nat_port_map="on").resolve(["/ip4/127.0.0.1/tcp/0"])["nat_port_map"] is True


def test_every_p2pd_gets_the_flags_including_the_identity_probe():
    """p2pd's command line carries the resolved flags, -relayService too (P2P.create has no parameter
    for it); the anonymous p2pd that P2P.create starts to check an identity gets everything off."""
    from fusionnode.config import NetworkOptions
    from fusionnode.swarm import libp2p

    public = ["/ip4/0.0.0.0/tcp/31337"]
    cls = libp2p._p2p_class(libp2p.daemon_flags(NetworkOptions(relay_service=True), public))
    args = cls._make_process_args("p2pd", natPortMap=False, autonat=False, relay=True)
    assert {"-natPortMap=1", "-autonat=1", "-relay=1", "-relayService=1"} <= set(args)
    probe = libp2p._p2p_class(libp2p._PROBE_FLAGS)
    args = probe._make_process_args("p2pd", natPortMap=True, autonat=True, relay=True)  # hivemind's defaults
    assert {"-natPortMap=0", "-autonat=0", "-relayService=0"} <= set(args)
    kwargs = libp2p.p2p_kwargs(NetworkOptions(dht_mode="client"), ["/ip4/127.0.0.1/tcp/0"])
    assert kwargs == {
        "nat_port_map": False,
        "auto_nat": False,
        "use_relay": True,
        "use_auto_relay": False,
        "dht_mode": "client",
    }


def test_join_shows_the_options_with_their_sources_and_rejects_a_bad_combination(tmp_path):
    from fusionnode.cli import build_parser
    from fusionnode.settings import show_config

    env = {"FUSIONNODE_STATE_DIR": str(tmp_path), "FUSIONNODE_AUTONAT": "off"}
    text = show_config(build_parser, ["join", "--relay-service", "on"], env=env, as_json=True)
    opts = json.loads(text)["options"]
    assert opts["nat_port_map"] == {"value": "auto", "source": "default"}
    assert opts["autonat"] == {"value": "off", "source": "env"}
    assert opts["relay_service"] == {"value": "on", "source": "flag"}
    assert opts["relay_client"]["value"] == "on" and opts["dht_mode"]["value"] == "server"
    bad = ["--relay-client", "off", "--relay-service", "on"]
    out = subprocess.run(
        [sys.executable, "-m", "fusionnode", "join", "--state-dir", str(tmp_path), *bad],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 2 and "relay service needs the relay client" in out.stderr, out.stderr
