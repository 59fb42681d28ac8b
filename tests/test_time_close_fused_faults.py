"""Faults under `--round-close time` with *fused* replicas (one `job.step` per inner step, the
optimizer step on the stage, a round's close carried by the replica's next step: train/fused_rounds.py)
on the in-memory network. tests/test_time_close_faults.py runs the same faults on 2-stage replicas
under a clip, which never fuse; here every replica is one stage, so every replica fuses. The
fused-only cases: a worker that dies on the step that carries its round's deferred close (the round
was counted for it, its pseudo-gradient never arrives), and the segment that stops with a close still
pending (every other replica's close of the stopped round). Every round is closed once by every host
in the trajectory kept, and the losses are the replay of the recorded schedule."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec
from test_sync_faults import FaultySwarm, _a_worker, _first_host, recovered
from test_time_close_faults import (
    SPARSE_TOL,
    TOL,
    _follows,
    _kept,
    _ledger,
    _replay,
    _stopped_after_round_2_and_resumed,
    _timed,
)

from fusionnode.sync import SyncConfig
from fusionnode.train.free_rounds_local import load_restarts, load_schedule
from fusionnode.train.replicas import train_local_replicas
from fusionnode.wire.job import Rpc

torch.set_num_threads(1)

DILOCO = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
OVERLAP = SyncConfig("diloco", inner_steps=3, outer_lr=0.7, overlap=True, overlap_steps=1)
SPARSE = SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256)


def _fused_job(spec, sync, **extra):
    """2 replicas of ONE stage each: every replica fuses (train/fused_rounds.fuses)."""
    return round_job(spec, _timed(sync), stages=1, rebalance_every=0, contrib_policy="off", **extra)


def _all_fused(rounds: list[dict]) -> None:
    assert all(rep["fused"] for r in rounds for rep in r["replicas"]), "a replica did not fuse"


class CloseKiller(Swarm):
    """A Swarm whose first worker (not the driver's peer) taking a fused `job.step` that carries round `close`'s deferred
    close goes down on it: before the stage reads it (`after=False`: nothing of the round reaches the
    hosts) or once the stage ran it (`after=True`: its pseudo-gradient went out, the reply is lost)."""

    def __init__(self, tmp_path, workers: int, hosts: int, close: int, after: bool):
        super().__init__(tmp_path, workers=workers, hosts=hosts)
        self.close, self.after = close, after
        self.downed: list[str] = []
        for pid, t in self.net.peers.items():
            if pid in self.workers and pid != self.ids[0]:  # not the driver's own peer
                t._rpc[Rpc.JOB_STEP] = self._wrap(pid, t._rpc[Rpc.JOB_STEP])

    def _wrap(self, pid: str, handler):
        async def step(args: dict, sender: str):
            rnd = args.get("close_round")
            if rnd is not None and rnd.get("id") == self.close and not self.downed:
                self.downed.append(pid)
                if not self.after:
                    self.net.down.add(pid)
                    raise ConnectionError("the worker died")
                result = await handler(args, sender)
                self.net.down.add(pid)  # the call's reply is dropped (MemTransport.call)
                return result
            return await handler(args, sender)

        return step


@pytest.mark.parametrize(
    ("sync", "tol"),
    [(DILOCO, TOL), (OVERLAP, TOL), (SPARSE, SPARSE_TOL)],
    ids=["diloco", "diloco-overlap", "sparseloco"],
)
def test_a_fused_worker_dying_mid_round_costs_its_replica_that_round_only(tmp_path, sync, tol):
    """The other replica stops after the lost round with its close still pending: it is sent
    (`job.commit` close_only), so the hosts close the round with it."""
    spec = small_spec(steps=9, micro_batches=2, metrics_out=str(tmp_path / "m.jsonl"))
    s = FaultySwarm(tmp_path, workers=4, hosts=2, at=2, victim=_a_worker)  # after round 0's record
    closes = _ledger(s)
    result = asyncio.run(s.driver.run_job(_fused_job(spec, sync), s.emit))
    assert s.downed and result["steps"] == spec.steps
    rounds = s.steps()
    _all_fused(rounds)
    assert [r["round_closed"] for r in rounds] == [0, 1, 2]
    lost = [rep for rep in rounds[1]["replicas"] if rep.get("lost")]
    assert len(lost) == 1 and lost[0]["steps"] == 0
    assert rounds[2].get("restart") and not rounds[1].get("restart")
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 6 and rec[0]["rounds_applied"] == 2
    assert sorted(closes) == sorted(s.hosts) and all(c == [0, 1, 2] for c in closes.values()), closes
    assert all(h["rounds_closed"] == 3 for h in rounds[-1]["optimizer_hosts"])
    schedule, restarts = load_schedule(spec.metrics_out), load_restarts(spec.metrics_out)
    assert restarts["restart_rounds"] == [2]
    ref = train_local_replicas(spec, _timed(sync), replicas=2, round_steps=schedule, **restarts)
    _follows(rounds, ref, tol)


@pytest.mark.parametrize("after", [False, True], ids=["before-close", "after-close"])
@pytest.mark.parametrize("sync", [DILOCO, OVERLAP], ids=["diloco", "diloco-overlap"])
def test_a_fused_worker_dying_on_the_step_carrying_its_close(tmp_path, sync, after):
    """Round 1 was counted for the replica (its steps done, its close deferred to its next step), and
    the worker dies on that step. Before the close ran: the replica loses round 1 (weight 0, the hosts
    close it without it). After it ran: the hosts may hold its pseudo-gradient; a host that closed the
    round with it answers so and the record keeps its steps, else it is lost. Either way every host
    closes every round once and the losses follow the recorded schedule."""
    spec = small_spec(steps=9, micro_batches=2, metrics_out=str(tmp_path / "m.jsonl"))
    s = CloseKiller(tmp_path, workers=4, hosts=2, close=1, after=after)
    closes = _ledger(s)
    result = asyncio.run(asyncio.wait_for(s.driver.run_job(_fused_job(spec, sync), s.emit), 120))
    assert s.downed and result["steps"] == spec.steps
    rounds = s.steps()
    _all_fused(rounds)
    assert [r["round_closed"] for r in rounds] == [0, 1, 2], [r["round_closed"] for r in rounds]
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1
    # after the close ran, the hosts may have closed round 1 with it before the failure was seen:
    # then the replica loses the round its failed step was in, round 2 (the job's last)
    k = 1 if not after else rec[0]["rounds_applied"] - 1
    assert k in (1, 2) and rec[0]["replay_from"] == 3 * (k + 1) and rec[0]["rounds_applied"] == k + 1
    lost = [(q, rep) for q, r in enumerate(rounds) for rep in r["replicas"] if rep.get("lost")]
    if not after:
        assert len(lost) == 1 and lost[0][0] == 1 and lost[0][1]["steps"] == 0
    else:  # round 1 with its steps (the hosts took its close), or lost; round 2 lost
        assert [q for q, _ in lost] in ([], [1], [2]) and (k == 1 or [q for q, _ in lost] == [2])
    assert sorted(closes) == sorted(s.hosts) and all(c == [0, 1, 2] for c in closes.values()), closes
    assert all(h["rounds_closed"] == 3 for h in rounds[-1]["optimizer_hosts"])
    plans = [e for e in s.events if e["type"] == "plan"]
    assert s.downed[0] not in {st["peer"] for st in plans[-1]["stages"]}
    schedule, restarts = load_schedule(spec.metrics_out), load_restarts(spec.metrics_out)
    assert restarts["restart_rounds"] == ([2] if k == 1 else [])
    ref = train_local_replicas(spec, _timed(sync), replicas=2, round_steps=schedule, **restarts)
    _follows(rounds, ref)
    if not after:  # a real test: had its round-1 steps counted, round 2 would differ
        full = [list(c) for c in schedule]
        full[1] = [3 if c == 0 else c for c in full[1]]
        other = train_local_replicas(spec, _timed(sync), replicas=2, round_steps=full, **restarts)
        assert abs(other.losses[2] - rounds[2]["loss"]) > 3 * TOL


@pytest.mark.parametrize("sync", [DILOCO, OVERLAP], ids=["diloco", "diloco-overlap"])
def test_a_fused_job_loses_an_optimizer_host_and_redoes_the_rounds_since_the_checkpoint(tmp_path, sync):
    """As tests/test_time_close_faults.py's host test, fused: the host dies after round 2's record,
    while the replicas' closes of round 2 may be pending in their next steps (with --sync-overlap,
    round 2's exchange may be under way beside round 3's steps as well)."""
    spec = small_spec(steps=12, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=6)
    s = FaultySwarm(tmp_path, workers=3, hosts=3, at=8, victim=_first_host)
    closes = _ledger(s)
    result = asyncio.run(asyncio.wait_for(s.driver.run_job(_fused_job(spec, sync), s.emit), 120))
    assert s.downed and result["steps"] == spec.steps
    rec = {e.get("role"): e for e in recovered(s)}
    assert rec["rounds"]["replay_from"] == 6 and rec["rounds"]["rounds_applied"] == 2
    order = [r["round_closed"] for r in s.steps()]
    assert order[:3] == [0, 1, 2] and order[3:-2] in ([], [3]) and order[-2:] == [2, 3], order
    rounds = _kept(s)
    _all_fused(rounds)
    assert [r["round_closed"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[2].get("restart") and rounds[2].get("fresh_outer") and not rounds[3].get("restart")
    assert all(h["rounds_closed"] == 4 for h in rounds[-1]["optimizer_hosts"])
    plans = [e for e in s.events if e["type"] == "plan"]
    new = next(h for h in plans[-1]["optimizer_hosts"] if h not in plans[0]["optimizer_hosts"])
    kept = next(h for h in plans[-1]["optimizer_hosts"] if h != new)
    assert closes[s.downed[0]] in ([0, 1, 2], [0, 1, 2, 3]) and closes[new] == [2, 3]
    assert closes[kept] in ([0, 1, 2, 2, 3], [0, 1, 2, 3, 2, 3]), closes[kept]
    _follows(rounds, _replay(spec, _timed(sync), rounds, restart_rounds={2}, fresh_outer_rounds={2}))


@pytest.mark.parametrize(
    ("sync", "every", "tol"),
    [(DILOCO, 3, TOL), (OVERLAP, 3, TOL), (SPARSE, 6, SPARSE_TOL)],
    ids=["diloco", "diloco-overlap", "sparseloco"],
)
def test_a_fused_job_resumes_from_its_checkpoints(tmp_path, sync, every, tol):
    """Stopped after round 2's record (the replicas' closes of round 2 pending or sent), resumed.
    Sparseloco: checkpoints every 6 steps, so the hosts' and the driver's newest are both of step 6
    and the replicas' error feedback of round 1 comes back with it (the stages may have folded round
    2 in when it was fetched)."""
    spec = small_spec(steps=15, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=every)
    s = Swarm(tmp_path, workers=2, hosts=2)
    params = _fused_job(spec, sync)

    first, rounds, k = _stopped_after_round_2_and_resumed(s, spec, params)
    _all_fused(rounds)
    if sync.mode == "sparseloco":
        assert k == 2 and not rounds[0].get("fresh_feedback")
    kept = first[:k] + rounds
    _follows(kept, _replay(spec, _timed(sync), kept, restart_rounds={k}), tol)


class SlowJudge(CloseKiller):
    """A CloseKiller whose driver takes 1 s to record the scorer's judgement of round `close`: the
    worker's failed step (after its close ran, so after the hosts closed that round) is seen while
    the verdict is still under way (the window the race hit in 2 of about 10 runs)."""

    async def emit(self, event: dict) -> None:
        await super().emit(event)
        if event.get("kind") == "scored" and event.get("round") == self.close:
            await asyncio.sleep(1.0)


class LateDeath(CloseKiller):
    """A CloseKiller whose worker dies 1 s into the step carrying round `close`'s close, before it
    ran it: the other replica is in its own close-carrying step by then, and the records wait on the
    round's verdict, which is being judged (the path that recorded the round, then redid it, after
    the scorer's and the hosts' deadlines, in 2 of about 10 runs)."""

    def _wrap(self, pid: str, handler):
        inner = super()._wrap(pid, handler)

        async def step(args: dict, sender: str):
            rnd = args.get("close_round")
            if rnd is not None and rnd.get("id") == self.close and not self.downed:
                await asyncio.sleep(1.0)
            return await inner(args, sender)

        return step


class SlowVerdict(CloseKiller):
    """A CloseKiller (its close ran) whose failed step is seen only once round `close`'s verdict
    reached the first host, while the second answers it only after the driver gave up waiting for
    it (`judged` with JUDGED_S here, `short_judged`). Cancelling it there left the round closed on
    one host and redone by the driver (review6, finding 6)."""

    JUDGED_S = 0.3

    def __init__(self, tmp_path, workers: int, hosts: int, close: int, after: bool):
        super().__init__(tmp_path, workers=workers, hosts=hosts, close=close, after=after)
        self.sent = asyncio.Event()  # round `close`'s verdict is going out
        self.judging = asyncio.Event()  # the driver waits for it (`judged`)
        first, second = sorted(self.hosts)
        for pid in (first, second):
            t = self.net.peers[pid]

            async def verdict(args: dict, sender: str, pid=pid, handler=t._rpc[Rpc.OPT_ROUND_VERDICT]):
                if args.get("round") == self.close:
                    if pid == first:
                        self.sent.set()
                    else:  # past the time `judged` gives it
                        await self.judging.wait()
                        await asyncio.sleep(self.JUDGED_S + 0.2)
                return await handler(args, sender)

            t._rpc[Rpc.OPT_ROUND_VERDICT] = verdict

    def short_judged(self, monkeypatch) -> None:
        from fusionnode.train import free_recovery

        judged = free_recovery.judged

        async def short(scorer, rd, _timeout):
            self.judging.set()
            await judged(scorer, rd, self.JUDGED_S)

        monkeypatch.setattr(free_recovery, "judged", short)

    def _wrap(self, pid: str, handler):
        async def step(args: dict, sender: str):
            rnd = args.get("close_round")
            if rnd is not None and rnd.get("id") == self.close and not self.downed:
                self.downed.append(pid)
                result = await handler(args, sender)
                await self.sent.wait()
                self.net.down.add(pid)  # the call's reply is dropped (MemTransport.call)
                return result
            return await handler(args, sender)

        return step


@pytest.mark.parametrize(
    ("after", "kind"),
    [(False, CloseKiller), (False, LateDeath), (True, CloseKiller), (True, SlowJudge), (True, SlowVerdict)],
    ids=[
        "before-close",
        "before-close-late",
        "after-close",
        "after-close-slow-judge",
        "after-close-slow-verdict",
    ],
)
def test_a_fused_worker_dying_in_a_scored_round_has_the_round_redone(tmp_path, monkeypatch, after, kind):
    """--contrib-policy score (auto here): the round the replica lost is redone on the new plan
    when the worker dies on the step carrying round 1's close (before the close ran: round 1; after
    it: round 2, the hosts closed round 1 with it, its verdict awaited when still under way, to its
    end once it is being sent); each host closes each round once, each round has one record and one
    judgement, and the records are the replay's."""
    sync = _timed(DILOCO)
    spec = small_spec(steps=9, micro_batches=2)
    s = kind(tmp_path, workers=4, hosts=2, close=1, after=after)
    if kind is SlowVerdict:
        s.short_judged(monkeypatch)
    closes = _ledger(s)
    # the hosts' norm floor at its default (2 x the lower median per inner step): a redone round's
    # replica of 3 steps beside one of 1 keeps its weight, as the replay (no floor) has it
    params = round_job(spec, sync, stages=1, rebalance_every=0)
    result = asyncio.run(asyncio.wait_for(s.driver.run_job(params, s.emit), 120))
    assert s.downed and result["steps"] == spec.steps
    rounds = s.steps()
    assert [r["round_closed"] for r in rounds] == [0, 1, 2]
    assert result["contrib"]["rounds_scored"] == 3
    # no judgement ran out its budget waiting for the dead replica's part (nor the hosts their deadline)
    assert not [
        e for e in s.events if e.get("kind") == "scored" and (e.get("error") or e.get("verdict_errors"))
    ]
    _all_fused(rounds)
    assert not any(rep.get("lost") for r in rounds for rep in r["replicas"])
    assert all(c == [0, 1, 2] for c in closes.values()) and len(closes) == 2, closes
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    restart = next(r["round_closed"] for r in rounds if r.get("restart"))
    assert len(rec) == 1 and rec[0]["rounds_applied"] == restart
    if not after:
        assert restart == 1
    _follows(rounds, _replay(spec, sync, rounds, restart_rounds={restart}))


