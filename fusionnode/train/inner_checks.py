"""The driver's transition checks of a `--sync diloco|sparseloco` job's inner steps (issue 20;
the commitments and the recompute are verify/inner.py's).

At step t+1 of a round (its reports in: they commit the parameters and inner optimizer state that
step t's commit produced), each stage's step t is drawn for a transition check with the driver's
secret (`CheckSelector.draw(t, stage, -2)` < `transition_rate`: twice the gradient-check rate), unknown to the worker until
then. A drawn stage's worker shows (`job.fetch` what="inner") its snapshot of step t and its state
now; each part must match its commitment, and the recomputed inner step must match what it holds.
A mismatch, or no answer, catches the worker: the step fails blaming it, recovery bans it and the
round is redone from the hosts' parameters on a new plan (nothing of that round had left a worker).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.verify import feedback, inner
from fusionnode.verify.commitment import digest_tensors
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked
from fusionnode.wire.job import Rpc

TRANSITION_MB = -2  # the selector's "micro-batch" of a transition check (-1: the gradient check)
ROUND_END_MB = -3  # the selector's "micro-batch" of a round's last inner step and pseudo-gradient
# a pseudo-gradient against θ_start − θ_end recomputed, relative to its norm, per --sync-codec: raw
# float32 differs only by the rounding of the workers' and hosts' θ_start (measured: 0 in the tests),
# fp16 by its 2^-11 relative step; q8 is checked per row and element instead (`q8_mismatch`)
DELTA_REL_TOL = {"raw": 1e-3, "fp16": 2e-3}
# q8 (per-row absmax, round to nearest: compress/quant.py): the recompute's slack, relative, on each
# row's scale and each element (raw's tolerance: a CUDA worker's last inner step, recomputed on the
# driver's CPU, is within 1e-3 of that step's update); GRID_SLACK grid units for the division's rounding
Q8_SLACK = 1e-3
GRID_SLACK = 1e-3


_TAGS = itertools.count(secrets.randbelow(1 << 40))  # job.fetch tags: each used once per driver process


async def fetch_stage(t: Any, job_id: str, a: Any, what: str, timeout_s: float) -> dict[str, torch.Tensor]:
    """Stage `a`'s tensors of `job.fetch` `what` ("params": checked against its specs), asked once
    more after a stream reset (a check's fetch only reads what the worker holds), under a tag of its
    own: the first call's copies, arriving late, are never taken for a later fetch's (a false catch
    seen in a 500-step clean run before the tag)."""
    tag = next(_TAGS)  # a retry's re-sent copies stay under this fetch's keys (SPEC.md: job.fetch)
    req = jp.FetchRequest(job=job_id, stage=a.stage, what=what, tag=tag)
    res = await jp.call(t, a.peer, Rpc.JOB_FETCH, req, timeout=timeout_s, idempotent=True)
    specs = a.param_specs if what == "params" else None
    got: dict[str, torch.Tensor] = {}
    for idx in range(res.count):
        msg, src = await t.mailbox.get(
            (jp.FETCH_KIND[what], job_id, tag, idx, a.stage), timeout_s, sender=a.peer
        )
        got.update(decode_checked(msg, specs, None, src))
    return got


def delta_mismatch(
    codec: str, delta: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> tuple[str, float]:
    """('', relative error) when the pseudo-gradient `delta` the hosts received is `want` (θ_start −
    θ_end recomputed) as the sync codec `codec` sends it, else (why not, relative error)."""
    norm = sum(float(w.double().pow(2).sum()) for w in want.values()) ** 0.5
    err = sum(float((delta[n].double() - want[n].double()).pow(2).sum()) for n in want) ** 0.5
    rel = err / max(norm, 1e-30)
    if codec not in DELTA_REL_TOL:  # q8
        for n in sorted(want):
            why = q8_mismatch(delta[n], want[n])
            if why:
                return f"{n}: {why}", rel
        return "", rel
    tol = DELTA_REL_TOL[codec]
    if err > tol * norm + 1e-12:
        return f"relative error {rel:.3g}, tolerance {tol:g}", rel
    return "", rel


def q8_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when `got` (a q8 message decoded) is the q8 encoding of `want` up to the recompute's slack:
    each row's scale (its largest |value| / 127) that of `want`, each element within half a grid step
    of its recomputed value (round to nearest); else why not. A flat relative-L2 tolerance let a
    pseudo-gradient scaled by 1.9% through every round; the scale test stops a 0.2% one."""
    from fusionnode.compress.quant import QMAX, quant_rows

    rows, row_len = quant_rows(tuple(want.shape))
    if rows == 0:
        return ""
    q = QMAX["q8"]
    y = want.detach().double().reshape(rows, row_len)
    g = got.detach().double().reshape(rows, row_len)
    rms = float(y.pow(2).mean().sqrt())
    s_want = y.abs().amax(dim=1) / q
    s_got = g.abs().amax(dim=1) / q
    off = (s_got - s_want).abs() - Q8_SLACK * (s_want + rms / q)
    if bool((off > 0).any()):
        r = int(off.argmax())
        return f"row {r}'s scale {float(s_got[r]):.6g} instead of max|Δ|/{q} = {float(s_want[r]):.6g}"
    bound = (0.5 + GRID_SLACK) * s_want.unsqueeze(1) + Q8_SLACK * (y.abs() + rms)
    far = (g - y).abs() > bound
    if bool(far.any()):
        return f"{int(far.sum())} elements off the q8 grid point nearest the recomputed value"
    return ""


class RoundEnd:
    """One round's drawn round-end checks (`Transitions.round_end_checks`): the drawn stages' fetches
    start together once the round is complete on the hosts (`start`) and must end within one deadline
    inside the scoring budget; `check` judges a replica's once the hosts' θ and its Δ are in. A drawn
    check that did not finish leaves its replica out of the round (`unfinished`), whatever happens to
    the scoring; a worker that did not answer in time is caught, as an unanswered audit is."""

    def __init__(self, tr: Transitions, job: Any, run: Any, step: int, todo: list, deadline_s: float) -> None:
        self.tr, self.job, self.run, self.step = tr, job, run, step
        self.todo = todo  # [(assignment, its commitments at `step`, its commit arguments)]
        self.deadline_s = deadline_s
        self.fetches: dict[int, asyncio.Task[Any]] = {}  # stage -> its fetch
        self.ended: set[int] = set()  # stages whose check ended (passed or caught)
        self.caught: dict[str, str] = {}  # peer -> why

    @property
    def replicas(self) -> set[int]:
        return {a.replica for a, _, _ in self.todo}

    def start(self) -> None:
        for a, commit, _args in self.todo:
            if a.stage not in self.fetches:
                coro = self.tr._round_end_fetch(self.job, self.step, a, commit, self.deadline_s)
                self.fetches[a.stage] = asyncio.ensure_future(coro)

    def _end(self, a: Any, why: str) -> None:
        if a.stage in self.ended:
            return
        self.ended.add(a.stage)
        self.tr.v.totals["transitions"] += 1
        if why:
            self.caught[a.peer] = why
            self.tr.v.totals["transitions_caught"] += 1

    async def check(
        self, replica: int, theta: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]
    ) -> dict[str, str]:
        """Replica `replica`'s drawn checks against its pseudo-gradient `delta`; peer -> why caught."""
        self.start()
        out: dict[str, str] = {}
        for a, _commit, args in self.todo:
            if a.replica != replica:
                continue
            got = await self.fetches[a.stage]
            if isinstance(got, str):
                why = got
            else:
                judge = self.tr._round_end_judge
                why = await asyncio.to_thread(
                    judge, self.job, self.run, self.step, a, got, args, theta, delta
                )
            self._end(a, why)
            if why:
                out[a.peer] = why
        return out

    def settle(self) -> tuple[dict[str, str], set[int], set[int]]:
        """Once the scoring ended (or failed, or overran): the workers caught (a fetch that failed, or
        had no answer, within its deadline included), the replicas with a drawn check that did not
        pass, and of those the ones whose every drawn worker showed its committed snapshot (only the
        driver's comparison is missing)."""
        answered: set[int] = set()
        for a, _commit, _args in self.todo:
            task = self.fetches.get(a.stage)
            ok = task is not None and task.done() and not task.cancelled() and task.exception() is None
            if a.stage not in self.ended and ok and isinstance(task.result(), str):
                self._end(a, task.result())
        self.cancel()
        out = {a.replica for a, _, _ in self.todo if a.stage not in self.ended or a.peer in self.caught}
        for r in out:
            mine = [(a, self.fetches.get(a.stage)) for a, _, _ in self.todo if a.replica == r]
            if all(
                a.peer not in self.caught and t is not None and t.done() and not t.cancelled()
                and t.exception() is None and isinstance(t.result(), dict)
                for a, t in mine
            ):  # fmt: skip
                answered.add(r)
        return dict(self.caught), out, answered

    def cancel(self) -> None:
        for task in self.fetches.values():
            if not task.done():
                task.cancel()


