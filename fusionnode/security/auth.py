"""Message authentication for private swarms (protocol/SPEC.md, "Security"; SECURITY.md).

Every Call, Reply and TensorMessage between members of a private swarm carries an ``_auth`` map
(in ``Call.args``, ``Reply.result`` or ``TensorMessage.meta``)::

    {"v": 1, "ts": <unix time, float seconds>, "nonce": <16 random bytes>, "mac": <32 bytes>}

``mac`` is HMAC-SHA256 under a key derived from the swarm secret over: a domain tag, the sender's and
the receiver's peer ids, a context (the call's nonce for a Reply, the protocol for a stream preamble),
the message type, ``ts``, ``nonce`` and the complete wire frame of the message without ``_auth``
(header, envelope, every tensor payload). A receiver refuses a message whose MAC does not verify,
whose ``ts`` is outside a window around its clock, or whose nonce it has seen: an outsider can neither
forge nor replay, and a message made for one peer cannot be played to another.

The DHT's own RPCs (hivemind protobufs) are authenticated the same way by `DHTSwarmAuthorizer`,
through hivemind's `AuthorizerBase` hook (fields ``auth.time``, ``auth.nonce``, ``auth.signature``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase

from fusionnode.errors import ProtocolError
from fusionnode.security.keys import LABEL_DHT, LABEL_TRANSPORT, SwarmKey
from fusionnode.wire.limits import Limits
from fusionnode.wire.messages import Call, Reply, TensorMessage, frame_parts

logger = logging.getLogger(__name__)

AUTH_FIELD = "_auth"  # key of the tag inside Call.args / Reply.result / TensorMessage.meta
AUTH_VERSION = 1
NONCE_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256
DEFAULT_WINDOW_S = 30.0  # seconds: |receiver clock - ts| allowed
DEFAULT_NONCE_CACHE = 1 << 17  # nonces remembered (about 6 MiB); see NonceCache for overflow
DOMAIN_TRANSPORT = b"FNAUTH1\x00"
DOMAIN_DHT_REQUEST = b"FNDHTRQ1"
DOMAIN_DHT_RESPONSE = b"FNDHTRS1"
# Verification re-encodes the frame; a frame that passed the reader's limits must encode again.
_REENCODE_LIMITS = Limits(max_frame_bytes=1 << 62, max_tensor_elements=1 << 62, max_tensors=1 << 20)


class AuthenticationError(ProtocolError):
    """A message without a valid swarm MAC: outsider, forgery, replay, or a clock too far off."""


class NonceCache:
    """Nonces seen within the window, bounded.

    When full, the oldest entry is evicted and its timestamp becomes a floor: a message no newer than
    an evicted nonce's is refused, so eviction never reopens a replay (it may refuse a very late
    honest message under a flood, which is the safe side).
    """

    def __init__(self, capacity: int = DEFAULT_NONCE_CACHE, window_s: float = DEFAULT_WINDOW_S):
        if capacity < 1 or window_s <= 0:
            raise ValueError("capacity must be >= 1 and window_s > 0")
        self.capacity = capacity
        self.window_s = window_s
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> ts, in arrival order
        self.floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_add(self, nonce: bytes, ts: float, now: float) -> str | None:
        """None if fresh (and now remembered), else why it is refused."""
        if not math.isfinite(ts) or not abs(now - ts) <= self.window_s:  # NaN would pass `>` and be
            # expired at once, reopening its nonce
            return f"timestamp {ts - now:+.1f} s from this clock (window ±{self.window_s:.0f} s)"
        if ts <= self.floor:
            return "older than the replay cache remembers"
        if nonce in self._seen:
            return "replayed nonce"
        while self._seen:  # expire entries that left the window: they can no longer pass the ts check
            old_nonce, old_ts = next(iter(self._seen.items()))
            if old_ts >= now - self.window_s and len(self._seen) < self.capacity:
                break
            del self._seen[old_nonce]
            if old_ts >= now - self.window_s:
                self.floor = max(self.floor, old_ts)
        self._seen[nonce] = ts
        return None


@dataclasses.dataclass(frozen=True)
class AuthTag:
    ts: float
    nonce: bytes
    mac: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"v": AUTH_VERSION, "ts": self.ts, "nonce": self.nonce, "mac": self.mac}

    @classmethod
    def from_wire(cls, obj: Any) -> AuthTag:
        if not isinstance(obj, dict) or set(obj) != {"v", "ts", "nonce", "mac"}:
            raise AuthenticationError("malformed authentication tag")
        v, ts, nonce, mac = obj["v"], obj["ts"], obj["nonce"], obj["mac"]
        if v != AUTH_VERSION or isinstance(v, bool):
            raise AuthenticationError(f"authentication tag version {v!r}, this node speaks {AUTH_VERSION}")
        if not isinstance(ts, float) or ts != ts:
            raise AuthenticationError("authentication tag: ts must be a float")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise AuthenticationError(f"authentication tag: nonce must be {NONCE_BYTES} bytes")
        if not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
            raise AuthenticationError(f"authentication tag: mac must be {MAC_BYTES} bytes")
        return cls(ts, nonce, mac)


def _split(msg: Any) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
    """The map that carries the tag, and how to rebuild the message with another map."""
    if isinstance(msg, Call):
        return msg.args, lambda m: Call(msg.method, m)
    if isinstance(msg, Reply):
        return msg.result, lambda m: Reply(msg.ok, m, msg.error)
    if isinstance(msg, TensorMessage):
        return msg.meta, lambda m: TensorMessage(msg.kind, m, msg.tensors)
    raise AuthenticationError(f"{type(msg).__name__} cannot be authenticated")


def _lp(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


class SwarmAuthorizer:
    """Signs and verifies transport messages with the swarm secret (see the module docstring).

    `sign` returns a copy of the message with the tag; `verify` returns (message without the tag,
    its nonce) or raises AuthenticationError. Counters (`counters`) say what was refused and why.
    """

    def __init__(
        self,
        key: SwarmKey,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        nonce_cache: int = DEFAULT_NONCE_CACHE,
        clock: Callable[[], float] = time.time,
    ):
        self._key = key.derive(LABEL_TRANSPORT)
        self.fingerprint = key.fingerprint
        self.window_s = window_s
        self._clock = clock
        self._nonces = NonceCache(nonce_cache, window_s)
        self.counters: dict[str, int] = {"signed": 0, "verified": 0, "refused": 0}

    def _mac(
        self, stripped: Any, sender: str, receiver: str, context: bytes, ts: float, nonce: bytes
    ) -> bytes:
        h = hmac.new(self._key, DOMAIN_TRANSPORT, hashlib.sha256)
        h.update(_lp(sender.encode()) + _lp(receiver.encode()) + _lp(context))
        h.update(struct.pack(">Bd", stripped.TYPE, ts) + nonce)
        for part in frame_parts(stripped, limits=_REENCODE_LIMITS):
            h.update(part)
        return h.digest()

    def sign(self, msg: Any, sender: str, receiver: str, *, context: bytes = b"") -> Any:
        fields, rebuild = _split(msg)
        if AUTH_FIELD in fields:
            raise ProtocolError(f"message already carries {AUTH_FIELD!r}")
        ts = float(self._clock())
        nonce = secrets.token_bytes(NONCE_BYTES)
        mac = self._mac(msg, sender, receiver, context, ts, nonce)
        self.counters["signed"] += 1
        return rebuild({**fields, AUTH_FIELD: AuthTag(ts, nonce, mac).to_wire()})

    def verify(self, msg: Any, sender: str, receiver: str, *, context: bytes = b"") -> tuple[Any, bytes]:
        try:
            fields, rebuild = _split(msg)
            if AUTH_FIELD not in fields:
                raise AuthenticationError(f"unauthenticated {type(msg).__name__} (no swarm MAC)")
            tag = AuthTag.from_wire(fields[AUTH_FIELD])
            stripped = rebuild({k: v for k, v in fields.items() if k != AUTH_FIELD})
            try:
                want = self._mac(stripped, sender, receiver, context, tag.ts, tag.nonce)
            except ProtocolError as exc:
                raise AuthenticationError(f"message cannot be re-encoded for its MAC: {exc}") from exc
            if not hmac.compare_digest(want, tag.mac):
                raise AuthenticationError("bad swarm MAC (another swarm key, or a forged/altered message)")
            why = self._nonces.check_and_add(tag.nonce, tag.ts, self._clock())
            if why is not None:
                raise AuthenticationError(f"refused: {why}")
        except AuthenticationError:
            self.counters["refused"] += 1
            raise
        self.counters["verified"] += 1
        return stripped, tag.nonce

    def status(self) -> dict[str, Any]:
        return {"swarm_key": self.fingerprint, **self.counters, "nonces_cached": len(self._nonces)}


class DHTSwarmAuthorizer(AuthorizerBase):
    """hivemind DHT RPCs (ping, store, find) authenticated with the swarm secret.

    Requests carry time, a random nonce and HMAC(request); responses echo the nonce and carry
    HMAC(response). A servicer drops a request that fails (hivemind answers nothing), a client ignores
    a response that fails: a DHT node without the key can neither read nor write our records.
    """

    def __init__(
        self, key: SwarmKey, *, window_s: float = DEFAULT_WINDOW_S, nonce_cache: int = DEFAULT_NONCE_CACHE
    ):
        self._key = key.derive(LABEL_DHT)
        self.window_s = window_s
        self._nonces = NonceCache(nonce_cache, window_s)
        self.refused = 0

    def _mac(self, domain: bytes, proto: Any) -> bytes:
        return hmac.new(
            self._key, domain + proto.SerializeToString(deterministic=True), hashlib.sha256
        ).digest()

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = time.time()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._mac(DOMAIN_DHT_REQUEST, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        ok = hmac.compare_digest(self._mac(DOMAIN_DHT_REQUEST, request), signature)
        why = "bad MAC" if not ok else self._nonces.check_and_add(bytes(auth.nonce), auth.time, time.time())
        if why is not None:
            self.refused += 1
            logger.debug("DHT request refused: %s", why)
            return False
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(DOMAIN_DHT_RESPONSE, response)

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        ok = hmac.compare_digest(self._mac(DOMAIN_DHT_RESPONSE, response), signature)
        if not ok or auth.nonce != request.auth.nonce:
            self.refused += 1
            logger.debug("DHT response refused: %s", "bad MAC" if not ok else "nonce of another request")
            return False
        return True
