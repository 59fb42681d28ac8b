"""A small internet in network namespaces: a public segment and private segments behind NAT.

- ``pub``: a switch namespace holding a bridge; every "public" host hangs off it with an address
  in 198.51.100.0/24 (a documentation range that exists only inside these namespaces).
- each public host (a relay, a public peer) is a namespace with one veth to the bridge.
- each private segment is a router namespace (public side 198.51.100.x, private side 10.<k>.0.1/24,
  nftables masquerade on its public side, forwarding on) and one host namespace behind it
  (10.<k>.0.2, default route via the router).

Nothing here reaches the caller's namespace: every veth is created with both ends inside the new
namespaces, and no namespace has a route out. `close` kills what runs inside and deletes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid

PUBLIC_NET = "198.51.100"


def _run(*cmd: str, check: bool = False, inp: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, input=inp)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def skip_reason() -> str | None:
    """Why the NAT topology cannot be built here (None when it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs iproute2 (`ip`)"
    name = f"fnnat-probe-{os.getpid()}"
    if _run("ip", "netns", "add", name).returncode != 0:
        return "`ip netns add` failed (no CAP_SYS_ADMIN?)"
    _run("ip", "netns", "del", name)
    return None


def nft_missing() -> str | None:
    if not shutil.which("nft"):
        return "needs nftables (`apt-get install nftables`; .ci/run installs it)"
    return None


class NatTopology:
    def __init__(self) -> None:
        self.uid = uuid.uuid4().hex[:5]
        self.namespaces: list[str] = []
        self.hosts: dict[str, str] = {}  # name -> namespace
        self.addr: dict[str, str] = {}  # name -> its own address
        self._next_public = 10
        self._next_private = 1
        self.procs: list[subprocess.Popen] = []
        self.switch = self._ns("sw")
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", check=True)
        _run("ip", "-n", self.switch, "link", "set", "br0", "up", check=True)

    # ---- building -------------------------------------------------------------------------------
    def _ns(self, tag: str) -> str:
        ns = f"fnnat-{self.uid}-{tag}"
        _run("ip", "netns", "add", ns, check=True)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up", check=True)
        for key in ("all", "default"):
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
        return ns

    def _uplink(self, ns: str, tag: str) -> str:
        """A veth from `ns` (named eth0) to the switch's bridge; returns its public address."""
        ip = f"{PUBLIC_NET}.{self._next_public}"
        self._next_public += 1
        port = f"p-{tag}"[:15]
        _run(
            "ip",
            "-n",
            ns,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch,
            check=True,
        )
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", check=True)
        _run("ip", "-n", self.switch, "link", "set", port, "up", check=True)
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0", check=True)
        _run("ip", "-n", ns, "link", "set", "eth0", "up", check=True)
        return ip

    def add_public(self, name: str) -> str:
        ns = self._ns(name)
        self.hosts[name] = ns
        self.addr[name] = self._uplink(ns, name)
        return self.addr[name]

    def add_private(self, name: str) -> str:
        """A host behind its own NAT router; returns its private address."""
        k = self._next_private
        self._next_private += 1
        router = self._ns(f"{name}-gw")
        public_ip = self._uplink(router, f"{name}gw")
        host = self._ns(name)
        _run(
            "ip",
            "-n",
            host,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "lan0",
            "netns",
            router,
            check=True,
        )
        _run("ip", "-n", router, "addr", "add", f"10.{k}.0.1/24", "dev", "lan0", check=True)
        _run("ip", "-n", router, "link", "set", "lan0", "up", check=True)
        _run("ip", "-n", host, "addr", "add", f"10.{k}.0.2/24", "dev", "eth0", check=True)
        _run("ip", "-n", host, "link", "set", "eth0", "up", check=True)
        _run("ip", "-n", host, "route", "add", "default", "via", f"10.{k}.0.1", check=True)
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1", check=True)
        rules = (
            "table ip fnnat {\n"
            ' chain nat_out { type nat hook postrouting priority 100; oifname "eth0" masquerade; }\n'
            " chain filter_fwd { type filter hook forward priority 0; policy drop;\n"
            '  ct state established,related accept; iifname "lan0" oifname "eth0" accept; }\n'
            "}\n"
        )
        _run("ip", "netns", "exec", router, "nft", "-f", "-", check=True, inp=rules)
        self.hosts[name] = host
        self.addr[name] = f"10.{k}.0.2"
        self.addr[f"{name}-gw"] = public_ip
        return self.addr[name]

    # ---- running --------------------------------------------------------------------------------
    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[name], *argv], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def run(self, name: str, *argv: str) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.hosts[name], *argv)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for ns in reversed(self.namespaces):
            for pid in _run("ip", "netns", "pids", ns).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns)

    def __enter__(self) -> NatTopology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
