"""Faults under `--round-close time` on the in-memory network (tests/memnet.py; train/free_recovery.py):
a worker that dies mid-round costs its replica that round only (the round closes without it and the
job goes on at the next round on a new plan), an optimizer host that dies mid-round is replaced from
the checkpoints and the rounds since redone, a job resumes from its checkpoints. Every round is
closed exactly once by every host in the trajectory kept, and the losses are the replay
(`train_local_replicas(round_steps=...)`, what `train --local --round-steps FILE` runs) of the
schedule the swarm recorded, with the rounds that ran on new stages restarted."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from test_components import Swarm, round_job, small_spec
from test_sync_faults import FaultySwarm, Interrupted, _a_worker, _first_host, recovered

from fusionnode import cli
from fusionnode.sync import SyncConfig
from fusionnode.train.free_rounds_local import load_restarts, load_schedule
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

torch.set_num_threads(1)

TOL = 1e-4
SPARSE_TOL = 1e-3  # sparseloco: top-k and 2-bit bins may flip on near-ties


def _timed(sync: SyncConfig) -> SyncConfig:
    return dataclasses.replace(sync, round_close="time")


def _ledger(s: Swarm) -> dict[str, list[int]]:
    """Each host's rounds closed, in order (wrapped around the hosts' `_close_round`)."""
    closes: dict[str, list[int]] = {}
    for pid, host in s.hosts.items():
        close = host._close_round

        def counted(shard, verdict=None, pid=pid, close=close):
            closes.setdefault(pid, []).append(shard.rounds.round)
            return close(shard, verdict)

        host._close_round = counted
    return closes


def _kept(s: Swarm) -> list[dict]:
    """The round records of the trajectory kept: each round's last run."""
    return list({e["round_closed"]: e for e in s.steps()}.values())


def _replay(spec, sync, rounds: list[dict], **restarts):
    schedule = [[rep["steps"] for rep in r["replicas"]] for r in rounds]
    return train_local_replicas(spec, sync, replicas=2, round_steps=schedule, **restarts)


def _follows(rounds: list[dict], ref, tol: float = TOL) -> None:
    for q, (r, want) in enumerate(zip(rounds, ref.losses, strict=True)):
        assert abs(r["loss"] - want) < tol, f"round {q}: swarm {r['loss']:.6f} vs replay {want:.6f}"
        for x, y in zip(r["replicas"], ref.records[q]["replicas"], strict=True):
            assert x["steps"] == y["steps"]
            if x["steps"]:
                assert abs(x["loss"] - y["loss"]) < tol, (q, x, y)


@pytest.mark.parametrize(
    ("sync", "tol"),
    [
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9), TOL),
        (SyncConfig("diloco", inner_steps=3, outer_lr=0.7, overlap=True, overlap_steps=1), TOL),
        # the new stages start new error feedback (the reference's fresh_feedback_rounds)
        (SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256), SPARSE_TOL),
    ],
    ids=["diloco", "diloco-overlap", "sparseloco"],
)
def test_a_worker_dying_mid_round_costs_its_replica_that_round_only(tmp_path, sync, tol):
    sync = _timed(sync)
    spec = small_spec(steps=9, micro_batches=2, metrics_out=str(tmp_path / "m.jsonl"))
    s = FaultySwarm(tmp_path, workers=5, hosts=2, at=2, victim=_a_worker)  # after round 0's record
    closes = _ledger(s)
    params = round_job(spec, sync, rebalance_every=0, contrib_policy="off")  # (scored: the next test)
    result = asyncio.run(s.driver.run_job(params, s.emit))
    assert s.downed and result["steps"] == spec.steps
    rounds = s.steps()
    assert [r["round_closed"] for r in rounds] == [0, 1, 2]  # nothing redone
    lost = [rep for rep in rounds[1]["replicas"] if rep.get("lost")]
    assert len(lost) == 1 and lost[0]["steps"] == 0 and lost[0]["tokens"] == 0
    assert rounds[1]["tokens"] == sum(rep["tokens"] for rep in rounds[1]["replicas"]) > 0
    assert rounds[2].get("restart") and not rounds[1].get("restart")
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 6 and rec[0]["rounds_applied"] == 2
    assert rec[0]["lost_replicas"] == [lost[0]["replica"]]
    # the ledger: every host closed each round once, and the records follow it
    assert sorted(closes) == sorted(s.hosts) and all(c == [0, 1, 2] for c in closes.values())
    assert all(h["rounds_closed"] == 3 for h in rounds[-1]["optimizer_hosts"])
    plans = [e for e in s.events if e["type"] == "plan"]
    assert s.downed[0] not in {st["peer"] for st in plans[-1]["stages"]}
    # the replay of the metrics file (what `train --local --round-steps FILE` reads)
    schedule, restarts = load_schedule(spec.metrics_out), load_restarts(spec.metrics_out)
    assert schedule == [[rep["steps"] for rep in r["replicas"]] for r in rounds]
    feedback = [2] if sync.mode == "sparseloco" else []
    assert restarts == {"restart_rounds": [2], "fresh_outer_rounds": [], "fresh_feedback_rounds": feedback}
    ref = train_local_replicas(spec, sync, replicas=2, round_steps=schedule, **restarts)
    _follows(rounds, ref, tol)
    if sync.mode == "diloco":  # a real test: had the lost replica's partial round reached the outer
        # step, round 2 would differ (sparseloco's top-k moves it less than its tolerance)
        partial = [[1 if c == 0 else c for c in counts] for counts in schedule]
        other = train_local_replicas(spec, sync, replicas=2, round_steps=partial, **restarts)
        assert abs(other.losses[2] - rounds[2]["loss"]) > 3 * tol