def shown(
    got: dict[str, torch.Tensor],
    step: int,
    what: str,
    before: dict[str, Any],
    after: dict[str, Any] | None = None,
) -> dict[str, dict[str, torch.Tensor]] | str:
    """A stage's `inner` fetch by part, each checked against its commitment (`before`: the step's
    params/opt/grads; `after`, a transition check's: the next step's params/opt), or why not."""
    at = got.pop("at", None)
    if at is None or at.numel() != 1 or int(at.reshape(-1)[0]) != step:
        return f"{what}: it showed no snapshot of that step"
    parts = inner.split_fetch(got)
    commits = [("prev/param", before["params"]), ("prev/opt", before["opt"]), ("prev/grad", before["grads"])]
    if after is not None:
        commits += [("now/param", after["params"]), ("now/opt", after["opt"])]
    for part, digest in commits:
        if digest_tensors(parts[part]) != digest:
            return f"{what}: it showed a {part} other than it committed to"
    return parts


def replay(a: Any, parts: dict[str, dict[str, torch.Tensor]], args: tuple) -> tuple[dict, dict]:
    """Stage `a`'s inner step recomputed from the snapshot it showed (`parts`) and the commit arguments
    the driver sent (`args`: step, lr, clip, tied-weight sums): inner.expected_step with the job's
    optimizer over the parameters that carry inner state."""
    from fusionnode.optim.optimizers import FlatOptimizer, job_optimizer_config

    _step, lr, clip, shared = args
    prev = parts["prev/param"]
    trained = {n: {"shape": list(p.shape)} for n, p in prev.items() if f"steps/{n}" in parts["prev/opt"]}
    cfg = job_optimizer_config(a.spec, trained)
    return inner.expected_step(
        prev, parts["prev/opt"], parts["prev/grad"], shared, clip, lr, lambda m: FlatOptimizer(m, cfg)
    )


