"""Check capabilities: which peers a job with checks on can use when versions are mixed (issue 20).

Two changes to the checks do not show in the wire's version, so a newer checker would read an older
honest peer's work as a lie and ban it:

- ``commit``: the commitment's hash. This version sends ``b3:`` + BLAKE3-128 hex
  (verify/commitment.py); older ones sent bare hex, BLAKE2b-128 and later BLAKE3-128 (both called
  ``b2`` here: either way unprefixed).
- ``dither``: the seeds of q8/q4 stochastic rounding on a compressing link. ``keyed``
  (compress/dither.py) lets the checker recompute them; ``counter`` (a per-link counter) is all an
  older peer knows. An older worker drops the ``dither`` link option it does not know and counts.

A peer advertises what it supports in its answer to ``job.ping`` with ``caps: true``
(`advertised`): ``{"commit": ["b3"], "dither": ["keyed", "counter"]}``. A peer from before this
refuses the unknown request field with ``bad_request``; that refusal (or a reply without ``caps``)
reads as `LEGACY`, the old capabilities. The driver asks before it plans a job with checks on
(`needs` says what the job's checks need) and leaves out the peers that lack it (`screen`), or
refuses a job whose explicitly named peers lack it, naming the peer and what it lacks. With checks
off nothing is asked and mixed versions work as before.

Each peer is asked once per plan (`one_ask_per_plan`): a plan looks for optimizer hosts up to three
times (are there any, which, and on resume which hold the shards) and for workers once; the answers
are kept for the plan, and the liveness ping that comes before each screen asks for them too
(`ping`), so the screen asks nobody again.

Why not the DHT peer record: protocol/RECORDS.md's schema refuses unknown fields at every level, so
a record with a new field would be refused by every older peer's validators and readers, and mixed
swarms would lose sight of each other even with checks off.

One capability is not the checks': ``steps``. ``queued`` (runtime/queued.py) means the worker takes a
fused ``job.step`` queued ahead (``after_step``) and ``job.withdraw``; an older worker refuses the
field, so the driver queues a replica's steps only when its workers advertise it (train/queued_rounds.py).
A job whose rounds close by time asks every liveness ping of its plan for the capabilities
(`one_ask_per_plan` with ``every_ping``), checks on or off: no ping more.

A test (and only a test) can make a daemon advertise another set: with ``FUSIONNODE_DEBUG=1``,
``FUSIONNODE_DEBUG_CAPS`` = ``legacy`` makes it answer like a peer from before (the ``caps`` field
refused), or a JSON object is advertised as given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from fusionnode.verify.commitment import COMMIT_ALG

logger = logging.getLogger(__name__)

# this version's
CAPS: dict[str, list[str]] = {"commit": [COMMIT_ALG], "dither": ["keyed", "counter"], "steps": ["queued"]}
LEGACY: dict[str, list[str]] = {"commit": ["b2"], "dither": ["counter"]}  # a peer that advertises none
DEBUG_CAPS_ENV = "FUSIONNODE_DEBUG_CAPS"  # tests: "legacy" or a JSON object (needs FUSIONNODE_DEBUG=1)
PING_TIMEOUT_S = 5.0
WHAT = {"commit": "the commitment hash", "dither": "the q8/q4 dither"}


def advertised(debug: bool = False) -> dict[str, list[str]] | None:
    """What this peer answers to ``job.ping`` with ``caps``; None: refuse the field as a peer from
    before the capabilities does. `debug` (the daemon runs with FUSIONNODE_DEBUG=1, runtime/hooks.py)
    lets `DEBUG_CAPS_ENV` set another answer: a test's older peer."""
    override = os.environ.get(DEBUG_CAPS_ENV) if debug else None
    if not override:
        return {k: list(v) for k, v in CAPS.items()}
    if override == "legacy":
        return None
    caps = json.loads(override)
    if not _valid(caps):
        raise ValueError(f"{DEBUG_CAPS_ENV} must be 'legacy' or a map of lists of strings, got {override!r}")
    return caps


def _valid(caps: Any) -> bool:
    return isinstance(caps, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
        for k, v in caps.items()
    )


def needs(verify_on: bool, compress: str | None, link_options: Mapping[str, Any] | None) -> dict[str, str]:
    """What a job's workers must support: nothing with checks off; with checks on the commitment
    hash, and on a compressing link with stochastic rounding the job's dither."""
    if not verify_on:
        return {}
    from fusionnode.compress.link import LinkOptions
    from fusionnode.compress.policy import parse_compress

    out = {"commit": COMMIT_ALG}
    opts = LinkOptions.from_dict(dict(link_options or {}))
    if parse_compress(str(compress or "none")).kind not in ("none", "fp16") and opts.stochastic:
        out["dither"] = opts.dither
    return out


def host_needs(job_needs: Mapping[str, str]) -> dict[str, str]:
    """What an optimizer host must support: the commitment hash (it digests the pushed gradients)."""
    return {k: v for k, v in job_needs.items() if k == "commit"}


def lacks(caps: Mapping[str, Sequence[str]], wanted: Mapping[str, str]) -> list[str]:
    """What of `wanted` a peer advertising `caps` lacks, in words (empty: it can take part)."""
    return [
        f"{WHAT.get(k, k)} {v!r} (it has {list(caps.get(k) or [])})"
        for k, v in sorted(wanted.items())
        if v not in (caps.get(k) or [])
    ]


# the plan's answers, peer -> caps (None: no answer); None outside a plan. A context variable, so two
# jobs planning at once on one driver (each its own task) keep their own
_ASKED: ContextVar[dict[str, Any] | None] = ContextVar("fusionnode_caps_asked", default=None)
_EVERY_PING: ContextVar[bool] = ContextVar("fusionnode_caps_every_ping", default=False)