def test_inputs_fed_ahead_on_a_wrong_guess_are_dropped_at_the_next_step(tmp_path, monkeypatch):
    """One replica's worker 0.3 s slower per step: it is mid-step when the other ends each round, so
    the inputs it fed ahead for its next step of the round (the guess) are never read; its stage
    drops them (`Mailbox.drop_before`) at the next round's first step instead of holding them, and
    their bytes, until the job ends."""
    from fusionnode.runtime import mailbox

    dropped: list[tuple[int, int, int]] = []
    drop = mailbox.Mailbox.drop_before

    def counted(self, job, stage, step, kinds):
        n = drop(self, job, stage, step, kinds)
        if n:
            dropped.append((stage, step, n))
        return n

    monkeypatch.setattr(mailbox.Mailbox, "drop_before", counted)
    spec = small_spec(steps=12, micro_batches=2)
    s = Swarm(tmp_path, workers=2, hosts=2)
    t = s.net.peers[sorted(s.workers)[1]]
    step = t._rpc[Rpc.JOB_STEP]

    async def slow(args: dict, sender: str):
        await asyncio.sleep(0.3)
        return await step(args, sender)

    t._rpc[Rpc.JOB_STEP] = slow
    asyncio.run(asyncio.wait_for(s.driver.run_job(_fused_job(spec, DILOCO), s.emit), 120))
    rounds = s.steps()
    _all_fused(rounds)
    short = [q for q, r in enumerate(rounds) if min(rep["steps"] for rep in r["replicas"]) < 3]
    assert short, "no replica was cut short: nothing guessed wrong"
    # each round cut short (but the job's last) left one step's inputs and targets, 2 micro-batches
    assert sorted(st for _, st, _ in dropped) == [3 * (q + 1) for q in short if q + 1 < len(rounds)]
    assert all(n == 2 * spec.micro_batches for _, _, n in dropped)
