"""A verifier peer: the checks' recompute on a peer the driver names instead of its own check process.

On a machine of a few cores the recompute of the default checks (about 30 ms of CPU per step for the
benchmark's job) costs step time wherever it runs, even at idle priority (issue 20's note): it needs
a core, or a machine, the swarm does not use. `train --verifier PEER_ID` sends each checked stage's
audit to that peer (`verify.check`, protocol/SPEC.md 13.1), whose daemon serves checks
(`join --serve-checks`, `VerifierService`) and judges it in its own check process (train/checks.py)
exactly as the driver's would (verify/audit.py `judge_audit`); `local` judges on a thread of the
driver's daemon, `process` (the default) in its check process.

`RemoteVerifier` (the driver's side) streams the audit's chunks and the stage's parameters as data
messages first (a unary call over 4 MiB fails in p2pd), then calls. A verifier that cannot be
reached, refuses, or does not answer within its deadline is replaced by the local check process for
that check, with a warning (a `notice` event of the job), and is asked again only after RETRY_S:
the check's verdict comes later, never not at all, and the step goes on meanwhile (checks lag as
idle-priority ones already may, up to train/checks.py's MAX_LAG steps, then the step waits).

The verdict is as trusted as the peer that gives it (SECURITY.md): name only a peer you run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.wire import job as jp
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.job import ErrorCode, JobError, Rpc, TensorKind
from fusionnode.wire.messages import TensorMessage

logger = logging.getLogger(__name__)

VERIFIERS = ("process", "local")  # --verifier's words; anything else names a peer
RETRY_S = 60.0  # seconds a verifier that failed is not asked again (its checks run locally meanwhile)
REMOTE_DEADLINE_S = 30.0  # seconds one remote check may take, messages included, before the fallback
HURRY_S = 5.0  # seconds a remote check in flight still gets once a step waits for it (then the fallback)
HELD_BYTES = 1 << 30  # bytes of checks' messages a verifier holds until judged, all callers together
CHECK_BYTES = 512 << 20  # bytes of one check's messages at most (each message charged MSG_CHARGE more)
MSG_CHARGE = 4096  # bytes each held message counts on top of its payload (empty ones are bounded too)
HELD_S = 120.0  # seconds a check's messages are kept waiting for their call
WAIT_CAP_S = 60.0  # seconds a call waits for its messages at most, whatever its `wait_s`
MAX_RUNNING = 64  # checks a verifier judges, queues or waits for at once, all callers together
MSG_TENSORS = 200  # tensors per parameter message (the wire allows 256)
MSG_BYTES = 64 << 20  # payload bytes per parameter message (frames allow 256 MiB)


def check_verifier(value: str | None) -> str | None:
    """`--verifier`'s value checked: None (the default, process), process, local or a peer id;
    ConfigError otherwise."""
    from fusionnode.errors import ConfigError

    if value is None or value in VERIFIERS:
        return value
    if not (value.isalnum() and 16 <= len(value) <= 128):
        raise ConfigError(f"--verifier must be process, local or a peer id, got {value!r}")
    return value


def param_messages(
    job: str, ticket: int, stage: int, first: int, params: dict[str, torch.Tensor]
) -> list[TensorMessage]:
    """The stage's parameters as `verify_params` messages (raw), indices first, first + 1, ..."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in params.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and (len(groups[-1]) >= MSG_TENSORS or size + nbytes > MSG_BYTES):
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    groups = [g for g in groups if g]
    return [
        tensor_message(
            TensorKind.VERIFY_PARAMS,
            {"job": job, "step": ticket, "mb": first + i, "stage": stage},
            g,
            codec="raw",
        )
        for i, g in enumerate(groups)
    ]