def transition_rate(grad_rate: float) -> float:
    """The transition checks' rate: twice the gradient checks' (a transition check recomputes no
    micro-batch: the stage's kept state crosses once and the driver runs one optimizer step), so
    a worker lying in every inner step escapes 20 steps (16 checkable at H = 5) with probability
    0.1^16 at the public default (gradient checks 0.45: transitions 0.9; 0.4^16 = 4e-7 at the 0.3
    before), 0.9^16 = 19% in a private swarm asked for `sample` (0.05)."""
    return min(1.0, 2.0 * grad_rate)


class Transitions:
    """The transition checks of one run (`StepChecks.inner`)."""

    def __init__(self, verifier: Any, timeout_s: float) -> None:
        self.v = verifier
        self.timeout_s = timeout_s
        self.commits: dict[
            int, tuple[int, int, str, dict[str, Any]]
        ] = {}  # stage -> (step, plan, peer, commit)
        self.args: dict[
            int, tuple[int, float, float, dict[str, torch.Tensor]]
        ] = {}  # stage -> (step, lr, clip, sums)
        # sparseloco: stage -> (plan, peer, round, digest) its reports of `round` must commit `ef` to
        self.ef_chain: dict[int, tuple[int, str, int, str]] = {}
        # the largest relative error an accepted check saw (the tolerances' margin, measured)
        for key, zero in (
            ("transitions", 0),
            ("transitions_caught", 0),
            ("transition_s", 0.0),
            ("transition_max_rel_err", 0.0),
            ("round_end_max_rel_err", 0.0),
        ):
            self.v.totals.setdefault(key, zero)  # in the job's result with the other checks' totals

    def record_args(
        self, step: int, stage: int, lr: float, clip: float, shared: dict[str, torch.Tensor]
    ) -> None:
        """What the driver sent with stage `stage`'s commit of `step`: lr, clip factor, tied-weight sums."""
        self.args[stage] = (step, float(lr), float(clip), dict(shared))

    def drawn(self, step: int, stage: int) -> bool:
        return self.v.selector.draw(step, stage, TRANSITION_MB) < transition_rate(self.v.policy.grad_rate)

    def checkable(self, job: Any, step: int) -> bool:
        """Whether step `step`'s inner update shows in step+1's parameters: not at a round's close (they
        are the round's result then), nor where --sync-overlap re-bases them on the previous round's."""
        sync = job.sync
        if sync.round_closes(step, job.spec.steps):
            return False
        return not (sync.overlap and sync.applies_delayed(step))

    async def check(self, job: Any, run: Any, step: int, reports: list[Any]) -> dict[str, str]:
        """At step `step` (its reports in): the drawn transition checks of step-1; peer -> why caught."""
        prev, self.commits = (
            self.commits,
            {
                a.stage: (step, job.plan_version, a.peer, r.verify or {})
                for a, r in zip(run.stage_args, reports, strict=True)
            },
        )
        chained = self._feedback_chain(job, run, step, reports)
        t = step - 1
        if t < 0 or not self.checkable(job, t):
            return chained
        todo = []
        for a in run.stage_args:
            before, args = prev.get(a.stage), self.args.get(a.stage)
            if before is None or before[:3] != (t, job.plan_version, a.peer) or args is None or args[0] != t:
                continue  # a new plan (new inner state), a replayed step, or no commit arguments kept
            if self.drawn(t, a.stage):
                todo.append((a, before[3], self.commits[a.stage][3], args))
        if not todo:
            return chained
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._one(job, t, *x) for x in todo), return_exceptions=True)
        caught: dict[str, str] = dict(chained)
        for (a, *_), res in zip(todo, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, FusionNodeError | OSError | asyncio.TimeoutError):
                    raise res
                res = f"stage {a.stage} did not show its inner step {t}: {res}"
            if res:
                caught[a.peer] = res
        self.v.totals["transitions"] += len(todo)
        self.v.totals["transitions_caught"] += len(caught)
        self.v.totals["transition_s"] += time.perf_counter() - t0
        return caught

    def _feedback_chain(self, job: Any, run: Any, step: int, reports: list[Any]) -> dict[str, str]:
        """Sparseloco: each stage whose error feedback a round-end check saw must commit `ef`, in its
        first report of the next round, to the accumulators it showed then; peer -> why caught."""
        caught: dict[str, str] = {}
        if not self.ef_chain:
            return caught
        for a, r in zip(run.stage_args, reports, strict=True):
            want = self.ef_chain.get(a.stage)
            if want is None or job.sync.round_index(step) < want[2]:
                continue
            del self.ef_chain[a.stage]
            if want[:2] != (job.plan_version, a.peer) or job.sync.round_index(step) != want[2]:
                continue  # a new plan (its feedback restarts or is restored), or a round redone
            if (r.verify or {}).get(feedback.EF_KEY) != want[3]:
                caught[a.peer] = (
                    f"stage {a.stage} (peer {a.peer[:12]}…) committed at step {step} to an error "
                    f"feedback other than the one it showed at round {want[2] - 1}'s end"
                )
        if caught:
            self.v.totals["transitions_caught"] += len(caught)
        return caught

    def _margin(self, key: str, rel: float) -> None:
        self.v.totals[key] = max(self.v.totals[key], float(rel))

    def round_end_checks(self, job: Any, run: Any, deadline_s: float) -> RoundEnd | None:
        """--sync diloco|sparseloco (sparseloco: not overlapped; its error feedback, verify/feedback.py)
        with the round held (scoring): the round-end checks drawn (by the secret,
        after the pseudo-gradients arrived) among the stages that committed to the round's last inner
        step (the step this run checked last); None when none applies. Drawn before any fetch."""
        if job.sync.mode not in ("diloco", "sparseloco") or run.names_by_stage is None:
            return None
        if job.sync.mode == "sparseloco" and job.sync.overlap:
            return None  # its fold runs beside the next round's steps (verify/feedback.py)
        steps = {c[0] for c in self.commits.values()}
        step = max(steps, default=-1)  # the step this run checked last: the round's closing one
        if len(steps) != 1 or not job.sync.round_closes(step, job.spec.steps):
            return None
        if job.sync.overlapped_before(step) and job.sync.offset(step) < job.sync.delay:
            return None  # --sync-overlap: the close re-based θ on the previous round's result before its Δ
        todo = []
        for a in run.stage_args:
            mine, args = self.commits.get(a.stage), self.args.get(a.stage)
            if mine is None or mine[:3] != (step, job.plan_version, a.peer):
                continue
            if (
                args is not None
                and args[0] == step
                and self.v.selector.draw(step, a.stage, ROUND_END_MB)
                < transition_rate(self.v.policy.grad_rate)
            ):
                todo.append((a, mine[3], args))
        return RoundEnd(self, job, run, step, todo, deadline_s) if todo else None

    async def _round_end_fetch(
        self, job: Any, step: int, a: Any, commit: dict, deadline_s: float
    ) -> dict[str, dict[str, torch.Tensor]] | str:
        """Stage `a`'s snapshot of the round's last inner step, checked against its commitments (its
        parts), or why the worker is caught: no answer within `deadline_s` included."""
        what = f"stage {a.stage} (peer {a.peer[:12]}…) round end at step {step}"
        sparse = job.sync.mode == "sparseloco"
        if any(k not in commit for k in ("params", "opt", "grads")) or (
            sparse and feedback.EF_KEY not in commit
        ):
            return f"{what}: it did not commit to its inner state"
        try:
            got = await asyncio.wait_for(
                fetch_stage(self.v.t, job.spec.job_id, a, "inner", deadline_s), deadline_s
            )
        except (TimeoutError, FusionNodeError, OSError) as exc:
            why = str(exc) or f"no answer within {deadline_s:.3g} s"
            return f"stage {a.stage} did not show its round's last inner step {step}: {why}"
        round_id, prev, nxt = feedback.split_feedback(got)
        parts = shown(got, step, what, commit)
        if isinstance(parts, str) or not sparse:
            return parts
        # sparseloco: the error feedback before the round's fold, against the last step's commitment
        if round_id != job.sync.round_index(step):
            return f"{what}: it showed no error feedback of that round"
        if digest_tensors(prev) != commit[feedback.EF_KEY]:
            return f"{what}: it showed an error feedback other than it committed to"
        parts["ef/prev"], parts["ef/next"] = prev, nxt
        return parts

    def _round_end_judge(
        self, job: Any, run: Any, step: int, a: Any, parts: dict, args: tuple, theta: dict, delta: dict
    ) -> str:
        """'' when replica `a`'s pseudo-gradient on stage `a`'s names is θ_start − θ_end recomputed."""
        what = f"stage {a.stage} (peer {a.peer[:12]}…) round end at step {step}"
        names = [n for n in run.names_by_stage.get(a.stage, []) if n in theta and n in delta]
        end, _state = replay(a, parts, args)
        want = {n: theta[n].float() - end[n].float() for n in names}
        if job.sync.mode == "sparseloco":  # through its error feedback (verify/feedback.py)
            nxt = parts["ef/next"]
            why, rel = feedback.feedback_mismatch(job.sync, names, want, parts["ef/prev"], nxt, delta)
            if not why:  # the next round's reports must commit to the e_next it showed
                self.ef_chain[a.stage] = (job.plan_version, a.peer, job.sync.round_index(step) + 1,
                                          feedback.next_digest(nxt))  # fmt: skip
        else:
            why, rel = delta_mismatch(str(job.sync.codec), {n: delta[n] for n in names}, want)
        if why:
            return (
                f"{what} failed a pseudo-gradient check: its round's contribution differs from the "
                f"hosts' round start minus its recomputed last inner step ({why})"
            )
        self._margin("round_end_max_rel_err", rel)
        return ""

    async def _one(
        self, job: Any, t: int, a: Any, before: dict[str, Any], after: dict[str, Any], args: tuple
    ) -> str:
        """'' when stage `a`'s inner step `t` is the recomputed one, else why not."""
        what = f"stage {a.stage} (peer {a.peer[:12]}…) inner step {t}"
        if any(k not in before for k in ("params", "opt", "grads")) or any(
            k not in after for k in ("params", "opt")
        ):
            return f"{what}: it did not commit to its inner state"
        got = await fetch_stage(self.v.t, job.spec.job_id, a, "inner", self.timeout_s)
        parts = shown(got, t, what, before, after)
        if isinstance(parts, str):
            return parts
        kind = str(before.get("device") or "cpu")
        if kind != "cpu" and self.v.device_kinds.get(a.peer) != kind:
            kind = "cpu"  # claiming a GPU to be compared more loosely does not work
        tol = inner.TRANSITION_REL_TOL.get(kind, inner.TRANSITION_REL_TOL["cuda"])

        def judge() -> str:
            want = replay(a, parts, args)
            why = inner.compare_step(parts["prev/param"], want, (parts["now/param"], parts["now/opt"]), tol)
            if not why:
                err, size = inner.update_error(parts["prev/param"], want[0], parts["now/param"])
                self._margin("transition_max_rel_err", err / max(size, 1e-30))
            return f"{what} failed a transition check: {why}" if why else ""

        return await asyncio.to_thread(judge)


__all__ = [
    "DELTA_REL_TOL",
    "ROUND_END_MB",
    "TRANSITION_MB",
    "RoundEnd",
    "Transitions",
    "delta_mismatch",
    "fetch_stage",
    "q8_mismatch",
    "transition_rate",
]
