"""Is this peer reachable from the swarm, and how do the others reach it? (issue 22, SECURITY.md)

p2pd's AutoNAT keeps its verdict to itself (its control protocol has no query for it) and refuses to
dial back addresses outside the public unicast ranges, so FusionNode asks a peer itself: before the
node's own p2pd starts, a short-lived p2pd connects to the initial peers and calls ``reach.dialback``
on up to `MAX_ASKED` of them. The answering peer looks up the address it sees our connection come
from (p2pd's connection list: a NAT's public address for a peer behind NAT) and opens a plain TCP
connection to that address at our listen ports. Nobody answers on such a port behind a NAT (its
masquerade forwards only replies), so:

- ``public``: some peer dialed us back (or ``--reachability public``, or ``--relay``);
- ``nat``: peers answered and none could dial us back (``--reachability private`` says the same);
- ``relayed``: behind NAT, and a peer reached us through a relay (a ``/p2p-circuit`` connection) or
  p2pd advertises a relayed address;
- ``unknown``: no peer answered (a first peer, or one that could not reach its initial peers);
- ``local``: every listen address is loopback: nothing to find out.

Behind NAT the node's p2pd starts with AutoRelay on the trusted relays (``--relay-via``, else the
asked peers that said they relay), reachability forced private so AutoRelay reserves a slot at once,
and the node advertises ``<relay>/p2p-circuit/p2p/<self>`` in its record; a peer that cannot open a
stream to it dials those addresses (`connect_via`). p2pd has no option for hole punching (DCUtR):
relayed links stay relayed, with the relay's limits (`fusionnode.swarm.libp2p.RELAY_LIMITS`).

The answering side dials only the address the asker's own connection comes from, at most
`MAX_PORTS` ports, each once, with a short timeout (what AutoNAT does too): it cannot be used to make
a peer connect to a third party.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fusionnode.errors import PeerError, ProtocolError

logger = logging.getLogger(__name__)

DIALBACK_METHOD = "reach.dialback"
MAX_PORTS = 4  # ports one dial-back request may name
MAX_ASKED = 3  # peers asked at start
DIAL_TIMEOUT_S = 3.0  # seconds for one dial back
ASK_TIMEOUT_S = 15.0  # seconds for one peer's answer (it dials back meanwhile)
STATES = ("local", "public", "nat", "relayed", "unknown")


def tcp_ports(maddrs: Sequence[str]) -> list[int]:
    """The distinct TCP ports of multiaddrs (0 left out), in order."""
    ports: list[int] = []
    for m in maddrs:
        parts = str(m).split("/")
        for i, part in enumerate(parts[:-1]):
            if part == "tcp":
                with contextlib.suppress(ValueError):
                    port = int(parts[i + 1])
                    if 0 < port < 65536 and port not in ports:
                        ports.append(port)
    return ports


def ip_of(maddr: str) -> str | None:
    """The IP address of an ``/ip4/`` or ``/ip6/`` multiaddr that is not relayed; else None."""
    if "/p2p-circuit" in maddr:
        return None
    parts = str(maddr).split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(parts[2]))
    return None


def circuit_addrs(relays: Sequence[str], peer_id: str) -> list[str]:
    """The addresses at which others reach `peer_id` through each relay."""
    return [f"{r}/p2p-circuit/p2p/{peer_id}" for r in relays]


def relay_of(circuit: str) -> str:
    """The relay's multiaddr (``.../p2p/<relay>``) of a ``/p2p-circuit`` address."""
    return circuit.split("/p2p-circuit", 1)[0]


# ---- the answering side -------------------------------------------------------------------------------


async def observed_addrs(p2p: Any, peer_id: str) -> list[str]:
    """The remote addresses of p2pd's live connections to `peer_id`."""
    out: list[str] = []
    for info in await p2p.list_peers():
        if str(info.peer_id) == peer_id:
            out.extend(str(a) for a in info.addrs)
    return out


async def _dial(ip: str, port: int, timeout: float) -> bool:
    try:
        _r, w = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except (TimeoutError, OSError):
        return False
    w.close()
    with contextlib.suppress(Exception):
        await w.wait_closed()
    return True