class RemoteVerifier:
    """The driver's `run_elsewhere` (verify/verifier.py) that asks a verifier peer, with the local
    check process as its fallback. `pack` lends a shared buffer as the check process's does, so a
    check that falls back costs no second copy."""

    # one per check of this daemon: the data messages' key (from a random start: a restarted driver's
    # checks never meet its previous process's messages still held by the verifier)
    _tickets = iter(range(secrets.randbits(61), 1 << 62))
    # a broken fallback (its pool) fails that check only (verify/verifier.py recomputes it on a thread):
    # the verifier peer stays, and the next fallback runs in a new check process (train/checks.py)
    survives_broken_fallback = True

    def __init__(
        self,
        transport: Any,
        peer: str,
        job_id: str,
        fallback: Callable[[], Any],
        timeout_s: float | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.t = transport
        self.peer = peer
        self.job_id = job_id
        self.timeout_s = timeout_s or REMOTE_DEADLINE_S
        self.hurried_at: float | None = None  # since when a step waits for the checks (`urgent`)
        self._hurry: asyncio.Event | None = None  # set while it does: calls in flight shorten their wait
        self._make_fallback = fallback
        self._fallback: Any = None  # made at its first use (a process: not spawned while not needed)
        self.warn = warn
        self.down_until = 0.0  # monotonic time before which the verifier is not asked
        # checks the verifier judged, checks the fallback judged, the verifier's failures, the time its
        # checks took (messages included), and the payload bytes sent to it
        self.totals = {"remote": 0, "fallback": 0, "failures": 0, "remote_s": 0.0, "bytes": 0}

    def fallback(self) -> Any:
        if self._fallback is None:
            self._fallback = self._make_fallback()
        return self._fallback

    def pack(self, tensors: dict[str, torch.Tensor]) -> Any:
        from fusionnode.train.checks import _BUFFERS
        from fusionnode.verify.audit import pack_tensors

        return pack_tensors(tensors, _BUFFERS.take)

    def give(self, packed: Any) -> None:
        """`pack`'s buffer back, unused (the check was cancelled while it was being packed)."""
        from fusionnode.train.checks import _BUFFERS

        _BUFFERS.give(packed[0])

    @contextlib.contextmanager
    def urgent(self) -> Any:
        """While the step waits for the checks: a verifier call in flight gets HURRY_S more to answer,
        then its check runs in the fallback check process (at normal priority meanwhile, if any)."""
        urgent = getattr(self._fallback, "urgent", None)
        self.hurried_at = time.monotonic()
        if self._hurry is not None:
            self._hurry.set()
        try:
            with urgent() if urgent is not None else contextlib.nullcontext():
                yield
        finally:
            self.hurried_at = None
            if self._hurry is not None:
                self._hurry.clear()

    async def _ask(self, audit: Any, packed: Any) -> str:
        """The verifier's verdict, within `timeout_s`, or HURRY_S after a step started waiting for it
        (TimeoutError past either)."""
        if self._hurry is None:
            self._hurry = asyncio.Event()
        task = asyncio.ensure_future(self._remote(audit, packed))
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if self.hurried_at is not None:
                    left = min(left, self.hurried_at + HURRY_S - time.monotonic())
                if left <= 0:
                    raise TimeoutError(
                        f"no verdict within {self.timeout_s:.0f} s, or {HURRY_S:.0f} s once a step waited for it"
                    )
                # not hurried yet: woken when a step starts waiting (`urgent`); else just the deadline
                wake = asyncio.ensure_future(self._hurry.wait()) if self.hurried_at is None else None
                await asyncio.wait({task, wake} - {None}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if wake is not None:
                    wake.cancel()
                if task.done():
                    return task.result()
        finally:
            task.cancel()

    async def __call__(self, audit: Any, packed: Any) -> str:
        from fusionnode.train.checks import _BUFFERS

        if time.monotonic() >= self.down_until:
            t0 = time.perf_counter()
            try:
                verdict = await self._ask(audit, packed)
            except (TimeoutError, FusionNodeError, OSError) as exc:
                self._failed(exc)
            except BaseException:
                _BUFFERS.give(packed[0])  # cancelled (the step it checks is undone)
                raise
            else:
                _BUFFERS.give(packed[0])
                self.totals["remote"] += 1
                self.totals["remote_s"] += time.perf_counter() - t0
                return verdict
        self.totals["fallback"] += 1
        return await self.fallback()(audit, packed)  # gives the buffer back

    def _failed(self, exc: BaseException) -> None:
        self.totals["failures"] += 1
        first = time.monotonic() >= self.down_until
        self.down_until = time.monotonic() + RETRY_S
        what = str(exc) or type(exc).__name__
        text = (
            f"verifier peer {self.peer[:12]}… failed a check ({what[:200]}); checking in this daemon's "
            f"check process instead, asking it again in {RETRY_S:.0f} s"
        )
        logger.warning("%s", text)
        if first and self.warn is not None:
            self.warn(text)

    async def _remote(self, audit: Any, packed: Any) -> str:
        from fusionnode.verify.audit import join_payloads, unpack_tensors

        chunks, mine = join_payloads(audit.chunks, unpack_tensors(packed))
        a = audit.a
        ticket = next(RemoteVerifier._tickets)
        key = {"job": self.job_id, "step": ticket, "stage": a["stage"]}
        msgs = [
            TensorMessage(TensorKind.VERIFY_AUDIT, {**key, "mb": i}, dict(chunk))
            for i, chunk in enumerate(chunks)
        ]
        msgs += param_messages(self.job_id, ticket, a["stage"], len(chunks), mine)
        for msg in msgs:
            await self.t.send(self.peer, msg)
            self.totals["bytes"] += sum(len(e.data) for e in msg.tensors.values())
        req = jp.VerifyCheck(
            job=self.job_id,
            stage=a["stage"],
            step=audit.step,
            ticket=ticket,
            chunks=len(chunks),
            params=len(msgs) - len(chunks),
            assignment=_wire_map(a),
            commit=_wire_map(audit.commit),
            listed={str(k): list(v) for k, v in audit.listed.items()},
            src=audit.src,
            mbs=list(audit.mbs),
            grads=bool(audit.grads),
            losses=[float(x) for x in audit.losses],
            micro_batches=audit.m,
            rel_tol=float(audit.rel_tol),
            pushed=audit.pushed,
            link=_wire_map(audit.link) if audit.link is not None else None,
            wait_s=min(max(1.0, self.timeout_s), WAIT_CAP_S),
        )
        reply = await jp.call(self.t, self.peer, Rpc.VERIFY_CHECK, req, timeout=self.timeout_s)
        return reply.verdict


def _wire_map(value: Any) -> Any:
    """`value` with tuples as lists (what msgpack makes of them): the verifier sees what we hold."""
    if isinstance(value, dict):
        return {k: _wire_map(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wire_map(v) for v in value]
    return value


class VerifierService:
    """A daemon's `verify.check` (`join --serve-checks --serve-checks-for PEER[,PEER]`): holds the
    checks' data messages of the drivers in `allow` until their call, then judges the audit in the
    daemon's check process (train/checks.py). Other callers, and every caller without `serve`, are
    refused (`forbidden`) and their messages dropped, never held.

    Bounds (SECURITY.md): a check's messages count in `held_bytes` (payload plus MSG_CHARGE each)
    from their arrival until their check is judged, at most CHECK_BYTES a check and HELD_BYTES in
    all; at most MAX_RUNNING calls wait, queue or run at once; a call waits WAIT_CAP_S at most; and
    messages no call waits for are dropped HELD_S after they came (looked at on each message and
    each call)."""

    def __init__(self, transport: Any, serve: bool, allow: Collection[str] = ()) -> None:
        self.t = transport
        self.serve = serve
        self.allow = frozenset(allow)
        # per check: (arrival, its messages by index, the bytes they count)
        self.held: dict[tuple[str, str, int, int], tuple[float, dict[int, TensorMessage], int]] = {}
        self.held_bytes = 0  # held messages', and judging checks', bytes (MSG_CHARGE each included)
        self.dropped = 0
        self.checked = 0
        self.running = 0  # calls waiting for their messages, judging or queued for the check process
        self.lifted = False  # the check process at the normal policy (while checks run)
        self.refused: dict[tuple[str, str, int, int], float] = {}  # checks whose messages were dropped
        self._arrived: dict[tuple[str, str, int, int], asyncio.Event] = {}
        if serve:  # its check process started now: the first check does not wait for it (torch's import)
            from fusionnode.train.checks import CheckProcess

            CheckProcess("")
        transport.on_data(TensorKind.VERIFY_AUDIT, self._on_data)
        transport.on_data(TensorKind.VERIFY_PARAMS, self._on_data)
        jp.serve(transport, Rpc.VERIFY_CHECK, self.rpc_check)

    def _on_data(self, msg: TensorMessage, sender: str) -> None:
        if not self.serve or sender not in self.allow:
            self.dropped += 1
            return
        self._expire()
        m = msg.meta
        key = (sender, str(m["job"]), int(m["step"]), int(m["stage"]))
        mb = int(m["mb"])
        cost = sum(len(e.data) for e in msg.tensors.values()) + MSG_CHARGE
        at, msgs, kbytes = self.held.get(key, (time.monotonic(), {}, 0))
        old = msgs.get(mb)
        freed = sum(len(e.data) for e in old.tensors.values()) + MSG_CHARGE if old is not None else 0
        if (
            key in self.refused
            or not 0 <= mb < CHECK_BYTES // MSG_CHARGE
            or kbytes - freed + cost > CHECK_BYTES
            or self.held_bytes - freed + cost > HELD_BYTES
        ):
            self.dropped += 1  # its call is answered no_room at once
            self.refused[key] = time.monotonic()
            self._forget(key)
        else:
            msgs[mb] = msg
            self.held[key] = (at, msgs, kbytes - freed + cost)
            self.held_bytes += cost - freed
        event = self._arrived.get(key)
        if event is not None:
            event.set()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (at, _, _) in self.held.items() if now - at > HELD_S and k not in self._arrived]:
            self._forget(key)
        for key in [k for k, at in self.refused.items() if now - at > HELD_S]:
            del self.refused[key]

    def _forget(self, key: tuple[str, str, int, int]) -> None:
        _at, _msgs, nbytes = self.held.pop(key, (0.0, {}, 0))
        self.held_bytes -= nbytes

    async def _messages(
        self, key: tuple[str, str, int, int], n: int, wait_s: float
    ) -> tuple[dict[int, TensorMessage], int]:
        """The check's `n` messages and the bytes they count, still in `held_bytes` (the caller gives
        them back once the check is judged)."""
        deadline = time.monotonic() + wait_s
        event = self._arrived[key] = asyncio.Event()
        try:
            while len(self.held.get(key, (0.0, {}, 0))[1]) < n:
                if key in self.refused:
                    raise JobError(
                        ErrorCode.NO_ROOM, "this verifier holds too many unjudged checks' messages"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    got = len(self.held.get(key, (0.0, {}, 0))[1])
                    raise JobError(
                        ErrorCode.DEADLINE,
                        f"verify.check: {got} of its {n} messages arrived within {wait_s:.0f} s",
                    )
                event.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
            _at, msgs, nbytes = self.held.pop(key)
            return msgs, nbytes
        finally:
            self._arrived.pop(key, None)
            if key in self.held and len(self.held[key][1]) < n:
                self._forget(key)

    async def rpc_check(self, req: jp.VerifyCheck, sender: str) -> jp.VerifyCheckReply:
        if not self.serve:
            raise JobError(
                ErrorCode.FORBIDDEN, "this peer does not serve checks (fusionnode join --serve-checks)"
            )
        if sender not in self.allow:
            raise JobError(
                ErrorCode.FORBIDDEN, "this peer serves checks only for the drivers of its --serve-checks-for"
            )
        self._expire()
        key = (sender, req.job, req.ticket, req.stage)
        if key in self._arrived:
            raise JobError(ErrorCode.BAD_REQUEST, "verify.check: a call for this check waits already")
        if self.running >= MAX_RUNNING:
            self._forget(key)
            self.refused[key] = time.monotonic()  # its messages still to come are dropped
            raise JobError(ErrorCode.NO_ROOM, f"this verifier has {self.running} checks queued already")
        self.running += 1  # taken before the messages are awaited: waiting calls count
        nbytes = 0
        try:
            msgs, nbytes = await self._messages(key, req.chunks + req.params, min(req.wait_s, WAIT_CAP_S))
            audit, mine = self._audit(req, msgs, sender)
            self._priority()
            return await self._judge(sender, req, audit, mine)
        finally:
            self.held_bytes -= nbytes  # judged (or refused): its bytes given back only now
            self.running -= 1
            self._priority()

    def _audit(self, req: jp.VerifyCheck, msgs: dict[int, TensorMessage], sender: str) -> tuple[Any, Any]:
        """The call's AuditJob and the stage's parameters from its messages (bad_request if they do
        not fit the call)."""
        from fusionnode.verify.audit import AuditJob
        from fusionnode.verify.verifier import decode_shown

        n = req.chunks + req.params
        if sorted(msgs) != list(range(n)):
            raise JobError(
                ErrorCode.BAD_REQUEST, f"verify.check: messages {sorted(msgs)[:8]}… are not 0..{n - 1}"
            )
        kinds = [msgs[i].kind for i in range(n)]
        want = [TensorKind.VERIFY_AUDIT] * req.chunks + [TensorKind.VERIFY_PARAMS] * req.params
        if kinds != want:
            raise JobError(
                ErrorCode.BAD_REQUEST, "verify.check: the audit's chunks come first, then the parameters"
            )
        mine: dict[str, torch.Tensor] = {}
        for i in range(req.chunks, n):
            try:
                mine.update(decode_shown(msgs[i].tensors, None, sender))
            except FusionNodeError as exc:
                raise JobError(ErrorCode.BAD_REQUEST, f"verify.check: {exc}") from None
        audit = AuditJob(
            req.assignment, req.commit, req.listed, [dict(msgs[i].tensors) for i in range(req.chunks)],
            req.src, req.mbs, req.grads, req.pushed, req.losses, req.micro_batches, req.rel_tol, req.step,
            req.link,
        )  # fmt: skip
        return audit, mine

    def _priority(self) -> None:
        """The check process at the normal policy while checks are asked of it (a driver waits on each,
        and at idle priority a loaded machine would starve them), back at idle priority after."""
        from fusionnode.train.checks import CheckProcess, idle_priority, normal_priority

        pid = CheckProcess._pid
        if pid is None or (self.running > 0) == self.lifted:
            return
        if self.running > 0:
            self.lifted = normal_priority(pid)  # False where the OS does not allow it: asked again next time
        else:
            idle_priority(pid)
            self.lifted = False

    async def _judge(
        self, sender: str, req: jp.VerifyCheck, audit: Any, mine: dict[str, torch.Tensor]
    ) -> jp.VerifyCheckReply:
        from fusionnode.train.checks import CheckProcess
        from fusionnode.verify.audit import split_payloads

        t0 = time.perf_counter()
        # the caller's jobs apart from another caller's of the same id (the check process keeps modules per job)
        checker = CheckProcess(f"{sender}/{req.job}")
        light, payloads = split_payloads(audit.chunks)
        audit.chunks = light
        verdict = await checker(audit, checker.pack({**mine, **payloads}))
        self.checked += 1
        return jp.VerifyCheckReply(verdict=verdict, seconds=round(time.perf_counter() - t0, 6))


def verifier_warning(run: Any, job: Any) -> Callable[[str], None]:
    """`warn(text)` for a job's RemoteVerifier: a `notice` event of the job (what `verifier_down`)."""
    pending: set[asyncio.Task] = set()

    def warn(text: str) -> None:
        task = asyncio.ensure_future(run.event(job, "notice", what="verifier_down", reason=text))
        pending.add(task)
        task.add_done_callback(pending.discard)

    return warn


def verifier_totals(run_elsewhere: Any) -> dict[str, Any]:
    """The job result's `verifier` entry: checks judged by the verifier peer, by the fallback, and
    the peer's failures (empty without a verifier peer)."""
    if not isinstance(run_elsewhere, RemoteVerifier):
        return {}
    return {"verifier": {"peer": run_elsewhere.peer, **run_elsewhere.totals}}


def run_elsewhere(
    transport: Any, job_id: str, verifier: str | None, warn: Callable[[str], None] | None = None
) -> Any:
    """The job's `run_elsewhere` for `--verifier`: the daemon's check process (None or process),
    None for `local` (a thread of this daemon), else a RemoteVerifier of that peer."""
    from fusionnode.train.checks import CheckProcess

    verifier = check_verifier(verifier)
    if verifier in (None, "process"):
        return CheckProcess(job_id)
    if verifier == "local":
        return None
    return RemoteVerifier(transport, verifier, job_id, lambda: CheckProcess(job_id), warn=warn)


__all__ = [
    "VERIFIERS",
    "RemoteVerifier",
    "VerifierService",
    "check_verifier",
    "run_elsewhere",
    "verifier_totals",
    "verifier_warning",
]
