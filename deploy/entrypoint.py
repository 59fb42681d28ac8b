#!/usr/bin/env python3
"""Container entrypoint for deploy/compose.yaml: lets peers find the bootstrap peer's id.

    entrypoint.py bootstrap [join flags...]   runs `fusionnode join`, and when its ready line
        ("FUSIONNODE READY {json}") appears writes {"peer_id", "maddrs"} to $SHARED/bootstrap.json
    entrypoint.py join --bootstrap-host HOST [--bootstrap-port N] [join flags...]   waits for that
        file, resolves HOST to an IPv4 address and execs `fusionnode join --initial-peers
        /ip4/<addr>/tcp/<N>/p2p/<peer id> [join flags...]`

The bootstrap's identity lives in its state volume, so its peer id survives restarts; the file is
rewritten on each start anyway.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

READY_PREFIX = "FUSIONNODE READY "
SHARED = Path(os.environ.get("FUSIONNODE_SHARED", "/shared"))
WAIT_S = float(os.environ.get("FUSIONNODE_BOOTSTRAP_WAIT_S", "300"))  # seconds to wait for the bootstrap
DEFAULT_PORT = 31337


def bootstrap(flags: list[str]) -> int:
    out = SHARED / "bootstrap.json"
    out.unlink(missing_ok=True)
    proc = subprocess.Popen(["fusionnode", "join", *flags], stdout=subprocess.PIPE, text=True, bufsize=1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.startswith(READY_PREFIX):
            ready = json.loads(line[len(READY_PREFIX) :])
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"peer_id": ready["peer_id"], "maddrs": ready["maddrs"]}))
            tmp.replace(out)
    return proc.wait()


def join(argv: list[str]) -> int:
    host, port, flags = None, DEFAULT_PORT, []
    it = iter(argv)
    for a in it:
        if a == "--bootstrap-host":
            host = next(it)
        elif a == "--bootstrap-port":
            port = int(next(it))
        else:
            flags.append(a)
    if not host:
        sys.exit("entrypoint.py join: --bootstrap-host is required")
    src = SHARED / "bootstrap.json"
    deadline = time.monotonic() + WAIT_S
    while not src.exists():
        if time.monotonic() > deadline:
            sys.exit(f"entrypoint.py: no {src} after {WAIT_S:.0f} s; is the bootstrap service up?")
        time.sleep(0.5)
    peer_id = json.loads(src.read_text())["peer_id"]
    addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    maddr = f"/ip4/{addr}/tcp/{port}/p2p/{peer_id}"
    print(f"entrypoint.py: joining via {maddr}", flush=True)
    os.execvp("fusionnode", ["fusionnode", "join", "--initial-peers", maddr, *flags])
    return 0  # unreachable


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("bootstrap", "join"):
        sys.exit(__doc__)
    sys.exit(bootstrap(sys.argv[2:]) if sys.argv[1] == "bootstrap" else join(sys.argv[2:]))