async def answer_dialback(
    p2p: Any,
    sender: str,
    args: dict[str, Any],
    *,
    relays: Sequence[str] = (),
    timeout: float = DIAL_TIMEOUT_S,
) -> dict[str, Any]:
    """``reach.dialback``: dial `sender` back at the address its connection comes from."""
    ports = args.get("ports")
    if (
        not isinstance(ports, list)
        or not 0 < len(ports) <= MAX_PORTS
        or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
    ):
        raise ProtocolError(f"reach.dialback wants 1..{MAX_PORTS} TCP ports, got {ports!r:.80}")
    seen = await observed_addrs(p2p, sender)
    ips = list(dict.fromkeys(ip for ip in (ip_of(a) for a in seen) if ip is not None))
    if not ips:  # reached us through a relay only, or already gone: nothing to dial
        return {"observed": [str(a) for a in seen][:4], "tried": [], "reached": [], "relays": list(relays)}
    ip = ips[0]
    results = await asyncio.gather(*(_dial(ip, p, timeout) for p in dict.fromkeys(ports)))
    reached = [p for p, ok in zip(dict.fromkeys(ports), results, strict=True) if ok]
    return {
        "observed": [ip],
        "tried": [f"{ip}:{p}" for p in dict.fromkeys(ports)],
        "reached": reached,
        "relays": list(relays),
    }


# ---- the asking side ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    state: str  # one of STATES
    source: str  # how we know: "dial-back", "option", "loopback", "none answered"
    observed: list[str] = field(default_factory=list)  # addresses peers see us at
    asked: list[str] = field(default_factory=list)  # peers that answered
    relays: list[str] = field(default_factory=list)  # relays the answering peers offered
    reason: str = ""


async def ask_dialback(
    transport: Any, peers: Sequence[str], ports: Sequence[int], *, timeout: float = ASK_TIMEOUT_S
) -> Verdict:
    """Asks up to `MAX_ASKED` of `peers` (peer ids) to dial us back at `ports`; their verdict."""
    answers: list[tuple[str, dict[str, Any]]] = []
    errors: list[str] = []

    async def one(pid: str) -> None:
        try:
            res = await transport.call(pid, DIALBACK_METHOD, {"ports": list(ports)[:MAX_PORTS]}, timeout)
            answers.append((pid, res))
        except (TimeoutError, PeerError, ProtocolError, OSError) as exc:
            errors.append(f"{pid[:12]}…: {exc}")
        except Exception as exc:  # DeadlineError and the like: that peer did not answer
            errors.append(f"{pid[:12]}…: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(p) for p in list(dict.fromkeys(peers))[:MAX_ASKED]))
    relays: list[str] = []
    observed: list[str] = []
    for _pid, res in answers:
        for r in res.get("relays") or []:
            if isinstance(r, str) and "/p2p/" in r and r not in relays:
                relays.append(r)
        for o in res.get("observed") or []:
            if isinstance(o, str) and o not in observed:
                observed.append(o)
    asked = [pid for pid, _ in answers]
    if any(res.get("reached") for _pid, res in answers):
        return Verdict("public", "dial-back", observed, asked, relays)
    if any(res.get("tried") for _pid, res in answers):
        tried = sorted({t for _p, res in answers for t in res.get("tried") or []})
        return Verdict("nat", "dial-back", observed, asked, relays, reason=f"no answer at {', '.join(tried)}")
    return Verdict("unknown", "none answered", observed, asked, relays, reason="; ".join(errors)[:300])


async def probe_before_start(
    listen: Sequence[str],
    initial_peers: Sequence[str],
    *,
    make_transport: Any,
    startup_timeout: float = 30.0,
) -> Verdict:
    """Reachability of a node that has not started yet: a short-lived p2pd (random identity, nothing
    beyond its listen addresses) on `listen` asks the initial peers to dial it back, then stops.
    `make_transport(p2p)`: the node's Transport on that p2pd (its RPC calls, its swarm key)."""
    from fusionnode.config import LOCAL_ONLY
    from fusionnode.swarm.libp2p import create_p2p

    peers = [m.rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in m and "/p2p-circuit" not in m]
    if not peers:
        return Verdict("unknown", "none answered", reason="no initial peer to ask")
    t0 = time.monotonic()
    try:
        p2p = await create_p2p(
            list(listen),
            list(initial_peers),
            options=LOCAL_ONLY,
            startup_timeout=startup_timeout,
            idle_timeout=0,
        )
    except Exception as exc:
        return Verdict("unknown", "none answered", reason=f"could not reach the initial peers: {exc}"[:300])
    try:
        ports = tcp_ports([str(m) for m in await p2p.get_visible_maddrs()]) or tcp_ports(listen)
        transport = make_transport(p2p)
        verdict = await ask_dialback(transport, peers, ports[:MAX_PORTS])
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    logger.info(
        "reachability probe: %s (%s) in %.1f s%s",
        verdict.state,
        verdict.source,
        time.monotonic() - t0,
        f": {verdict.reason}" if verdict.reason else "",
    )
    return verdict


# ---- dialing a peer through its relay ---------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def circuit_maddr_bytes(circuit: str) -> bytes:
    """The binary multiaddr of ``<relay maddr>/p2p-circuit`` for p2pd's control protocol.

    hivemind's multiaddr package encodes ``/p2p/<id>`` as a CID where p2pd expects the bare multihash
    ("length greater than remaining number of bytes in buffer"), so the relay part is encoded here."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    relay = relay_of(circuit)
    base, _, relay_id = relay.rpartition("/p2p/")
    mh = PeerID.from_base58(relay_id).to_bytes()
    return Multiaddr(base).to_bytes() + _varint(421) + _varint(len(mh)) + mh + _varint(290)


async def connect_via(p2p: Any, peer_id: str, circuits: Sequence[str], timeout: float = 20.0) -> str:
    """Connects p2pd to `peer_id` through the first of its relayed addresses that works; returns it.
    PeerError with every reason when none does."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    reasons = []
    for circuit in circuits:
        if not circuit.endswith(f"/p2p/{peer_id}") or "/p2p-circuit" not in circuit:
            continue
        try:
            addr = Multiaddr(circuit_maddr_bytes(circuit))
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), [addr]), timeout)
            return circuit
        except Exception as exc:
            reasons.append(f"{relay_of(circuit)}: {str(exc).splitlines()[-1][:200]}")
    raise PeerError(f"no relay reached {peer_id[:12]}… ({'; '.join(reasons) or 'no relayed address'})")