def test_a_worker_dying_in_a_scored_round_has_the_round_redone(tmp_path):
    """--contrib-policy score (auto here): the scorer judges complete rounds only, so the round a
    replica lost gets no verdict; the re-plan drops what the hosts hold of it and it is redone from
    its start on the new plan: applied once."""
    sync = _timed(SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9))
    spec = small_spec(steps=9, micro_batches=2)
    s = FaultySwarm(tmp_path, workers=5, hosts=2, at=2, victim=_a_worker)
    closes = _ledger(s)
    result = asyncio.run(s.driver.run_job(round_job(spec, sync, rebalance_every=0), s.emit))
    assert s.downed and result["steps"] == spec.steps and result["contrib"]["rounds_scored"] == 3
    rounds = s.steps()
    assert [r["round_closed"] for r in rounds] == [0, 1, 2]
    assert rounds[1].get("restart") and not any(rep.get("lost") for r in rounds for rep in r["replicas"])
    rec = [e for e in recovered(s) if e.get("role") == "rounds"]
    assert len(rec) == 1 and rec[0]["replay_from"] == 3 and rec[0]["rounds_applied"] == 1
    assert all(c == [0, 1, 2] for c in closes.values()) and len(closes) == 2
    _follows(rounds, _replay(spec, sync, rounds, restart_rounds={1}))


