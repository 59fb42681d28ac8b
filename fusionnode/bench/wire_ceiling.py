"""`fusionnode bench wire`'s ceiling section: what TLS 1.3 itself allows against plain TCP here.

Two bare blocking socket pairs on 127.0.0.1, one plain TCP and one TLS 1.3 set up by the direct
path's own handshake (runtime/direct.py `dial_blocking` / `accept_blocking`, both libp2p identities
checked), with the same structure: a sender thread `sendall`s 1 MiB views, this thread `recv_into`s
one reusable buffer. No event loop, no framing, no I/O threads: the TLS/TCP ratio is the most the
direct path can reach with Python's ssl on this machine (TLS 1.3 cipher suites cannot be chosen
from Python, and without kernel TLS every byte is encrypted and decrypted in user space). The two
pairs take turns transfer by transfer; median of CEILING_REPEATS after one warm-up each. Both ends
run in this process, so the CPU per MiB counts sender and receiver together.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

MIB = 1 << 20
CEILING_REPEATS = 5
TIMEOUT_S = 120.0  # for the handshake and for any one send or receive


def _pairs() -> dict[str, tuple[socket.socket, socket.socket]]:
    """{"tcp": (sender, receiver), "tls": (sender, receiver)}, connected on loopback."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from fusionnode.runtime.direct import DirectIdentity, accept_blocking, dial_blocking
    from fusionnode.swarm.identity import peer_id_from_public_key

    keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
    ids = [peer_id_from_public_key(k.public_key()).to_base58() for k in keys]
    listener_ident, dialer_ident = DirectIdentity(keys[0], ids[0]), DirectIdentity(keys[1], ids[1])
    pairs = {}
    for name in ("tcp", "tls"):
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            srv.settimeout(TIMEOUT_S)
            port = srv.getsockname()[1]
            accepted: dict[str, Any] = {}

            def serve(
                name: str = name, srv: socket.socket = srv, accepted: dict[str, Any] = accepted
            ) -> None:
                try:
                    raw, _ = srv.accept()
                    accepted["sock"] = accept_blocking(listener_ident, raw)[0] if name == "tls" else raw
                except Exception as exc:  # reported below, on this thread's caller
                    accepted["error"] = exc

            t = threading.Thread(target=serve, name=f"bench-ceiling-accept-{name}", daemon=True)
            t.start()
            if name == "tls":
                sender = dial_blocking(dialer_ident, "127.0.0.1", port, ids[0], TIMEOUT_S)
            else:
                sender = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
            t.join(TIMEOUT_S)
            if "sock" not in accepted:
                sender.close()
                raise RuntimeError(f"ceiling {name} pair did not connect: {accepted.get('error')!r}")
        for s in (sender, accepted["sock"]):
            s.settimeout(TIMEOUT_S)
        pairs[name] = (sender, accepted["sock"])
    return pairs


def _transfer(sender: socket.socket, receiver: socket.socket, total: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) for `total` bytes, sent in 1 MiB views by a thread."""
    failed: list[BaseException] = []

    def send() -> None:
        view = memoryview(bytes(MIB))
        try:
            for offset in range(0, total, MIB):
                sender.sendall(view[: min(MIB, total - offset)])
        except BaseException as exc:
            failed.append(exc)

    buf = memoryview(bytearray(MIB))
    st = threading.Thread(target=send, name="bench-ceiling-send", daemon=True)
    start, cpu0 = time.perf_counter(), time.process_time()
    st.start()
    got = 0
    while got < total:
        n = receiver.recv_into(buf, min(MIB, total - got))
        if not n:
            raise ConnectionError(f"ceiling pair closed {total - got} bytes early")
        got += n
    st.join(TIMEOUT_S)
    if failed:
        raise failed[0]
    return time.perf_counter() - start, time.process_time() - cpu0


def bench_ceiling(sizes_mib: tuple[int, ...], repeats: int = CEILING_REPEATS) -> list[dict[str, Any]]:
    """Per size: plain TCP and TLS 1.3 MiB/s and CPU ms/MiB (medians) and TLS/TCP."""
    pairs = _pairs()
    rows = []
    try:
        for mib in sizes_mib:
            total = mib * MIB
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
            for i in range(repeats + 1):  # the first round warms up; the order alternates
                for name in ("tcp", "tls") if i % 2 == 0 else ("tls", "tcp"):
                    result = _transfer(*pairs[name], total)
                    if i > 0:
                        runs[name].append(result)
            row: dict[str, Any] = {"size_mib": mib, "repeats": repeats}
            for name, r in runs.items():
                row[f"{name}_mib_s"] = mib / statistics.median(dt for dt, _ in r)
                row[f"{name}_cpu_ms_per_mib"] = statistics.median(cpu for _, cpu in r) * 1e3 / mib
            row["tls_ratio_to_tcp"] = row["tls_mib_s"] / row["tcp_mib_s"]
            rows.append(row)
    finally:
        for pair in pairs.values():
            for s in pair:
                s.close()
    return rows


def add_direct_ratios(ceiling: list[dict[str, Any]], streams: list[dict[str, Any]]) -> None:
    """Puts the direct path's steady ratio to TCP (raw and framed, same size) beside each ceiling row."""
    for row in ceiling:
        for r in streams:
            if r["transport"] == "direct" and r["mode"] == "steady" and r["size_mib"] == row["size_mib"]:
                row[f"direct_steady_{r['payload']}_ratio_to_tcp"] = r["ratio_to_tcp"]


def print_ceiling(rows: list[dict[str, Any]]) -> None:
    print("TLS ceiling: bare blocking socket pairs on loopback (sender thread sendall, receiver recv_into),")
    print(
        f"  plain TCP vs TLS 1.3 with the direct path's handshake; median of {rows[0]['repeats']}, interleaved"
    )
    print(f"{'size':>6} {'tcp':>7} {'cpu':>5} | {'tls':>7} {'cpu':>5} | {'TLS/TCP':>7}")
    for r in rows:
        print(
            f"{r['size_mib']:>4}Mi {r['tcp_mib_s']:>7.0f} {r['tcp_cpu_ms_per_mib']:>5.2f} |"
            f" {r['tls_mib_s']:>7.0f} {r['tls_cpu_ms_per_mib']:>5.2f} | {r['tls_ratio_to_tcp']:>7.2f}"
        )
    print("  cpu: CPU ms per MiB of this process (sender and receiver both here); the streams' TCP reference")
    print("  (asyncio, two processes) is slower than a bare pair, so the direct ratio can exceed this one;")
    print(
        "  compare CPU: TLS adds (tls cpu - tcp cpu) per MiB, the direct path (cpu+rcpu) - tcp's (cpu+rcpu)"
    )
    for r in rows:
        if "direct_steady_raw_ratio_to_tcp" in r:
            print(
                f"  {r['size_mib']}Mi: direct/TCP steady {r['direct_steady_raw_ratio_to_tcp']:.2f} raw,"
                f" {r.get('direct_steady_framed_ratio_to_tcp', float('nan')):.2f} framed;"
                f" TLS itself/TCP (ceiling) {r['tls_ratio_to_tcp']:.2f}"
            )