# ---- a slot on a relay (circuit relay v2, RESERVE) -------------------------------------------------

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
HOP_STATUS = {
    100: "OK",
    200: "RESERVATION_REFUSED",
    201: "RESOURCE_LIMIT_EXCEEDED",
    202: "PERMISSION_DENIED",
    203: "CONNECTION_FAILED",
    204: "NO_RESERVATION",
    400: "MALFORMED_MESSAGE",
    401: "UNEXPECTED_MESSAGE",
}
MAX_HOP_MESSAGE = 4096  # bytes: the relay's answer to a reservation
RESERVE_TIMEOUT_S = 10.0


async def _read_varint(reader: asyncio.StreamReader) -> int:
    shift = value = 0
    for _ in range(10):
        (b,) = await reader.readexactly(1)
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value
        shift += 7
    raise ProtocolError("varint too long")


def _decode_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at `data[i:]` and the index after it."""
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _proto_fields(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields (varints as ints, length-delimited as bytes)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(data):
        key, i = _decode_varint(data, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _decode_varint(data, i)
            out.setdefault(num, []).append(v)
        elif wire == 2:
            n, i = _decode_varint(data, i)
            out.setdefault(num, []).append(data[i : i + n])
            i += n
        else:
            raise ProtocolError(f"unexpected protobuf wire type {wire}")
    return out


async def reserve(p2p: Any, relay: str, timeout: float = RESERVE_TIMEOUT_S) -> dict[str, Any]:
    """Reserves a slot for this peer on `relay` (``.../p2p/<relay id>``): afterwards the relay
    connects peers that dial ``<relay>/p2p-circuit/p2p/<us>`` to us. Returns the relay's terms
    (expiry, and its limits per relayed connection); PeerError with the reason when the relay cannot
    be reached or refuses (no relay service, no slot left)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, _, relay_id = relay.rpartition("/p2p/")
    pid = PeerID.from_base58(relay_id)

    async def go() -> dict[str, Any]:
        try:
            await p2p._client.connect(pid, [Multiaddr(base)])
        except Exception as exc:
            raise PeerError(
                f"relay {relay_id[:12]}… unreachable at {base}: {str(exc).splitlines()[-1][:200]}"
            ) from exc
        try:
            _info, reader, writer = await p2p.call_binary_stream_handler(pid, HOP_PROTOCOL)
        except Exception as exc:
            raise PeerError(
                f"relay {relay_id[:12]}… offers no relay service: {str(exc).splitlines()[-1][:200]}"
            ) from exc
        try:
            writer.write(b"\x02\x08\x00")  # HopMessage{type: RESERVE}, length-delimited
            await writer.drain()
            n = await _read_varint(reader)
            if n > MAX_HOP_MESSAGE:
                raise ProtocolError(f"relay answered {n} bytes")
            msg = _proto_fields(await reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError, IndexError) as exc:
            raise PeerError(f"relay {relay_id[:12]}… closed the reservation unanswered: {exc!r}") from exc
        finally:
            writer.close()
        status = (msg.get(5) or [0])[0]
        if status != 100:
            raise PeerError(f"relay {relay_id[:12]}… refused a slot: {HOP_STATUS.get(status, status)}")
        res = _proto_fields((msg.get(3) or [b""])[0])
        limit = _proto_fields((msg.get(4) or [b""])[0])
        return {
            "relay": relay,
            "expires_at": float((res.get(1) or [0])[0]),
            "limit_s": (limit.get(1) or [None])[0],
            "limit_bytes": (limit.get(2) or [None])[0],
        }

    try:
        return await asyncio.wait_for(go(), timeout)
    except TimeoutError:
        raise PeerError(
            f"relay {relay_id[:12]}… did not answer a reservation within {timeout:.0f} s"
        ) from None