def test_an_optimizer_host_dying_mid_round_is_replaced_and_the_rounds_since_redone(tmp_path):
    """Checkpoints every 6 steps (rounds of 3); the host dies in round 3 (after round 2's record):
    every host restarts from the driver's step-6 checkpoint (the new host cannot read the dead one's
    disk: new outer state), so rounds 2 and 3 are redone. The hosts' ledger went back with the
    restore: each round is applied once in the trajectory kept."""
    sync = _timed(SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9))
    spec = small_spec(steps=12, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=6)
    s = FaultySwarm(tmp_path, workers=4, hosts=3, at=8, victim=_first_host)  # after round 2's record
    closes = _ledger(s)
    result = asyncio.run(s.driver.run_job(round_job(spec, sync, rebalance_every=0), s.emit))
    assert s.downed and result["steps"] == spec.steps
    rec = {e.get("role"): e for e in recovered(s)}
    assert rec["optimizer"]["replay_from"] == 6 and rec["optimizer"]["fresh_optimizer"]
    assert rec["rounds"]["replay_from"] == 6 and rec["rounds"]["rounds_applied"] == 2
    plans = [e for e in s.events if e["type"] == "plan"]
    assert s.downed[0] not in plans[-1]["optimizer_hosts"]
    # round 3 may have closed (and been recorded) before the host's death was noticed: redone too
    order = [r["round_closed"] for r in s.steps()]
    extra = order[3:-2]
    assert order[:3] == [0, 1, 2] and extra in ([], [3]) and order[-2:] == [2, 3], order
    rounds = _kept(s)
    assert [r["round_closed"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[2].get("restart") and rounds[2].get("fresh_outer") and not rounds[3].get("restart")
    assert all(h["rounds_closed"] == 4 for h in rounds[-1]["optimizer_hosts"])
    new = next(h for h in plans[-1]["optimizer_hosts"] if h not in plans[0]["optimizer_hosts"])
    kept = next(h for h in plans[-1]["optimizer_hosts"] if h != new)
    # the dead host closed 0..2 (and 3, had a verdict reached it as it died); the one kept 0..2 (3),
    # then, restored to step 6, 2 and 3 once each; the new one 2 and 3
    assert set(closes) == {s.downed[0], kept, new}
    assert closes[s.downed[0]] in ([0, 1, 2], [0, 1, 2, 3]) and closes[new] == [2, 3]
    assert closes[kept] in ([0, 1, 2, 2, 3], [0, 1, 2, 3, 2, 3]), closes[kept]
    ref = _replay(spec, sync, rounds, restart_rounds={2}, fresh_outer_rounds={2})
    _follows(rounds, ref)


def _stopped_after_round_2_and_resumed(s: Swarm, spec, params: dict) -> tuple[list, list, int]:
    """Runs `params` on `s` until round 2's record (the hosts' shard checkpoints given time to be
    written), then resumes it to the end; checks the resumed rounds restart (with the outer state kept)
    from the round after the newest checkpoint and returns (the first run's rounds, the resumed run's,
    the first resumed round)."""

    async def stop_after_round_2(event: dict) -> None:
        s.events.append(event)
        if event["type"] == "step" and event["round_closed"] == 2:
            await asyncio.sleep(0.5)  # the hosts' shard checkpoints are written in threads
            raise Interrupted

    with pytest.raises(Interrupted):
        asyncio.run(s.driver.run_job(params, stop_after_round_2))
    first = s.steps()
    assert [r["round_closed"] for r in first] == [0, 1, 2]
    s.events.clear()
    result = asyncio.run(s.driver.run_job({**params, "resume": True}, s.emit))
    assert result["steps"] == spec.steps
    rounds = s.steps()
    # the driver's newest checkpoint is of step 6 (its step-9 one waits for round 2's record, which
    # stopped the job); the hosts' shards may be of step 9 (they save as they close a round)
    k = rounds[0]["round_closed"]
    assert k in (2, 3) and [r["round_closed"] for r in rounds] == list(range(k, 5))
    assert rounds[0].get("restart") and not rounds[0].get("fresh_outer")
    assert rounds[0]["rounds_applied"] == k + 1 and rounds[-1]["rounds_applied"] == 5
    return first, rounds, k


def test_a_resumed_job_continues_the_rounds_from_its_checkpoints(tmp_path):
    """Stopped after round 2's record (H = 3, checkpoints every 3 steps), resumed: the hosts' shard
    checkpoints hold the masters, the ledger and the outer Nesterov buffer, so the resumed rounds are
    the replay's with new inner optimizers from the resumed round on."""
    sync = _timed(SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9))
    spec = small_spec(steps=15, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=3)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync, rebalance_every=0)

    first, rounds, k = _stopped_after_round_2_and_resumed(s, spec, params)
    kept = first[:k] + rounds
    _follows(kept, _replay(spec, sync, kept, restart_rounds={k}))
    # the outer state came back: with a new one the resumed rounds would differ
    fresh = _replay(spec, sync, kept, restart_rounds={k}, fresh_outer_rounds={k})
    assert abs(fresh.losses[4] - rounds[-1]["loss"]) > 3 * TOL


def test_a_resumed_sparseloco_job_keeps_its_error_feedback(tmp_path):
    """Checkpoints every 6 steps (H = 3), stopped after round 2's record: the driver's step-6
    checkpoint holds each replica's error feedback as it was after round 1 (taken while the stages
    may be folding round 2 in: `FetchRequest.round`), so the resumed job goes on with it rather than
    with new accumulators, and follows the replay that keeps them."""
    sync = _timed(SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256))
    spec = small_spec(steps=15, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=6)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, sync, rebalance_every=0)

    first, rounds, k = _stopped_after_round_2_and_resumed(s, spec, params)
    assert k == 2 and not rounds[0].get("fresh_feedback")  # the hosts save at 6 and 12 only
    assert not [e for e in s.events if e.get("kind") == "resume" and "feedback" in e.get("reason", "")]
    kept = first[:k] + rounds
    _follows(kept, _replay(spec, sync, kept, restart_rounds={k}), SPARSE_TOL)
    # the feedback came back: with new accumulators the resumed rounds would differ
    fresh = _replay(spec, sync, kept, restart_rounds={k}, fresh_feedback_rounds={k})
    print("fresh-feedback deviation", [abs(a - r["loss"]) for a, r in zip(fresh.losses, kept, strict=True)])
    assert max(abs(a - r["loss"]) for a, r in zip(fresh.losses[k:], rounds, strict=True)) > SPARSE_TOL