@contextlib.contextmanager
def one_ask_per_plan(every_ping: bool = False) -> Iterator[dict[str, Any]]:
    """Within it each peer's capabilities are asked at most once (inside an outer one: that one's).
    It yields the answers, peer -> caps (None: no answer); they stay readable after it ends.
    `every_ping`: every liveness ping in it asks them, checks on or off (a job whose fused steps may
    queue ahead: the ``steps`` capability)."""
    asked = _ASKED.get()
    if asked is not None:
        yield asked
        return
    token, every = _ASKED.set({}), _EVERY_PING.set(every_ping)
    try:
        yield _ASKED.get()
    finally:
        _ASKED.reset(token)
        _EVERY_PING.reset(every)


def has(caps: Mapping[str, Sequence[str]] | None, key: str, value: str) -> bool:
    """Whether a peer's capabilities (None: unknown) advertise `value` under `key`."""
    return caps is not None and value in (caps.get(key) or [])


def _answer(r: Any) -> Any:
    """A peer's capabilities from its answer to `job.ping` with `caps` (a reply or the exception)."""
    from fusionnode.wire import job as jp

    if isinstance(r, jp.PingReply):
        return r.caps if _valid(r.caps) else dict(LEGACY)
    if isinstance(r, jp.JobError) and r.code == jp.ErrorCode.BAD_REQUEST and "caps" in str(r):
        return dict(LEGACY)  # "PingRequest: unknown field(s) ['caps']": an older version
    return None  # unreachable or timed out: its liveness is the caller's business


async def ping(t: Any, peer: str, ask: bool, timeout_s: float = PING_TIMEOUT_S) -> Any:
    """`job.ping` for liveness (the PingReply; raises as `jp.call` does). `ask` (a job with checks
    on, inside `one_ask_per_plan`): the same ping asks the capabilities the plan does not have yet
    and keeps them; an older peer's refusal of the field answers as a live peer that is not draining."""
    from fusionnode.wire import job as jp

    asked = _ASKED.get() if ask or _EVERY_PING.get() else None
    if asked is None or peer in asked:
        return await jp.call(t, peer, jp.Rpc.JOB_PING, jp.PingRequest(), timeout=timeout_s)
    try:
        r = await jp.call(t, peer, jp.Rpc.JOB_PING, jp.PingRequest(caps=True), timeout=timeout_s)
    except Exception as exc:
        if (caps := _answer(exc)) is None:
            raise
        asked[peer] = caps
        return jp.PingReply(alive=True, draining=False, jobs=0, stages=0, caps=caps)
    asked[peer] = _answer(r)
    return r


async def peer_caps(t: Any, peers: Sequence[str], timeout_s: float = PING_TIMEOUT_S) -> dict[str, Any]:
    """peer -> its advertised capabilities (`LEGACY` for a peer from before them); None for a peer
    that did not answer (its liveness is the caller's business). Inside `one_ask_per_plan` a peer
    already asked is not asked again."""
    from fusionnode.wire import job as jp

    async def one(p: str) -> Any:
        try:
            r = await jp.call(t, p, jp.Rpc.JOB_PING, jp.PingRequest(caps=True), timeout=timeout_s)
        except Exception as exc:
            return _answer(exc)
        return _answer(r)

    asked = _ASKED.get()
    if asked is None:
        asked = {}
    todo = [p for p in dict.fromkeys(peers) if p not in asked]
    asked.update(zip(todo, await asyncio.gather(*(one(p) for p in todo)), strict=True))
    return {p: asked[p] for p in peers}


def refusal(peer: str, role: str, what: Sequence[str]) -> str:
    return (
        f"{role} peer {peer} cannot take part in a job with checks on: it does not advertise "
        f"{'; '.join(what)}; it runs an older version of the checks (upgrade it, leave it out, or "
        "run the job with --verify-policy off)"
    )


async def screen(
    t: Any, peers: Sequence[str], wanted: Mapping[str, str], role: str, *, named: bool = False
) -> tuple[list[str], dict[str, str]]:
    """(the `peers` that support `wanted`, {peer left out: why}). `named`: the user named these
    peers, so one that lacks something refuses the job (ConfigError naming it and what it lacks)
    instead of being left out. Nothing is asked when `wanted` is empty (checks off)."""
    from fusionnode.errors import ConfigError

    if not wanted or not peers:
        return list(peers), {}
    caps = await peer_caps(t, peers)
    out = {p: refusal(p, role, miss) for p, c in caps.items() if c is not None and (miss := lacks(c, wanted))}
    if named and out:
        raise ConfigError(" | ".join(out.values()))
    for why in out.values():
        logger.warning("left out: %s", why)
    return [p for p in peers if p not in out], out


async def screen_joins(t: Any, job: Any, run: Any, ids: Sequence[str]) -> list[str]:
    """`ids` (a running job's live workers) less the new ones that lack what its checks need: those
    are marked gone for the job (never planned; no ban) with a "notice" event saying why."""
    new = [p for p in ids if p not in run.known and p not in run.gone]
    wanted = needs(run.checks is not None, job.spec.compress, run.params.get("link_options"))
    _kept, out = await screen(t, new, wanted, "worker")
    for p, why in sorted(out.items()):
        run.gone.add(p)
        await run.event(job, "notice", what="version_skew", peer=p, reason=why)
    return [p for p in ids if p not in out]


__all__ = [
    "CAPS",
    "DEBUG_CAPS_ENV",
    "LEGACY",
    "advertised",
    "has",
    "host_needs",
    "lacks",
    "needs",
    "one_ask_per_plan",
    "peer_caps",
    "ping",
    "refusal",
    "screen",
    "screen_joins",
]