# ---- the node's view --------------------------------------------------------------------------------


class Reachability:
    """What the node knows about its own reachability (for the start line, status and the dashboard),
    and the relayed addresses of the peers it talks to."""

    def __init__(
        self, verdict: Verdict, *, relays: Sequence[str] = (), peer_id: str = "", relay_service: bool = False
    ):
        self.verdict = verdict
        self.relays = list(relays)  # the relays this node holds (or asked for) a slot on
        self.peer_id = peer_id
        self.relay_service = relay_service
        self.circuit_addrs = (
            circuit_addrs(self.relays, peer_id) if verdict.state in ("nat", "relayed") else []
        )
        self.relayed_peers: dict[str, str] = {}  # peer id -> circuit address of a live relayed connection
        self.peer_circuits: dict[str, list[str]] = {}  # peer id -> its advertised relayed addresses
        self._dial_logged: set[str] = set()
        self.records: Any = None  # () -> the peer records membership knows (their advertised addresses)
        self.reservations: dict[str, dict[str, Any]] = {}  # relay maddr -> its terms
        self.connections: dict[str, list[str]] = {}  # peer id -> remote addresses of p2pd's connections
        self.relay_dials: dict[str, int] = {}  # peer id -> connections we opened to it through a relay
        self._reserve_logged: set[str] = set()

    @property
    def state(self) -> str:
        return self.verdict.state

    def line(self) -> str:
        """One line for the start of the log and the status."""
        v = self.verdict
        if v.state == "local":
            return "reachability: local (every listen address is loopback)"
        if v.state == "public":
            how = (
                "as told by --reachability/--relay"
                if v.source == "option"
                else f"a peer dialed us back at {', '.join(v.observed) or '?'}"
            )
            extra = "; relaying for peers behind NAT" if self.relay_service else ""
            return f"reachability: public ({how}){extra}"
        if v.state in ("nat", "relayed"):
            how = (
                "as told by --reachability private"
                if v.source == "option"
                else f"peers could not dial us back ({v.reason or 'no answer'})"
            )
            if not self.relays:
                return f"reachability: behind NAT ({how}); no relay known: only peers we dial reach us (name one with --relay-via)"
            state = "relayed" if v.state == "relayed" else "no relay slot (yet)"
            return f"reachability: behind NAT ({how}); {state} via {', '.join(r.rsplit('/p2p/', 1)[1][:12] + '…' for r in self.relays)}"
        return f"reachability: unknown ({v.reason or 'no peer answered a dial-back'})"

    async def keep_reservations(self, p2p: Any) -> None:
        """Behind NAT: holds a slot on each trusted relay, renewed before it expires. A relay that is
        unreachable or refuses is logged once with the reason; the others (or none) serve."""
        if self.verdict.state not in ("nat", "relayed"):
            return
        now = time.time()
        for relay in self.relays:
            held = self.reservations.get(relay)
            if held is not None and held["expires_at"] - now > 600:
                continue
            try:
                terms = await reserve(p2p, relay)
            except PeerError as exc:
                self.reservations.pop(relay, None)
                if relay not in self._reserve_logged:
                    self._reserve_logged.add(relay)
                    logger.warning("no slot on relay %s: %s", relay, exc)
                continue
            if relay not in self.reservations:
                logger.info(
                    "relay slot on %s: relayed connections limited to %s s and %s bytes each way",
                    relay,
                    terms["limit_s"],
                    terms["limit_bytes"],
                )
            self._reserve_logged.discard(relay)
            self.reservations[relay] = terms
        self.circuit_addrs = circuit_addrs([r for r in self.relays if r in self.reservations], self.peer_id)
        before = self.verdict.state
        self.verdict.state = "relayed" if self.reservations else "nat"
        if self.verdict.state != before:
            logger.info("%s", self.line())

    def note_relayed(self, peer_id: str, addr: str) -> None:
        self.relayed_peers[peer_id] = addr
        if self.verdict.state == "nat":
            self.verdict.state = "relayed"
            logger.info("%s", self.line())

    async def refresh(self, p2p: Any) -> None:
        """Marks the live connections that run through a relay (p2pd's connection list)."""
        live: dict[str, str] = {}
        conns: dict[str, list[str]] = {}
        for info in await p2p.list_peers():
            conns[str(info.peer_id)] = [str(a) for a in info.addrs]
            for a in info.addrs:
                if "/p2p-circuit" in str(a):
                    live[str(info.peer_id)] = str(a)
        self.connections = conns
        for pid, addr in live.items():
            if pid not in self.relayed_peers:
                self.note_relayed(pid, addr)
        for pid in [p for p in self.relayed_peers if p not in live]:
            del self.relayed_peers[pid]

    def is_relayed(self, peer_id: str) -> bool:
        return peer_id in self.relayed_peers

    def learn(self, peer_id: str, maddrs: Sequence[str]) -> None:
        circuits = [m for m in maddrs if "/p2p-circuit" in m and m.endswith(f"/p2p/{peer_id}")]
        if circuits:
            self.peer_circuits[peer_id] = circuits
        else:
            self.peer_circuits.pop(peer_id, None)
        if len(self.peer_circuits) > 4096:
            self.peer_circuits.pop(next(iter(self.peer_circuits)))

    async def dial(self, p2p: Any, peer_id: str) -> bool:
        """After a failed stream open: connects to `peer_id` through its relays if it advertised any.
        Logs once per peer which relay worked, or why none did."""
        if peer_id not in self.peer_circuits and self.records is not None:
            for rec in self.records():
                if rec.peer_id == peer_id:
                    self.learn(peer_id, rec.maddrs)
        circuits = self.peer_circuits.get(peer_id)
        if not circuits:
            return False
        try:
            addr = await connect_via(p2p, peer_id, circuits)
        except PeerError as exc:
            if peer_id not in self._dial_logged:
                self._dial_logged.add(peer_id)
                logger.warning("cannot reach %s directly nor through its relays: %s", peer_id[:12], exc)
            return False
        if peer_id not in self._dial_logged:
            self._dial_logged.add(peer_id)
            logger.info("reaching %s through relay %s", peer_id[:12], relay_of(addr))
        self.relayed_peers[peer_id] = addr
        self.relay_dials[peer_id] = self.relay_dials.get(peer_id, 0) + 1
        if len(self.relay_dials) > 4096:
            self.relay_dials.pop(next(iter(self.relay_dials)))
        return True

    def status(self) -> dict[str, Any]:
        from fusionnode.swarm.libp2p import RELAY_LIMITS

        v = self.verdict
        return {
            "state": v.state,
            "source": v.source,
            "line": self.line(),
            "observed": list(v.observed),
            "relays": list(self.relays),
            "circuit_addrs": list(self.circuit_addrs),
            "relayed_peers": sorted(self.relayed_peers),
            "relay_dials": dict(self.relay_dials),
            "connections": {p: list(a) for p, a in list(self.connections.items())[:64]},
            "relay_service": self.relay_service,
            "relay_limits": dict(RELAY_LIMITS),
            "reservations": {r: dict(t) for r, t in self.reservations.items()},
            "hole_punching": "not available in the shipped p2pd (no DCUtR option); relayed links stay relayed",
        }