def test_a_stage_keeps_the_error_feedback_of_the_round_before_the_one_it_folds():
    """What `job.fetch` what="feedback" round=q answers (runtime/rounds.py `feedback_state`): the
    accumulators after round q while the stage folds (or has folded) q + 1, the live ones after the
    last fold, and not_held for any other round; `round` is ignored with another `what`."""
    from fusionnode.runtime.rounds import StageRounds
    from fusionnode.wire import job as jp

    sync = SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256)
    st = StageRounds(sync, {"w": torch.nn.Parameter(torch.zeros(512))})
    gen = torch.Generator().manual_seed(0)
    st._fold(0, {"w": torch.randn(512, generator=gen)})
    after_0 = st.feedback_state(0)["w"].clone()
    assert torch.equal(st.feedback_state()["w"], after_0)
    st._fold(1, {"w": torch.randn(512, generator=gen)})
    assert torch.equal(st.feedback_state(0)["w"], after_0)
    assert not torch.equal(st.feedback_state(1)["w"], after_0)
    assert torch.equal(st.feedback_state(1)["w"], st.sender.feedback.acc["w"])
    with pytest.raises(jp.JobError) as err:
        st.feedback_state(3)
    assert err.value.code == jp.ErrorCode.NOT_HELD
    assert jp.FetchRequest(job="j", stage=0, what="feedback", round=4).round == 4
    with pytest.raises(jp.JobError):
        jp.FetchRequest(job="j", stage=0, what="feedback", round=-2)


def test_a_schedule_with_a_lost_round_and_restarts_replays_from_the_metrics_file(tmp_path):
    """The reference's side: a replica with 0 steps has no part in the round's outer step, and a
    metrics file's redone rounds count once (their last run)."""
    spec = small_spec(steps=6)
    sync = _timed(SyncConfig("diloco", inner_steps=3, outer_lr=0.7, outer_momentum=0.9))
    m = tmp_path / "m.jsonl"
    recs = [
        {"round_closed": 0, "replicas": [{"steps": 3}, {"steps": 2}]},
        {"round_closed": 1, "replicas": [{"steps": 1}, {"steps": 3}]},  # redone below
        {"round_closed": 1, "replicas": [{"steps": 3}, {"steps": 0, "lost": True}], "restart": True},
    ]
    m.write_text("\n".join(json.dumps({"type": "step", **r}) for r in recs))
    assert load_schedule(str(m)) == [[3, 2], [3, 0]]
    assert load_restarts(str(m))["restart_rounds"] == [1]
    got = train_local_replicas(spec, sync, replicas=2, round_steps=[[3, 2], [3, 0]], restart_rounds={1})
    assert got.records[1]["replicas"][1] == {
        "replica": 1,
        "steps": 0,
        "tokens": 0,
        "loss": None,
        "lost": True,
    }
    assert got.records[1]["tokens"] == got.records[1]["replicas"][0]["tokens"]
    with_it = train_local_replicas(spec, sync, replicas=2, round_steps=[[3, 2], [3, 1]], restart_rounds={1})
    assert abs(with_it.val_loss - got.val_loss) > 1e-5


def test_the_cli_replay_of_a_metrics_file_takes_its_lost_rounds_and_restarts(tmp_path, capsys):
    """`train --local --round-close time --round-steps FILE` replays what the file says: round 1 lost
    by replica 1, round 2 run on new stages (what a swarm run's metrics file holds after a worker
    died in round 1)."""
    m = tmp_path / "swarm.jsonl"
    recs = [
        {"round_closed": 0, "replicas": [{"steps": 2}, {"steps": 1}]},
        {"round_closed": 1, "replicas": [{"steps": 2}, {"steps": 0, "lost": True}]},
        {"round_closed": 2, "replicas": [{"steps": 1}, {"steps": 2}], "restart": True},
    ]
    m.write_text("\n".join(json.dumps({"type": "step", **r}) for r in recs))
    cli.main(
        ["train", "--local", "--replicas", "2", "--steps", "6", "--batch-size", "8", "--seq-len", "16",
         "--sync", "diloco", "--inner-steps", "2", "--round-close", "time", "--round-steps", str(m),
         "--json"]
    )  # fmt: skip
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    got = [r for r in got if r.get("type") == "step"]
    assert [[rep["steps"] for rep in r["replicas"]] for r in got] == [[2, 1], [2, 0], [1, 2]]
    spec = JobSpec(steps=6, batch_size=8, seq_len=16)
    sync = _timed(SyncConfig("diloco", inner_steps=2))
    schedule = [[2, 1], [2, 0], [1, 2]]
    want = train_local_replicas(spec, sync, replicas=2, round_steps=schedule, restart_rounds={2}).losses
    plain = train_local_replicas(spec, sync, replicas=2, round_steps=schedule).losses
    assert [r["loss"] for r in got] == pytest.approx(want, abs=1e-6)
    assert abs(plain[2] - want[2]) > 1e-4  # the restart is a real difference
