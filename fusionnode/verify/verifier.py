"""The driver's side of spot-checks: cross-check the commitments, pick micro-batches, recompute, compare.

After every stage of a step has reported (each report carries its commitments: the digest of its
parameters and of each micro-batch's received and sent messages), and before the step reaches the
optimizer, the driver:

1. cross-checks each link: what stage i says it sent must be what stage i+1 says it received (and
   what the driver fed the first and last stages). A disagreement is a dispute between two peers:
   both are checked on that micro-batch; if neither fails, the step is replayed and nobody is banned.
2. draws the checked micro-batches (selector.CheckSelector, unpredictable before the reports),
3. asks each checked stage's worker for those micro-batches' messages (`job.audit`), refuses any whose
   digest differs from the commitment, takes the stage's parameters from `params_for` (the optimizer
   hosts with offload: the truth, not the worker's word) and refuses a parameter digest that differs
   from the committed one,
4. recomputes each checked micro-batch (recompute.recompute) and compares (compare.py).

A peer whose check fails is named in the returned verdict; the driver bans it and replays the step
under a new plan, after undoing what was applied (train/checks.py). `prepare` (1-2) must run before
the step's update; `finish` (3-4) may run while later steps do, and with `lag` leaves the recomputes
running for `conclude`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import BrokenExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.verify.audit import AuditJob, judge_audit, pack_tensors, portable, split_payloads
from fusionnode.verify.commitment import digest_encoded, digest_tensors
from fusionnode.verify.compare import (
    CPU_REL_TOL,
    Mismatch,
    all_finite,
    compare_loss,
    compare_tensors,
    tolerance_for,
)
from fusionnode.verify.inner import stage_params
from fusionnode.verify.ledger import AUDIT_KIND
from fusionnode.verify.lossy import compare_sent_all
from fusionnode.verify.policy import VerifyPolicy
from fusionnode.verify.recompute import recompute
from fusionnode.verify.selector import CheckSelector
from fusionnode.wire.job import Rpc
from fusionnode.wire.tensors import decode_tensor

logger = logging.getLogger(__name__)

AUDIT_RPC = Rpc.JOB_AUDIT
MAX_AUDIT_CHUNKS = 4096  # audit messages one stage may answer with


@dataclass
class Verdict:
    caught: dict[str, str] = field(default_factory=dict)  # peer -> why its work was refused
    disputes: list[str] = field(default_factory=list)  # links whose two ends disagree (unresolved)
    checked: int = 0  # micro-batches recomputed
    plan: dict[int, list[int]] = field(default_factory=dict)  # stage -> micro-batches checked
    grads: list[int] = field(default_factory=list)  # stages whose parameter gradients were checked
    seconds: float = 0.0  # time the checks took
    # recomputes still running (`Verifier.finish` with `lag`): (stage, future of '' or why not)
    later: list[tuple[Mapping[str, Any], asyncio.Future]] = field(default_factory=list)
    open_disputes: list[tuple[int, int, int, str]] = field(default_factory=list)  # judged at the end
    stage_args: Sequence[Mapping[str, Any]] = ()

    @property
    def done(self) -> bool:
        """Whether every recompute of it has ended (`Verifier.conclude` then does not wait)."""
        return all(f.done() for _, f in self.later)

    @property
    def ok(self) -> bool:
        return not self.caught and not self.disputes


@dataclass
class Prepared:
    """A step's checks once `Verifier.prepare` ran (before the step's update), for `Verifier.finish`."""

    step: int
    stage_args: Sequence[Mapping[str, Any]]
    micro_batches: Callable[[Mapping[str, Any]], int]
    verdict: Verdict
    todo: list[tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], list[int]]]
    grad_checked: set[int]
    disputes: list[tuple[int, int, int, str]]
    params: dict[str, torch.Tensor]
    t0: float
    prepare_s: float


def chain_disputes(
    stage_args: Sequence[Mapping[str, Any]],
    commits: Sequence[Mapping[str, Any] | None],
    fed: Mapping[tuple[int, int, str], str],
    micro_batches: Callable[[Mapping[str, Any]], int],
) -> tuple[dict[str, str], list[tuple[int, int, int, str]]]:
    """Pure: (peers whose commitments are missing or malformed, disputed links as (stage, other
    stage, mb, what)). `fed[(stage, mb, part)]`: digests of what the driver sent ("in" of first
    stages, "target" of last stages)."""
    bad: dict[str, str] = {}
    by_pos = {(a["replica"], a["pos"]): (a, c) for a, c in zip(stage_args, commits, strict=True)}
    for a, c in zip(stage_args, commits, strict=True):
        m = micro_batches(a)
        if not isinstance(c, Mapping) or not isinstance(c.get("mbs"), list) or len(c["mbs"]) != m:
            bad[a["peer"]] = f"stage {a['stage']} sent no commitments for its {m} micro-batches"
        elif not a.get("offload") and not isinstance(c.get("params"), str):  # with offload: the hosts'
            bad[a["peer"]] = f"stage {a['stage']} sent no commitment to its parameters"
    disputes: list[tuple[int, int, int, str]] = []
    for a, c in zip(stage_args, commits, strict=True):
        if a["peer"] in bad:
            continue
        mbs = c["mbs"]
        last = a["pos"] == a["num_stages"] - 1
        for mb in range(micro_batches(a)):
            if a["pos"] == 0 and mbs[mb].get("in") != fed.get((a["stage"], mb, "in")):
                disputes.append((a["stage"], -1, mb, "input"))
            if last and mbs[mb].get("target") != fed.get((a["stage"], mb, "target")):
                disputes.append((a["stage"], -1, mb, "target"))
            nxt = by_pos.get((a["replica"], a["pos"] + 1))
            if last or nxt is None or nxt[0]["peer"] in bad:
                continue
            b, cb = nxt
            if mbs[mb].get("out") is None or mbs[mb].get("out") != cb["mbs"][mb].get("in"):
                disputes.append((a["stage"], b["stage"], mb, "activations"))
            if cb["mbs"][mb].get("gout") is None or cb["mbs"][mb].get("gout") != mbs[mb].get("gin"):
                disputes.append((a["stage"], b["stage"], mb, "gradients"))
    return bad, disputes


def decode_shown(
    tensors: Mapping[str, Any], specs: Mapping[str, Mapping[str, Any]] | None, peer: str
) -> dict[str, torch.Tensor]:
    """Decodes tensors a worker shows; a FusionNodeError naming the peer when they do not decode, are
    not what `specs` (name -> shape, dtype) says or are not finite."""
    out = {}
    for name, enc in tensors.items():
        if specs is not None:
            spec = specs.get(name)
            if spec is None or tuple(enc.shape) != tuple(spec["shape"]) or enc.dtype != spec["dtype"]:
                raise FusionNodeError(f"peer {peer[:12]}… showed {name!r} as {enc.dtype}{list(enc.shape)}")
        try:
            t = decode_tensor(enc)
        except FusionNodeError as exc:
            raise FusionNodeError(f"peer {peer[:12]}… showed {name!r} undecodable: {exc}") from None
        if not all_finite(t):
            raise FusionNodeError(f"peer {peer[:12]}… showed non-finite values in {name!r}")
        out[name] = t
    return out


def check_micro_batch(
    module: Any,
    a: Mapping[str, Any],
    parts: Mapping[str, Mapping[str, torch.Tensor]],
    micro_batches: int,
    reported_loss: float | None,
    rel_tol: float = CPU_REL_TOL,
    accumulate: bool = False,
    rules: Any = None,
    at: tuple[int, int, int] | None = None,
) -> list[Mismatch]:
    """Pure: recomputes one micro-batch of stage `a` from `parts` (its ledger's decoded messages)
    and lists what differs from what the worker sent (and, on the last stage, reported). With
    `rules` (verify/lossy.LinkRules of a lossy job) and the sent messages' encoded forms in `parts`
    ("sent:out", "sent:gout"), what it sent is compared as its link codec makes of the recompute;
    `at` = (stage, step, micro-batch) keys its q8/q4 dither (verify/lossy.LinkRules.seed)."""
    last, first = a["pos"] == a["num_stages"] - 1, a["pos"] == 0
    target = parts.get("target", {}).get("target") if last else None
    res = recompute(
        module,
        inputs=parts.get("in", {}),
        send_names=list(a["send_specs"]),
        is_last=last,
        is_first=first,
        micro_batches=micro_batches,
        target=target,
        output_grads=parts.get("gin"),
        accumulate=accumulate,
    )
    out: list[Mismatch] = []

    def compare(part: str, want: Mapping[str, torch.Tensor], key: str, what: str) -> list[Mismatch]:
        sent = parts.get("sent:" + part)
        if rules is not None and rules.lossy and sent is not None:
            return compare_sent_all(parts.get(part, {}), sent, want, rules, key, rel_tol, what, at)
        return compare_tensors(parts.get(part, {}), want, rel_tol, what)

    if not last:
        out += compare("out", res.outputs, "act", "activation")
    elif reported_loss is None:
        out.append(Mismatch("loss", "not reported"))
    else:
        m = compare_loss(float(reported_loss), float(res.loss), rel_tol)
        if m is not None:
            out.append(m)
    if not first:
        out += compare("gout", res.input_grads, "grad", "gradient")
    return out


def check_stage_work(
    module: Any,
    a: Mapping[str, Any],
    mine: Mapping[str, torch.Tensor],
    parts_of: Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]],
    mbs: list[int],
    losses: Sequence[float],
    m: int,
    rel_tol: float,
    shown: Mapping[str, torch.Tensor] | None,
    step: int,
    rules: Any = None,
) -> str:
    """Pure: recomputes the checked micro-batches of stage `a` with `module` (its parameters
    `mine` loaded) and, when `shown`, compares the accumulated parameter gradients; '' when every
    one matches, else why not."""
    for p in module.parameters():  # the micro-batches below accumulate from zero
        p.grad = None
    for mb in mbs:
        loss = losses[mb] if mb < len(losses) else None
        at = (int(a["stage"]), step, mb)
        bad = check_micro_batch(
            module, a, parts_of[mb], m, loss, rel_tol, accumulate=True, rules=rules, at=at
        )
        if bad:
            return (
                f"stage {a['stage']} (peer {a['peer'][:12]}…) failed a spot-check at step {step}, "
                f"micro-batch {mb}: " + "; ".join(str(x) for x in bad[:3])
            )
    if shown is not None:
        trained = set(a["param_specs"]) - set(a.get("frozen") or [])
        named = module.named_stage_parameters()
        want = {
            n: (named[n].grad if named[n].grad is not None else torch.zeros_like(named[n])) for n in trained
        }
        bad = compare_tensors(shown, want, rel_tol, "parameter gradient")
        if bad:
            return (
                f"stage {a['stage']} (peer {a['peer'][:12]}…) failed a gradient check at step {step}: "
                + "; ".join(str(x) for x in bad[:3])
            )
    return ""


async def _off_loop(pack: Callable[[Any], Any], tensors: dict[str, Any], owner: Any) -> Any:
    """`pack(tensors)` on a thread; if the caller is cancelled meanwhile, the buffer it lends is given
    back (`owner.give`) once the copy ended, instead of staying lent for good."""
    fut = asyncio.get_running_loop().run_in_executor(None, pack, tensors)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        give = getattr(owner, "give", None)
        if give is not None:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or give(f.result()))
        raise


class Verifier:
    """Spot-checks a job's steps (see the module docstring); one per running job."""

    def __init__(
        self,
        transport: Any,
        job_id: str,
        policy: VerifyPolicy,
        *,
        timeout_s: float,
        build_stage: Callable[[dict[str, Any], dict[str, torch.Tensor]], Any],
        selector: CheckSelector | None = None,
        rel_tol: float = CPU_REL_TOL,
        run_elsewhere: Callable[..., Awaitable[str]] | None = None,
    ) -> None:
        """`build_stage(description, params)`: the stage's module on CPU (runtime.stage.StageModule);
        `run_elsewhere(a, params, parts, mbs, losses, m, rel_tol, shown, step)`: runs
        `check_stage_work` elsewhere (another process) instead of on a thread of this one."""
        self.t = transport
        self.job_id = job_id
        self.policy = policy
        self.selector = selector or CheckSelector.fresh()
        self.build_stage = build_stage
        self.run_elsewhere = run_elsewhere
        self._thread_lock = threading.Lock()
        self._modules: dict[int, Any] = {}  # stage -> its module, kept across steps (new values loaded)
        self.timeout_s = timeout_s
        self.rel_tol = rel_tol
        self.fed: dict[tuple[int, int, str], str] = {}  # this step's digests of the driver's own messages
        self._prefetch: tuple[set[int], asyncio.Future] | None = None  # (stages, their parameters)
        self.device_kinds: dict[str, str] = {}  # peer -> device kind its published record names
        self.totals = {
            "steps": 0,
            "checked": 0,
            "caught": 0,
            "disputes": 0,
            "seconds": 0.0,  # the checks' time (with offload mostly while later steps run), of which:
            "params_s": 0.0,  # waiting for the checked stages' parameters (prefetched during the step)
            "pushed_s": 0.0,  # waiting for the hosts' digests of the pushed gradients
            "audit_s": 0.0,  # the audits (summed over stages checked in parallel)
            "recompute_s": 0.0,  # the recomputes (summed over stages checked in parallel)
        }

    def start_step(self) -> None:
        self.fed = {}
        if self._prefetch is not None:
            self._prefetch[1].cancel()
        self._prefetch = None

    def planned(
        self,
        step: int,
        stage_args: Sequence[Mapping[str, Any]],
        micro_batches: Callable[[Mapping[str, Any]], int],
    ) -> list[Mapping[str, Any]]:
        """The stages this step will check (the driver knows its secret; the workers do not)."""
        return [
            a
            for a in stage_args
            if self.selector.chosen(step, a["stage"], micro_batches(a), self.policy.rate)
        ]

    def prefetch(self, stages: list[Mapping[str, Any]], params_for: Callable[..., Awaitable[Any]]) -> None:
        """Starts fetching the parameters of the stages to check while the step runs (the values the
        stages compute with do not change during a step), off the step's critical path."""
        if stages:
            self._prefetch = ({a["stage"] for a in stages}, asyncio.ensure_future(params_for(stages)))

    async def _params(
        self, stages: list[Mapping[str, Any]], params_for: Callable[..., Awaitable[Any]]
    ) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        have: set[int] = set()
        if self._prefetch is not None:
            have, task = self._prefetch
            self._prefetch = None
            got = dict(await task)
        rest = [a for a in stages if a["stage"] not in have]
        if rest:
            got.update(await params_for(rest))
        return got

    def record_fed(self, stage: int, mb: int, part: str, msg: Any) -> None:
        """The driver fed `msg` (an input or a target) to `stage`: its digest, for the cross-check."""
        self.fed[(stage, mb, part)] = digest_encoded(msg.tensors)

    async def check(
        self,
        step: int,
        stage_args: Sequence[Mapping[str, Any]],
        reports: Sequence[Mapping[str, Any]],
        micro_batches: Callable[[Mapping[str, Any]], int],
        params_for: Callable[[list[Mapping[str, Any]]], Awaitable[dict[str, torch.Tensor]]],
        check_grads: bool = False,
        pushed_for: Callable[[int], Awaitable[dict[str, dict[str, str]]]] | None = None,
    ) -> Verdict:
        """With `check_grads`, a stage drawn for a gradient check (micro-batch -1 of the selector) has
        every micro-batch recomputed and its accumulated parameter gradients compared with those it
        shows; `pushed_for(step)` gives the optimizer hosts' digests of what each contributor pushed
        (contributor -> name -> digest; None without offload), which what it shows must match.
        `prepare` + `finish` in one (the driver splits them to check a step while the next runs)."""
        prep = await self.prepare(step, stage_args, reports, micro_batches, params_for, check_grads)
        return await self.finish(prep, pushed_for)

    async def prepare(
        self,
        step: int,
        stage_args: Sequence[Mapping[str, Any]],
        reports: Sequence[Mapping[str, Any]],
        micro_batches: Callable[[Mapping[str, Any]], int],
        params_for: Callable[[list[Mapping[str, Any]]], Awaitable[dict[str, torch.Tensor]]],
        check_grads: bool = False,
    ) -> Prepared:
        """What must happen before the step's update is applied: the link cross-check, the draw, and
        the checked stages' parameters (the values the stages computed with, which the optimizer
        hosts overwrite when they apply the step). Takes this step's `fed` digests and prefetch."""
        t0 = time.perf_counter()
        verdict = Verdict()
        fed, self.fed = self.fed, {}
        commits = [r.get("verify") for r in reports]
        bad, disputes = chain_disputes(stage_args, commits, fed, micro_batches)
        verdict.caught.update(bad)
        forced: dict[int, set[int]] = {}
        for s, o, mb, _what in disputes:
            forced.setdefault(s, set()).add(mb)
            if o >= 0:
                forced.setdefault(o, set()).add(mb)
        todo: list[tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], list[int]]] = []
        grad_checked: set[int] = set()
        for a, r, c in zip(stage_args, reports, commits, strict=True):
            if a["peer"] in bad:
                continue
            m = micro_batches(a)
            mbs = set(self.selector.chosen(step, a["stage"], m, self.policy.rate)) | forced.get(
                a["stage"], set()
            )
            if check_grads and self.grad_checked(step, a["stage"]):
                grad_checked.add(a["stage"])
                mbs = set(range(m))
            if mbs:
                todo.append((a, r, c, sorted(mbs)))
        verdict.plan = {a["stage"]: mbs for a, _, _, mbs in todo}
        verdict.grads = sorted(grad_checked)
        params: dict[str, torch.Tensor] = {}
        if todo:
            t1 = time.perf_counter()
            params = await self._params([a for a, _, _, _ in todo], params_for)
            self.totals["params_s"] += time.perf_counter() - t1
        else:
            self.start_step()  # drops an unused prefetch
        return Prepared(
            step, stage_args, micro_batches, verdict, todo, grad_checked, disputes, params, t0,
            time.perf_counter() - t0,
        )  # fmt: skip

    async def finish(
        self,
        prep: Prepared,
        pushed_for: Callable[[int], Awaitable[dict[str, dict[str, str]]]] | None = None,
        lag: bool = False,
    ) -> Verdict:
        """The audits, recomputes and comparisons of a prepared step (they read only what the
        workers kept and the parameters fetched: they may run while the next step does). With
        `lag` it returns once the audits are done (what the workers keep for two steps only), the
        recomputes left running in `verdict.later`: `conclude` judges them."""
        t0 = time.perf_counter()
        step, stage_args, verdict, todo = prep.step, prep.stage_args, prep.verdict, prep.todo
        micro_batches, grad_checked = prep.micro_batches, prep.grad_checked
        pushed = None
        if todo:
            if grad_checked and pushed_for is not None:
                t1 = time.perf_counter()
                pushed = await pushed_for(step)
                self.totals["pushed_s"] += time.perf_counter() - t1
            results = await asyncio.gather(
                *(
                    self._check_stage(
                        step,
                        a,
                        r,
                        c,
                        mbs,
                        prep.params,
                        micro_batches(a),
                        a["stage"] in grad_checked,
                        pushed,
                        defer=True,
                    )
                    for a, r, c, mbs in todo
                ),
                return_exceptions=True,
            )
            for (a, _, _, mbs), res in zip(todo, results, strict=True):
                if isinstance(res, BaseException):
                    if not isinstance(res, FusionNodeError | OSError | asyncio.TimeoutError):
                        raise res
                    verdict.caught[a["peer"]] = f"verification of stage {a['stage']}: {res}"
                elif isinstance(res, asyncio.Future):
                    verdict.later.append((a, res))
                elif res:
                    verdict.caught[a["peer"]] = res
                verdict.checked += len(mbs)
        verdict.open_disputes, verdict.stage_args = list(prep.disputes), stage_args
        verdict.seconds = prep.prepare_s + time.perf_counter() - t0
        if not lag:
            await self.conclude(verdict)
        return verdict

    async def conclude(self, verdict: Verdict) -> Verdict:
        """Waits for a verdict's recomputes and judges them (and the disputes); counts it."""
        t0 = time.perf_counter()
        later, verdict.later = verdict.later, []
        results = await asyncio.gather(*(f for _, f in later), return_exceptions=True)
        for (a, _), res in zip(later, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, FusionNodeError | OSError | asyncio.TimeoutError):
                    raise res
                verdict.caught[a["peer"]] = f"verification of stage {a['stage']}: {res}"
            elif res:
                verdict.caught[a["peer"]] = res
        caught_stages = {a["stage"] for a in verdict.stage_args if a["peer"] in verdict.caught}
        for s, o, mb, what in verdict.open_disputes:
            if s not in caught_stages and o not in caught_stages:
                verdict.disputes.append(f"stage {s} -> {o if o >= 0 else 'driver'}, micro-batch {mb}: {what}")
        verdict.open_disputes = []
        verdict.seconds += time.perf_counter() - t0
        self.totals["steps"] += 1
        self.totals["checked"] += verdict.checked
        self.totals["caught"] += len(verdict.caught)
        self.totals["disputes"] += len(verdict.disputes)
        self.totals["seconds"] += verdict.seconds
        return verdict

    def _module(self, a: Mapping[str, Any], params: dict[str, torch.Tensor]) -> Any:
        """Stage `a`'s module with `params` loaded: built once per stage of a plan, then reloaded."""
        cached = self._modules.get(a["stage"])
        if cached is not None and cached[0] is a["description"]:
            cached[1].load_state(params)
            return cached[1]
        module = self.build_stage(a["description"], params)
        self._modules[a["stage"]] = (a["description"], module)
        return module

    def tolerance(self, peer: str, commit: Mapping[str, Any]) -> float:
        """The comparison's tolerance for a stage computed on the device its worker reports (compare.py),
        but the CPU one when the peer's published record names another kind of device: claiming a GPU
        to be compared more loosely does not work."""
        kind = str(commit.get("device") or "cpu")
        if kind != "cpu" and self.device_kinds.get(peer) != kind:
            kind = "cpu"
        return max(self.rel_tol, tolerance_for(kind, bool(commit.get("autocast"))))

    def grad_checked(self, step: int, stage: int) -> bool:
        """Whether this step checks the stage's parameter gradients (all its micro-batches)."""
        return self.selector.draw(step, stage, -1) < self.policy.grad_rate

    async def _check_stage(
        self,
        step: int,
        a: Mapping[str, Any],
        report: Mapping[str, Any],
        commit: Mapping[str, Any],
        mbs: list[int],
        params: Mapping[str, torch.Tensor],
        m: int,
        grads: bool = False,
        pushed: Mapping[str, Mapping[str, str]] | None = None,
        defer: bool = False,
    ) -> str | asyncio.Future:
        """'' when every checked micro-batch of stage `a` matches, else why not; with `defer`, once
        the audit passed, a future of that (the recompute, left running)."""
        rel_tol = self.tolerance(a["peer"], commit)
        mine = stage_params(params, a)
        if (not a.get("offload") or a.get("rounds")) and digest_tensors(mine) != commit["params"]:
            return f"stage {a['stage']} showed parameters other than it committed to"
        t1 = time.perf_counter()
        res = await self.t.call(
            a["peer"],
            AUDIT_RPC,
            {
                "job": self.job_id,
                "stage": a["stage"],
                "step": step,
                "mbs": mbs,
                "grads": grads,
            },
            timeout=self.timeout_s,
            # a stream reset is not a refusal: asked once more (it only resends the kept messages,
            # which replace the first ones in the mailbox); a worker that does not answer twice is
            # caught (an audit it escapes would hide a lie)
            idempotent=True,
        )
        listed = res.get("parts") if isinstance(res, dict) else None
        n_chunks = res.get("chunks") if isinstance(res, dict) else None
        if (
            not isinstance(listed, dict)
            or not isinstance(n_chunks, int)
            or not 0 < n_chunks <= MAX_AUDIT_CHUNKS
        ):
            return f"stage {a['stage']} answered the audit without its parts"
        chunks = []
        for idx in range(n_chunks):
            msg, src = await self.t.mailbox.get(
                (AUDIT_KIND, self.job_id, step, idx, a["stage"]), self.timeout_s, sender=a["peer"]
            )
            chunks.append(msg.tensors)

        audit = AuditJob(
            dict(a), dict(commit), listed, chunks, src, mbs, grads, pushed,
            list(report.get("losses") or []), m, rel_tol, step,
            {"compress": a.get("compress"), "link_options": a.get("link_options"), "job": self.job_id},
        )  # fmt: skip
        self.totals["audit_s"] += time.perf_counter() - t1
        if defer:
            return asyncio.ensure_future(self._recompute(audit, mine))
        return await self._recompute(audit, mine)

    async def _recompute(self, audit: AuditJob, mine: dict[str, torch.Tensor]) -> str:
        """The audit judged (`judge_audit`: commitments, decoding, recomputes) in the check process
        when there is one (off this process's GIL and at idle priority), else on a thread."""
        t1 = time.perf_counter()
        try:
            if self.run_elsewhere is not None:  # another process (train/checks.py): off this one's GIL
                try:
                    pack = getattr(self.run_elsewhere, "pack", None)
                    if pack is None:  # the audit's payloads pickled, the parameters in one buffer
                        sent = dataclasses.replace(audit, chunks=portable(audit.chunks))
                        return await self.run_elsewhere(sent, pack_tensors(mine))
                    # the payloads cross with the parameters, in the buffer `pack` lends
                    # on a thread: the ~5 MB copy (torch's, without the GIL) leaves this process's
                    # event loop (the driver's, its optimizer host's and its worker's) free meanwhile
                    light, payloads = split_payloads(audit.chunks)
                    packed = await _off_loop(pack, {**mine, **payloads}, self.run_elsewhere)
                    return await self.run_elsewhere(dataclasses.replace(audit, chunks=light), packed)
                except (OSError, BrokenExecutor) as exc:  # a broken pool: recomputed here from now on
                    logger.warning("the check process failed (%s); checking on a thread instead", exc)
                    # (a verifier peer is kept: its next fallback is a new process)
                    if not getattr(self.run_elsewhere, "survives_broken_fallback", False):
                        self.run_elsewhere = None

            def run() -> str:
                with self._thread_lock:  # one module per stage: recomputes of two steps take turns
                    return judge_audit(audit, mine, self._module)

            return await asyncio.to_thread(run)
        finally:
            self.totals["recompute_s"] += time.perf_counter() - t1


__all__ = [
    "AUDIT_RPC",
    "Prepared",
    "Verdict",
    "Verifier",
    "chain_disputes",
    "check_micro_batch",
    "check_stage_work",
]
