"""deploy/: static checks of the Docker, compose and systemd files, and a real 2-namespace testbed
with a 10 Mbit/s tbf link whose throughput is measured (root and `ip netns` only)."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _copy_sources(dockerfile: Path) -> list[str]:
    srcs = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            srcs += parts[:-1]
    return srcs


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles(name):
    df = DEPLOY / name
    text = df.read_text()
    assert re.search(r"^FROM \S+", text, re.M)
    assert re.search(r'^ENTRYPOINT \["fusionnode"\]', text, re.M)
    for src in _copy_sources(df):  # the build context is the repository root
        assert (ROOT / src).exists(), f"{name} copies {src}, which does not exist"
    if name == "Dockerfile":
        assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
        assert "python:3.11-slim" in text
    else:
        assert "pytorch/pytorch:" in text and "torch==" not in text  # keeps the base image's CUDA torch


def test_compose_file():
    yaml = pytest.importorskip("yaml", reason="PyYAML parses compose.yaml (it comes with hivemind)")
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"bootstrap", "worker1", "worker2", "worker3", "optimizer"} <= set(services)
    for name, svc in services.items():
        ctx = (DEPLOY / svc["build"]["context"]).resolve()
        dockerfile = re.sub(r"\$\{[A-Z_]+:-([^}]+)\}", r"\1", svc["build"]["dockerfile"])
        assert (ctx / dockerfile).is_file(), name
        assert svc["entrypoint"][-1] == "/opt/fusionnode/deploy/entrypoint.py"
        vols = dict(v.split(":", 1) for v in svc["volumes"])
        assert vols["shared"] == "/shared" and vols[f"{name}-state"] == "/var/lib/fusionnode"
        assert f"{name}-state" in doc["volumes"]
        cmd = svc["command"]
        if name == "bootstrap":
            assert cmd[0] == "bootstrap" and "/ip4/0.0.0.0/tcp/31337" in cmd
            assert "127.0.0.1:8080:8080" in svc["ports"]
        else:
            assert cmd[:3] == ["join", "--bootstrap-host", "bootstrap"], name
    assert services["optimizer"]["command"][-2:] == ["--role", "optimizer"]
    assert all(s["command"][-1] == "worker" for n, s in services.items() if n.startswith("worker"))
    # one state volume per peer: two daemons must never share an identity
    assert len({s["volumes"][1] for s in services.values()}) == len(services)


def test_entrypoint_publishes_and_reads_the_bootstrap_id(tmp_path):
    """Runs deploy/entrypoint.py for real, with a stand-in `fusionnode` executable on PATH that
    prints a ready line (bootstrap) or its own argv (join)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fusionnode"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = "--initial-peers" ]; then echo "ARGV $*"; exit 0; fi\n'
        'echo \'FUSIONNODE READY {"peer_id": "12D3KooWTest", "maddrs": ["/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWTest"],'
        ' "control": "/x", "pid": 1, "version": "0.1.0"}\'\n'
    )
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "FUSIONNODE_SHARED": str(tmp_path),
        "FUSIONNODE_BOOTSTRAP_WAIT_S": "5",
    }
    ep = str(DEPLOY / "entrypoint.py")
    out = subprocess.run(
        [sys.executable, ep, "bootstrap", "--role", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "FUSIONNODE READY" in out.stdout
    assert json.loads((tmp_path / "bootstrap.json").read_text())["peer_id"] == "12D3KooWTest"
    out = subprocess.run(
        [sys.executable, ep, "join", "--bootstrap-host", "localhost", "--role", "optimizer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "ARGV join --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooWTest --role optimizer" in out.stdout
    )


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "fusionnode.service").read_text())
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure"
    assert svc["StateDirectory"] == "fusionnode" and svc["DynamicUser"] == "yes"
    assert svc["ExecStart"].split()[:2] == ["/usr/local/bin/fusionnode", "join"]
    assert "FUSIONNODE_STATE_DIR=%S/fusionnode" in svc["Environment"]
    assert "PrivateDevices" not in svc  # GPUs must stay reachable
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in unit["Unit"]["After"]


def test_example_config_is_valid_for_join(tmp_path):
    """deploy/config.example.toml is accepted by the real CLI parser (options the CLI lacks
    today are commented out in it)."""
    from fusionnode.cli import build_parser
    from fusionnode.settings import layered_defaults

    parser = build_parser()
    layered_defaults(parser, ["join"], "join", env={"FUSIONNODE_CONFIG": str(DEPLOY / "config.example.toml")})
    args = parser.parse_args(["join"])
    assert args.listen == ["/ip4/0.0.0.0/tcp/31337"] and args.role == "worker,optimizer"


def test_testbed_script_syntax():
    bash = shutil.which("bash")
    assert bash is not None
    out = subprocess.run([bash, "-n", str(DEPLOY / "testbed.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"fnprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` does not work here (no CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""
SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf = b"x" * (1 << 16); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end: c.sendall(buf)
c.close()
"""


@pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))
def test_testbed_enforces_link_bandwidth(tmp_path):
    cluster = tmp_path / "two.json"
    cluster.write_text(
        json.dumps(
            {
                "version": 1,
                "name": "two",
                "devices": [
                    {"id": "a", "tflops": 0.1, "memory_gb": 1},
                    {"id": "b", "tflops": 0.1, "memory_gb": 1},
                ],
                "links": {"pairs": [{"a": "a", "b": "b", "bandwidth_gbps": 0.01}]},  # 10 Mbit/s
            }
        )
    )
    proc = subprocess.Popen(
        ["bash", str(DEPLOY / "testbed.sh"), str(cluster), "--no-daemons", "--workdir", str(tmp_path / "w")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the ready line (or EOF if the script failed)
        assert line.startswith("TESTBED READY "), proc.stderr.read() if proc.poll() is not None else line
        info = json.loads(line[len("TESTBED READY ") :])
        ns_a, ns_b = (d["netns"] for d in info["devices"])
        link = info["links"][0]
        assert link["bps_ab"] == link["bps_ba"] == 10_000_000
        assert link["addr_a"].startswith("10.77.") and link["addr_b"].startswith("10.77.")
        rx = subprocess.Popen(
            ["ip", "netns", "exec", ns_b, sys.executable, "-c", RECEIVER, link["addr_b"]],
            stdout=subprocess.PIPE,
            text=True,
        )
        port = rx.stdout.readline().strip()
        subprocess.run(
            ["ip", "netns", "exec", ns_a, sys.executable, "-c", SENDER, link["addr_b"], port, "3"],
            check=True,
            timeout=30,
        )
        n, secs = rx.stdout.readline().split()
        rx.wait(10)
        mbit_s = int(n) * 8 / float(secs) / 1e6
        print(f"tbf 10 Mbit/s link: measured {mbit_s:.2f} Mbit/s over {float(secs):.2f} s")
        assert 7.0 < mbit_s < 11.0
        # the caller's namespace has no 10.77.x.y address: the testbed stayed inside its namespaces
        assert "10.77." not in subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns_a not in names and ns_b not in names, "testbed.sh left its namespaces behind"
    assert proc.returncode == 143
