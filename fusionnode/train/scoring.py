"""The driver's scoring of the replicas' round contributions (`--contrib-policy score`, issue 20).

Under ``--sync diloco|sparseloco`` with scoring on, an optimizer host holds a complete round instead
of closing it. When a step closes a round the driver launches `RoundScorer.launch` beside the
stages' commits (whose round pulls wait for the close):

1. the hosts' masters, still the round's start θ (`opt.pull`), and the norms and floor scales of
   every replica's contribution (`opt.round_held`);
2. on a held-out batch none of the replicas trained on (a validation batch of twice the job's batch
   at an index drawn at random by the driver, unknown to the workers), the driver's whole model on its CPU gives the
   loss at θ and at θ − s·Δr for each replica r alone (s = 1 under diloco: the replica's own end
   point; the outer learning rate under sparseloco: its compressed contribution's step), fetched one
   replica at a time from every host (`round_contrib` messages);
3. `verify.contrib.verdict`: a replica whose loss gain is not positive or under a quarter of the
   best one, and whose direction agrees with no other replica's, gets weight 0 (none when the gains
   are inconclusive; while they are and some replica disagrees, another held-out batch is evaluated
   and the gains summed, up to EVAL_TRIES batches); every host closes the round with the verdict times its norm floor
   (`opt.round_verdict`), and the round's updates go out to the workers' pulls.

Anything that fails in 1-2 (any exception, a malformed reply included), or scoring that takes
longer than SCORE_BUDGET x the step timeout, sends the verdict "all kept" (the floor alone weighs
the round) rather than leaving the round held, but for a replica a round-end check caught.

With spot-checks on, step 2 also checks each replica's pseudo-gradient against the hosts' θ minus
its stages' last inner step recomputed (`Transitions.round_end_checks`, train/inner_checks.py;
under sparseloco through the replica's error feedback, verify/feedback.py), drawn before any fetch, the drawn workers' snapshots fetched together within a third of the
budget: a replica whose worker fails it, or does not answer in time, gets weight 0 and the worker
is banned after the round (`Stepper.caught_at_round_end`); a replica whose drawn check did not
finish (the scoring failed or overran first) gets weight 0 too, also in the "all kept" verdict. A `scored` event records each round: scores, verdict, weights.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import random
import secrets
import time
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError
from fusionnode.verify.contrib import ContribPolicy, agreement, conclusive, resolve_contrib_policy, verdict
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc, TensorKind
from fusionnode.wire.tensors import decode_tensor

logger = logging.getLogger(__name__)

EVAL_INDEX_BASE = 1 << 20  # held-out batches: validation indices far from the val-loss ones (0..)
EVAL_BATCH_MULT = 2  # the held-out batch: this many times the job's batch (less noise in the gains)
EVAL_TRIES = 3  # held-out batches at most per round: another while a disagreeing replica's case is open
# scoring a round gets this fraction of the step timeout (the hosts hold the workers' round pulls up
# to their step deadline, as long): past it the round closes on the floor alone
SCORE_BUDGET = 0.5


def job_contrib(params: dict[str, Any], config: Any, sync: Any) -> ContribPolicy | None:
    """The job's `ContribPolicy` (None when off): auto scores in a public swarm, is off in a private
    one (a swarm key) or a local one (loopback only), as `--verify-policy` is; ConfigError on bad
    options."""
    from fusionnode.config import loopback_only
    from fusionnode.security.keys import SWARM_KEY_ENV

    local = loopback_only(tuple(getattr(config, "listen", ()) or ()))
    private = local or bool(getattr(config, "swarm_key_file", None) or os.environ.get(SWARM_KEY_ENV))
    try:
        policy = resolve_contrib_policy(
            params.get("contrib_policy"), private=private, rounds=sync.rounds, clip=params.get("contrib_clip")
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if getattr(sync, "round_close", "steps") == "time" and not policy.score:
        from fusionnode.train.free_rounds import HeldRounds  # the hosts hold each round for its token weights

        return HeldRounds(policy if policy.floor else None)
    return policy if policy.floor else None


def scorer(
    transport: Any, hosts: Any, job: Any, model: Any, source: Any, timeout_s: float
) -> RoundScorer | None:
    """The job's scorer when its policy scores and its rounds run on optimizer hosts (else None); it
    evaluates a copy of the driver's model (whose parameters the driver's other uses share)."""
    if job.contrib is None or not job.contrib.score or not job.offload or not job.sync.rounds:
        return None
    return RoundScorer(transport, hosts, job.contrib, copy.deepcopy(model), source, timeout_s)


class RoundScorer:
    """Judges each round's contributions on the driver's copy of the whole model (CPU)."""

    def __init__(
        self, transport: Any, hosts: Any, policy: ContribPolicy, model: Any, source: Any, timeout_s: float
    ):
        self.t = transport
        self.hosts = hosts  # optim.client.OptimizerClient
        self.policy = policy
        self.model = model
        self.source = source
        self.timeout_s = timeout_s
        self.rng = random.Random(secrets.randbits(64))  # the held-out batches: unpredictable to workers
        self.task: asyncio.Task[None] | None = None
        self.rounds = 0  # rounds judged
        self.dropped: dict[int, int] = {}  # replica -> rounds it was dropped from
        self.failed = 0  # rounds closed on the floor alone because scoring failed
        self.seconds = 0.0  # judging, summed over the rounds
        self.caught: dict[str, str] = {}  # peer -> why: a round-end check failed (train/inner_checks.py)
        self.complete = -1  # the last round whose contributions the hosts held complete (`score`)
        self.sending: set[int] = set()  # rounds whose verdict is going out: awaited, never cancelled

    def launch(
        self, job: Any, run: Any, round_id: int, scale: list[float] | None = None
    ) -> asyncio.Task[None]:
        self.task = asyncio.get_running_loop().create_task(self.judge(job, run, round_id, scale))
        return self.task

    async def judge(self, job: Any, run: Any, round_id: int, scale: list[float] | None = None) -> None:
        """Scores round `round_id`, then sends every host the verdict (all kept when scoring failed)
        times `scale` (--round-close time: each replica's steps over the round's most)."""
        replicas = len(job.pipelines)
        record: dict[str, Any] = {"round": round_id}
        self.sending.discard(round_id)  # (a round redone is judged again)
        t0 = time.perf_counter()
        budget = SCORE_BUDGET * self.timeout_s
        # the round-end checks, drawn before any fetch; their fetches must end within a third of the
        # budget (a worker that does not answer is caught, and its replica left out, in time)
        ends = (
            run.checks.inner_checks().round_end_checks(job, run, budget / 3)
            if run.checks is not None
            else None
        )
        try:
            # within a budget shorter than the hosts' deadline on the workers' round pulls
            scored = await asyncio.wait_for(self.score(job, run, round_id, ends), budget)
            weights = [float(w) for w in scored["verdict"]]
            if len(weights) != replicas:
                raise FusionNodeError(f"a verdict of {len(weights)} weights for {replicas} replicas")
            if ends is not None:  # every drawn check ended in score(); else its replica is left out
                weights = self._unchecked_out(run, ends, weights)
            record.update(scored)
        except Exception as exc:  # any failure (a malformed reply too): the round must not stay held
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"scoring took over {SCORE_BUDGET * self.timeout_s:.0f} s")
            logger.warning(
                "job %s: round %d not scored (%s: %s): the floor alone weighs it",
                job.spec.job_id,
                round_id,
                type(exc).__name__,
                exc,
            )
            record["error"] = f"{type(exc).__name__}: {exc}"[:300]
            self.failed += 1
            dropped = {a.replica for a in run.stage_args if a.peer in self.caught}  # a round-end check's
            weights = [0.0 if r in dropped else 1.0 for r in range(replicas)]
            if ends is not None:  # a drawn round-end check that did not pass: its replica is left out
                weights = self._unchecked_out(run, ends, weights)
        finally:
            if ends is not None:
                ends.cancel()
        if scale is not None:
            weights = [w * x for w, x in zip(weights, scale, strict=True)]
        req = jp.OptRoundVerdict(job=job.spec.job_id, round=round_id, weights=weights)
        # from here a host may close the round with it: the driver awaits it, never cancels it
        # (train/free_recovery.py `sending`), so a round is closed by all its hosts or by none
        self.sending.add(round_id)
        replies = await asyncio.gather(
            *(jp.call(self.t, h, Rpc.OPT_ROUND_VERDICT, req, timeout=self.timeout_s + 5) for h in job.hosts),
            return_exceptions=True,
        )
        errors = [str(r)[:200] for r in replies if isinstance(r, BaseException)]
        if errors:
            record["verdict_errors"] = errors
        got = [r.weights for r in replies if isinstance(r, jp.OptRoundVerdictReply)]
        record["weights"] = [[round(w, 6) for w in ws] for ws in got]  # per host: tokens x floor x verdict
        record["judge_s"] = round(time.perf_counter() - t0, 4)  # the round's close waited this long
        self.seconds += record["judge_s"]
        self.rounds += 1
        for r, w in enumerate(weights):
            if w == 0:
                self.dropped[r] = self.dropped.get(r, 0) + 1
        await run.event(job, "scored", **record)

    def _unchecked_out(self, run: Any, ends: Any, weights: list[float]) -> list[float]:
        """`weights` with weight 0 for each replica whose drawn round-end check did not pass (its
        worker caught, silent, or not judged yet); the workers caught are recorded. A verdict
        dropping every replica applies nothing on the hosts (optim/rounds.py): when nothing else
        would be kept, the replicas whose drawn workers all showed their committed snapshots (the
        driver's own scoring failed before comparing) keep their weight; a replica with a caught
        worker never does, so a round whose every replica has one applies nothing."""
        caught, unfinished, answered = ends.settle()
        self.caught.update(caught)
        out = [0.0 if r in unfinished else w for r, w in enumerate(weights)]
        if not any(w > 0 for w in out):
            out = [w if r in answered else o for r, (w, o) in enumerate(zip(weights, out, strict=True))]
        return out

    async def score(self, job: Any, run: Any, round_id: int, ends: Any = None) -> dict[str, Any]:
        """The base loss, each replica's loss gain on the held-out batch, the verdict, the norms."""
        jid, hosts = job.spec.job_id, list(job.hosts)
        held = await asyncio.gather(
            *(
                jp.call(
                    self.t,
                    h,
                    Rpc.OPT_ROUND_HELD,
                    jp.OptRoundHeld(job=jid, round=round_id),
                    timeout=self.timeout_s + 5,
                )
                for h in hosts
            )
        )
        self.complete = max(self.complete, round_id)  # every replica's pseudo-gradient reached the hosts
        if ends is not None:  # the round is complete on the hosts: the workers hold its last step
            ends.start()
        specs = {n: {"shape": list(run.full[n].shape), "dtype": "float32"} for n in run.host_of}
        theta = await self.hosts.pull(jid, hosts, run.host_of, specs)  # the round's start: held, not stepped
        n = len(job.pipelines)
        gram = [[sum(h.gram[r][q] for h in held) for q in range(n)] for r in range(n)]  # the whole model's
        agree = agreement(gram)
        step = 1.0 if job.sync.mode == "diloco" else float(job.sync.outer_lr)
        scores, base, batches = [0.0] * n, 0.0, 0
        while batches < EVAL_TRIES:  # gains summed over held-out batches: one more while inconclusive
            index = EVAL_INDEX_BASE + self.rng.randrange(1 << 30)
            x, y = self.source.eval_batch(index, EVAL_BATCH_MULT * self.source.batch_size)
            loss0 = await asyncio.to_thread(self._loss, theta, None, 0.0, x, y)
            base += loss0
            for r in range(n):  # one replica at a time: the driver holds θ and one Δ
                delta = await self._fetch(job, run, round_id, r)
                if batches == 0 and ends is not None:  # its stages' last inner steps (verify/inner.py)
                    self.caught.update(await ends.check(r, theta, delta))
                scores[r] += loss0 - await asyncio.to_thread(self._loss, theta, delta, step, x, y)
            batches += 1
            if all(a >= self.policy.min_agree for a in agree) or conclusive(scores, self.policy.keep_ratio):
                break
        base /= batches
        caught_replicas = {a.replica for a in run.stage_args if a.peer in self.caught}
        ruled = verdict(scores, self.policy.keep_ratio, agree, self.policy.min_agree)
        return {
            "base_loss": round(base, 6),
            "scores": [round(s, 6) if math.isfinite(s) else None for s in scores],
            "agree": [round(a, 4) for a in agree],
            # a replica whose worker failed a round-end check: nothing of its round applied
            "verdict": [0.0 if r in caught_replicas else w for r, w in enumerate(ruled)],
            "batches": batches,
            "norms": [[round(n, 6) for n in h.norms] for h in held],  # per host
            "scales": [[round(s, 6) for s in h.scales] for h in held],
        }

    async def _fetch(self, job: Any, run: Any, round_id: int, replica: int) -> dict[str, torch.Tensor]:
        """Replica `replica`'s pseudo-gradients of every trained name, from every host."""
        jid = job.spec.job_id
        out: dict[str, torch.Tensor] = {}
        for idx, host in enumerate(job.hosts):
            req = jp.OptRoundHeld(job=jid, round=round_id, replica=replica)
            await jp.call(self.t, host, Rpc.OPT_ROUND_HELD, req, timeout=self.timeout_s + 5)
            msg, _src = await self.t.mailbox.get(
                (TensorKind.ROUND_CONTRIB, jid, round_id, replica, idx), self.timeout_s, sender=host
            )
            for name, enc in msg.tensors.items():
                if run.host_of.get(name) != host:
                    raise FusionNodeError(f"host {host[:12]} sent {name!r}, which it does not hold")
                t = decode_tensor(enc).to(torch.float32)
                if tuple(t.shape) != tuple(run.full[name].shape):
                    raise FusionNodeError(f"host {host[:12]} sent {name!r} in shape {tuple(t.shape)}")
                out[name] = t
        missing = set(run.host_of) - set(out)
        if missing:
            raise FusionNodeError(f"replica {replica}'s contribution misses {sorted(missing)[:3]}")
        return out

    @torch.no_grad()
    def _loss(
        self,
        theta: dict[str, torch.Tensor],
        delta: dict[str, torch.Tensor] | None,
        step: float,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> float:
        """The whole model's loss on (x, y) at θ − step·Δ (θ when `delta` is None)."""
        from fusionnode.train.local import lm_loss

        model = self.model
        for name, p in model.named_parameters():
            if name in theta:
                v = theta[name] if delta is None else theta[name] - step * delta[name]
                p.copy_(v.to(p.dtype))
        was = model.training
        model.eval()
        try:
            return float(lm_loss(model(x), y))
        finally:
            model.train(was)

    def totals(self) -> dict[str, Any]:
        return {
            **self.policy.to_dict(),
            "rounds_scored": self.rounds,
            "dropped": {str(r): n for r, n in sorted(self.dropped.items())},
            "failed": self.failed,
            "judge_s": round(self.seconds, 3),
        }


__all__ = ["EVAL_INDEX_BASE", "SCORE_BUDGET", "RoundScorer", "job_contrib"]
