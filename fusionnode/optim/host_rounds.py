"""The optimizer host's side of the --sync diloco|sparseloco rounds (issue 19): the stages'
pseudo-gradients in, the outer step on the masters once every replica sent every name, the round's
update out (`opt.round_pull`), and a checkpoint of the shard with the outer state at the round
boundaries the job checkpoints. Mixed into `optim.host.OptimizerHostService`."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

import torch

from fusionnode.errors import FusionNodeError
from fusionnode.optim.checkpoint import save_shard
from fusionnode.optim.contributions import ExpectedContributions
from fusionnode.optim.rounds import RoundError
from fusionnode.verify.contrib import clip_scales
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError, TensorKind
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import decode_tensor, pack_encoded

logger = logging.getLogger(__name__)

READY_POLL_S = 0.005  # seconds between checks of a step's completeness or a round's closing


def _data_bytes(msg: TensorMessage) -> int:
    """Bytes of a data message's encoded tensors (descriptor and payload): what a host counts as received."""
    return sum(len(pack_encoded(enc)) for enc in msg.tensors.values())


class HostRounds:
    """Round handling of `OptimizerHostService`, which provides its shards, bans, transport, step
    deadline, `_shard` (a caller's shard or a JobError) and `_offence` (an offence counted, banned)."""

    shards: dict[str, Any]
    bans: Any
    t: Any
    step_deadline_s: float
    _offence: Any
    _shard: Any

    def _on_round(self, msg: TensorMessage, sender: str) -> None:
        """A stage's pseudo-gradients of a round (issue 19); the round closes, and the outer step is
        applied to the masters, when every replica sent every name of the shard."""
        m = msg.meta
        shard = self.shards.get(str(m.get("job")))
        if shard is None or shard.rounds is None:
            return
        key = str(m.get("contributor", ""))
        if shard.peers.get(key) != sender or self.bans.is_banned(sender):
            shard.rejected["not_in_plan"] = shard.rejected.get("not_in_plan", 0) + 1
            return
        shard.received_bytes += _data_bytes(msg)
        for name, enc in msg.tensors.items():
            spec = shard.specs.get(name)
            try:
                value = decode_tensor(enc)
            except Exception as exc:
                self._offence(shard, sender, "undecodable", str(exc)[:200])
                return
            if (
                spec is None
                or tuple(value.shape) != tuple(spec["shape"])
                or not bool(torch.isfinite(value).all())
            ):
                self._offence(shard, sender, "rejected_shape", f"round pseudo-gradient {name}")
                return
        try:
            # the replica is the one the plan gives the sender's contributor key, and its weight what the
            # plan gives that replica (samples per step; every replica runs the same steps of the same
            # length in a round closed by step count): never what a worker claims
            replica = shard.replica_of.get(key)
            if replica is None:
                raise RoundError(f"contributor {key!r} is not in this job's plan")
            weight = float(shard.replica_samples[replica])
            complete = shard.rounds.add(int(m["step"]), replica, weight, dict(msg.tensors))
        except (RoundError, KeyError, TypeError, ValueError) as exc:
            shard.rejected["round"] = shard.rejected.get("round", 0) + 1
            logger.warning("round contribution from %s refused: %s", sender[:12], exc)
            return
        # held (--contrib-policy score): the driver's verdict closes it
        if complete and not shard.rounds.hold:
            self._close_round(shard)

    def _close_round(self, shard: Any, verdict: list[float] | None = None) -> list[float]:
        """The outer step of the open (complete) round on the masters, the update kept for the
        workers' pulls, a checkpoint when due; returns each replica's weight in it."""
        rounds = shard.rounds
        # the store's applied step is the round ledger's step count: a re-plan or a restore
        # answers it, and the driver goes on from the open round's first step
        update = shard.store.update_masters(
            functools.partial(rounds.close, verdict=verdict),
            applied_step=rounds.cfg.round_start(rounds.round + 1),
        )
        shard.round_updates[update.round] = update
        for old in [r for r in shard.round_updates if r < update.round - 1]:
            del shard.round_updates[old]
        done = shard.store.applied_step
        if shard.save_dir is not None and rounds.cfg.checkpoint_due(done, shard.save_every):
            self._save_round(shard, done, rounds.state())
        return list(rounds.last_weights)

    @staticmethod
    def _set_contrib(shard: Any, contrib: dict[str, Any] | None) -> None:
        """--contrib-policy on this shard's rounds (`OptInit.contrib`; verify/contrib.py)."""
        if shard.rounds is not None and contrib:
            shard.rounds.clip = float(contrib["clip"]) if contrib.get("clip") is not None else None
            shard.rounds.hold = bool(contrib.get("score"))

    async def _complete_round(self, shard: Any, round_id: int, verdict: list[float] | None = None) -> Any:
        """The shard's rounds once round `round_id` is open and complete (waits up to the deadline);
        with a `verdict`, complete in the replicas it keeps (`RoundCombiner.complete`)."""
        rounds = shard.rounds
        if rounds is None:
            raise JobError(ErrorCode.BAD_REQUEST, f"job {shard.job} has no rounds (--sync step)")
        deadline = time.monotonic() + self.step_deadline_s
        while not (rounds.round == round_id and rounds.complete(verdict)) and time.monotonic() < deadline:
            if rounds.round > round_id:
                break
            await asyncio.sleep(READY_POLL_S)
        if rounds.round > round_id:
            raise JobError(ErrorCode.BAD_REQUEST, f"round {round_id} is closed (open: {rounds.round})")
        if rounds.round != round_id or not rounds.complete(verdict):
            raise JobError(ErrorCode.DEADLINE, f"round {round_id} was not complete in time")
        return rounds

    async def rpc_round_held(self, req: jp.OptRoundHeld, sender: str) -> jp.OptRoundHeldReply:
        """The driver's view of a complete round held for its verdict: each replica's norm and floor
        scale, and with `replica` >= 0 that replica's pseudo-gradients of the shard as one
        `round_contrib` message keyed (job, round, replica, host index)."""
        shard = self._shard(req.job, sender)
        rounds = await self._complete_round(shard, req.round)
        if req.replica >= rounds.replicas:
            raise JobError(ErrorCode.BAD_REQUEST, f"replica {req.replica} of {rounds.replicas}")
        gram = await asyncio.to_thread(rounds.gram)
        norms = [math.sqrt(max(gram[r][r], 0.0)) for r in range(rounds.replicas)]
        scales = clip_scales(norms, rounds.clip) if rounds.clip is not None else [1.0] * len(norms)
        if req.replica >= 0:
            meta = {"job": shard.job, "step": req.round, "mb": req.replica, "stage": shard.host_index}
            encs = rounds.pending[req.replica][1]
            shard.sent_bytes += await self.t.send(
                sender, TensorMessage(TensorKind.ROUND_CONTRIB, meta, dict(encs))
            )
        tokens = [rounds.pending[r][0] for r in range(rounds.replicas)]
        return jp.OptRoundHeldReply(
            replicas=rounds.replicas, norms=norms, scales=scales, tokens=tokens, gram=gram
        )

    async def rpc_round_verdict(self, req: jp.OptRoundVerdict, sender: str) -> jp.OptRoundVerdictReply:
        """The driver's verdict on a held round: each replica's weight (1 kept, 0 dropped), times the
        floor's; the round closes with it, once the replicas it keeps sent their contributions (one it
        drops may have sent nothing: --round-close time, a replica that lost its round). A verdict on
        a round closed already answers its weights."""
        shard = self._shard(req.job, sender)
        rounds = shard.rounds
        if rounds is not None and req.round == rounds.round - 1:
            return jp.OptRoundVerdictReply(closed=False, weights=list(rounds.last_weights))
        if rounds is not None and len(req.weights) != rounds.replicas:
            raise JobError(ErrorCode.BAD_REQUEST, f"a verdict needs {rounds.replicas} weights")
        rounds = await self._complete_round(shard, req.round, list(req.weights))
        try:  # on the loop, as a round closed by its last push is
            weights = self._close_round(shard, list(req.weights))
        except RoundError as exc:
            raise JobError(ErrorCode.BAD_REQUEST, str(exc)) from None
        return jp.OptRoundVerdictReply(closed=True, weights=weights)

    def _save_round(self, shard: Any, step: int, state: Any) -> None:
        """Writes the shard with the rounds' outer state after a round (in a thread; the state was
        taken when the round closed, the store's is taken at `step` or the save is skipped)."""

        async def save() -> None:
            try:
                await asyncio.to_thread(
                    functools.partial(save_shard, owner=shard.owner, rounds=state),
                    shard.save_dir,
                    shard.job,
                    f"h{shard.host_index}",
                    step,
                    shard.store,
                )
            except (OSError, FusionNodeError) as exc:  # the previous checkpoint stays; training goes on
                logger.error("could not write the shard checkpoint of round step %d: %s", step, exc)

        task = asyncio.get_running_loop().create_task(save())
        shard.saves.add(task)
        task.add_done_callback(shard.saves.discard)

    async def rpc_round_pull(self, req: jp.OptRoundPull, sender: str) -> jp.CountReply:
        """Waits (up to the step deadline) until round `round` is closed, then sends the caller the
        update of `names`: u per name (diloco), or every replica's message per name, its weight in
        the meta (sparseloco; the caller's `replica`'s own message without the names it `kept`)."""
        shard = self._shard(req.job, sender, driver_only=False)
        if sender not in set(shard.peers.values()):
            raise JobError(ErrorCode.FORBIDDEN, "only the job's workers may pull a round")
        if not 0 <= req.first < 1 << 40:
            raise JobError(ErrorCode.BAD_REQUEST, f"first must be in [0, 2^40), got {req.first}")
        names = list(req.names)
        if any(n not in shard.specs for n in names):
            raise JobError(ErrorCode.NOT_HELD, "this host does not hold all of those names")
        deadline = time.monotonic() + self.step_deadline_s
        while req.round not in shard.round_updates and time.monotonic() < deadline:
            if shard.rounds is None or shard.rounds.round > req.round + 1:
                break
            await asyncio.sleep(READY_POLL_S)
        kept = set(req.kept)
        if not kept <= set(names):
            raise JobError(ErrorCode.BAD_REQUEST, "kept must be some of the names asked")
        update = shard.round_updates.get(req.round)
        if update is None:
            raise JobError(
                ErrorCode.DEADLINE, f"round {req.round} was not closed in time (missing contributions)"
            )
        # one message for all the names (diloco's u), or one per replica (sparseloco): a message per
        # name and replica cost a round of several hosts more than a second on a loaded machine. The
        # caller's own replica's message leaves out the names it `kept` (it sent them): meta `own`
        if update.mode == "diloco":
            series = [({name: update.updates[name] for name in names}, None, False)]
        else:
            series = [
                (
                    {name: encs[name] for name in names if r != req.replica or name not in kept},
                    w,
                    r == req.replica,
                )
                for (w, encs), r in zip(update.relayed, update.relayed_replicas, strict=True)
            ]
        for idx, (tensors, weight, own) in enumerate(series):
            meta = {"job": shard.job, "step": req.round, "mb": req.first + idx, "stage": req.stage}
            if weight is not None:
                meta["weight"] = weight
            if own:
                meta["own"] = True
            shard.sent_bytes += await self.t.send(
                sender, TensorMessage(TensorKind.ROUND_UPDATE, meta, tensors)
            )
        return jp.CountReply(count=len(series))

    @staticmethod
    def _plan_replicas(shard: Any, expected: ExpectedContributions) -> None:
        """The replica of each contributor key and each replica's samples per step, from the plan."""
        shard.replica_of, shard.replica_samples = {}, {}
        for contribs in expected.by_name.values():
            for key, c in contribs.items():
                shard.replica_of[key] = int(c.replica)
                shard.replica_samples[int(c.replica)] = c.samples
