"""Rounds closed by time (`--round-close time`, issue 19): the in-process replay of a schedule, the
hosts' token weights, bad input, and real daemons following the replay round by round."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import pytest
import torch

from fusionnode import cli, control
from fusionnode.errors import ConfigError
from fusionnode.localswarm import LocalSwarm
from fusionnode.optim.rounds import RoundCombiner
from fusionnode.runtime.hooks import DEBUG_SLOW_FILE
from fusionnode.sync import SyncConfig
from fusionnode.train.free_rounds_local import check_schedule, load_schedule, token_verdict
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec
from fusionnode.wire.tensors import encode_tensor

torch.set_num_threads(1)
SPEC = JobSpec(steps=7, batch_size=4, seq_len=16, warmup_steps=1)


def _timed(sync: SyncConfig) -> SyncConfig:
    return dataclasses.replace(sync, round_close="time")


@pytest.mark.parametrize("overlap", [{}, {"overlap": True, "overlap_steps": 1}])
@pytest.mark.parametrize("mode", ["diloco", "sparseloco"])
def test_replay_of_full_rounds_is_the_step_closed_run(mode, overlap) -> None:
    sync = SyncConfig(mode, inner_steps=3, **overlap)
    steps = train_local_replicas(SPEC, sync, shares=[1, 3])
    timed = train_local_replicas(SPEC, _timed(sync), shares=[1, 3], round_steps=[[3, 3], [3, 3], [1, 1]])
    for name, p in steps.params.items():
        assert torch.equal(p, timed.params[name]), name
    # one record per round: its last step, each replica's steps and the tokens fed to it
    assert [r["step"] for r in timed.records] == [2, 5, 6]
    assert timed.records[0]["replicas"][1] == {
        "replica": 1,
        "steps": 3,
        "tokens": 3 * 3 * 16,
        "loss": pytest.approx(sum(steps.losses[:3]) / 3, abs=0.5),
    }
    uneven = train_local_replicas(SPEC, _timed(sync), shares=[1, 3], round_steps=[[3, 1], [2, 3], [1, 1]])
    assert abs(uneven.val_loss - timed.val_loss) > 1e-4
    assert [r["tokens"] for r in uneven.records] == [(3 + 3) * 16, (2 + 9) * 16, (1 + 3) * 16]


def test_hosts_weigh_the_tokens_the_driver_fed_not_the_plan_or_a_claim() -> None:
    # the hosts know each replica's samples per step from the plan (2 and 6); the driver's verdict
    # carries its steps over the round's most: replica 0 did 5 steps, replica 1 did 1 -> tokens 10:6
    cfg = SyncConfig("diloco", inner_steps=5, outer_lr=1.0, outer_momentum=0.0)
    host = RoundCombiner(cfg, replicas=2)
    host.hold = True
    host.add(0, 0, 2, {"w": encode_tensor(torch.tensor([8.0]), "raw")})
    host.add(0, 1, 6, {"w": encode_tensor(torch.tensor([0.0]), "raw")})
    theta = {"w": torch.tensor([0.0])}
    host.close(theta, verdict=token_verdict([5, 1]))
    assert host.last_weights == pytest.approx([2.0, 6 / 5])
    assert theta["w"].item() == pytest.approx(-8.0 * 10 / 16)
    with pytest.raises(ValueError, match="a round needs a replica"):
        token_verdict([0, 0])


def test_schedules_that_do_not_fit_the_job_are_refused(tmp_path) -> None:
    sync = _timed(SyncConfig("diloco", inner_steps=3))
    assert check_schedule(SPEC, sync, 2, [[3, 1], [2, 3], [1, 1]])
    # 0: a replica that lost its round (train/free_recovery.py); the one at the limit may be it
    assert check_schedule(SPEC, sync, 2, [[3, 0], [0, 2], [1, 1]])
    for bad, says in [
        ([[3, 1], [2, 3]], "2 rounds given; the job has 3"),
        ([[3, 1], [2, 3], [1, 1, 1]], "round 2 needs 2 step counts"),
        ([[0, 0], [2, 3], [1, 1]], "round 0 needs 2 step counts in [0, 3], not all 0"),
        ([[4, 1], [2, 3], [1, 1]], "in [0, 3]"),
        ([[2, 2], [2, 3], [1, 1]], "round 0: no replica did the round's 3 steps"),
    ]:
        with pytest.raises(ConfigError, match=f"--round-steps: .*{bad and ''}"):
            check_schedule(SPEC, sync, 2, bad)
        with pytest.raises(ConfigError) as info:
            check_schedule(SPEC, sync, 2, bad)
        assert says in str(info.value)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps({"type": "step", "replicas": [{"steps": a}, {"steps": b}]})
            for a, b in [(3, 1), (2, 3)]
        )
    )
    assert load_schedule(str(metrics)) == [[3, 1], [2, 3]]
    (tmp_path / "junk").write_text("{oops")
    with pytest.raises(ConfigError, match="neither a JSON list nor a metrics file"):
        load_schedule(str(tmp_path / "junk"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sync", "diloco", "--round-close", "hourly"], "argument --round-close: invalid choice"),
        (["--round-close", "time"], "--round-close time: --sync step has no rounds"),
        (["--sync", "diloco", "--round-close", "time"], "give --round-steps"),
        (
            ["--sync", "diloco", "--round-steps", "x.json"],
            "--round-steps: a schedule of rounds closed by time",
        ),
        (
            ["--sync", "diloco", "--round-close", "time", "--round-steps", "nope.json"],
            "--round-steps nope.json",
        ),
    ],
)
def test_bad_time_close_options_exit_2_naming_the_option(tmp_path, capsys, args, says) -> None:
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(SystemExit) as info:
        cli.main(
            ["train", "--local", "--replicas", "2", "--steps", "4", "--metrics-out", str(metrics), *args]
        )
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert says in err.strip().splitlines()[-1], err
    assert not metrics.exists()


@pytest.mark.parametrize("where", [[], ["--local", "--replicas", "2"]])
@pytest.mark.parametrize("asked", ["sample", "all"])
def test_asked_for_checks_with_time_closed_rounds_exit_2_before_anything_starts(
    tmp_path, capsys, where, asked
) -> None:
    # no daemon runs here: the swarm command is refused before it contacts one
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(SystemExit) as info:
        cli.main(
            ["train", "--state-dir", str(tmp_path / "none"), *where, "--steps", "4", "--sync", "diloco",
             "--round-close", "time", "--verify-policy", asked, "--metrics-out", str(metrics)]
        )  # fmt: skip
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"--round-close time with --verify-policy {asked}" in err.strip().splitlines()[-1], err
    assert not metrics.exists()


def test_bad_schedule_file_exits_2(tmp_path, capsys) -> None:
    sched = tmp_path / "s.json"
    sched.write_text("[[2, 1]]")  # 4 steps at H = 2 are 2 rounds
    with pytest.raises(SystemExit) as info:
        cli.main(
            ["train", "--local", "--replicas", "2", "--steps", "4", "--sync", "diloco", "--inner-steps", "2",
             "--round-close", "time", "--round-steps", str(sched)]
        )  # fmt: skip
    assert info.value.code == 2
    assert "--round-steps: 1 rounds given; the job has 2" in capsys.readouterr().err


# ---- real daemons ----------------------------------------------------------------------------------
N_PEERS = 4


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("swarm"), N_PEERS, log=sys.stderr)
    s.extra_args = ["--debug"]  # the pacing hook: replica 1's peers are slowed down
    try:
        s.start()
        asyncio.run(s.wait_connected())
        yield s
    finally:
        s.stop()


def _run(
    swarm: LocalSwarm, spec: JobSpec, sync: SyncConfig, shares: list[int], **extra
) -> tuple[dict, list[dict]]:
    ids = [swarm.ready[i]["peer_id"] for i in range(N_PEERS)]
    for i in range(N_PEERS):
        (swarm.state_dir(i) / DEBUG_SLOW_FILE).unlink(missing_ok=True)

    async def go():
        events = []
        params = {
            "spec": spec.to_dict(),
            "stages": 2,
            "replicas": 2,
            "shares": shares,
            "offload": "on",
            "optimizer_hosts": 2,
            "sync": sync.to_dict(),
            **extra,
        }
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=600):
            if "event" in obj:
                ev = obj["event"]
                events.append(ev)
                if ev["type"] == "plan":  # replica 1's stages take 3x as long
                    for st in ev["stages"]:
                        if st["replica"] == 1:
                            (swarm.state_dir(ids.index(st["peer"])) / DEBUG_SLOW_FILE).write_text("3\n")
            else:
                return obj["result"], events
        raise AssertionError("no result")

    try:
        return asyncio.run(go())
    finally:
        for i in range(N_PEERS):
            (swarm.state_dir(i) / DEBUG_SLOW_FILE).unlink(missing_ok=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "tol"),
    [
        (SyncConfig("diloco", inner_steps=4), 1e-4),
        (
            SyncConfig(
                "sparseloco", inner_steps=4, topk_density=1 / 16, chunk=256, overlap=True, overlap_steps=1
            ),
            1e-3,
        ),
    ],
    ids=["diloco", "sparseloco-overlap"],
)
def test_swarm_follows_the_replay_of_its_schedule(swarm, sync, tol) -> None:
    spec = JobSpec(
        model="gpt2-tiny",
        steps=20,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=3,
    )
    sync = _timed(sync)
    shares = [2, 6]
    result, events = _run(swarm, spec, sync, shares)
    rounds = [e for e in events if e["type"] == "step"]
    assert len(rounds) == 5 and [r["round_closed"] for r in rounds] == list(range(5))
    schedule = [[rep["steps"] for rep in r["replicas"]] for r in rounds]
    print(f"{sync.mode}: inner steps per round and replica {schedule}", file=sys.stderr)
    assert all(max(c) == 4 for c in schedule)
    assert any(c[1] < c[0] for c in schedule), schedule  # the slowed replica did fewer: a real test
    for r in rounds:  # the driver's own count of the tokens it fed
        assert [rep["tokens"] for rep in r["replicas"]] == [
            s * 32 * rep["steps"] for s, rep in zip(shares, r["replicas"], strict=True)
        ]
        assert r["tokens"] == sum(rep["tokens"] for rep in r["replicas"])
        assert len(r["optimizer_hosts"]) == 2
    received = [sum(h["received_bytes"] for h in r["optimizer_hosts"]) for r in rounds]
    assert received == sorted(received) and received[-1] > 0
    assert all(h["rounds_closed"] == 5 for h in rounds[-1]["optimizer_hosts"])
    ref = train_local_replicas(spec, sync, shares=shares, round_steps=schedule)
    for q, (a, b) in enumerate(zip([r["loss"] for r in rounds], ref.losses, strict=True)):
        assert abs(a - b) < tol, f"round {q}: swarm {a:.6f} vs local {b:.6f}"
        for x, y in zip(rounds[q]["replicas"], ref.records[q]["replicas"], strict=True):
            assert abs(x["loss"] - y["loss"]) < tol, (q, x, y)
    assert abs(result["val_loss"] - ref.val_loss) < tol


@pytest.mark.e2e
@pytest.mark.slow
def test_scored_rounds_weigh_the_verdict_times_the_tokens_fed(swarm) -> None:
    # --contrib-policy score (auto in a public swarm): the hosts' weights are the plan's samples x the
    # floor x the scorer's verdict x each replica's steps over the round's most
    spec = JobSpec(
        model="gpt2-tiny", steps=12, batch_size=8, micro_batches=2, seq_len=32, seed=5, warmup_steps=3
    )
    sync = _timed(SyncConfig("diloco", inner_steps=4))
    shares = [2, 6]
    result, events = _run(swarm, spec, sync, shares, contrib_policy="score")
    rounds = [e for e in events if e["type"] == "step"]
    scored = [e for e in events if e["type"] == "event" and e.get("kind") == "scored"]
    assert len(rounds) == len(scored) == 3 and result["contrib"]["rounds_scored"] == 3
    for r, ev in zip(rounds, sorted(scored, key=lambda e: e["round"]), strict=True):
        steps = [rep["steps"] for rep in r["replicas"]]
        for per_host, scales in zip(ev["weights"], ev["scales"], strict=True):
            want = [
                n * c / max(steps) * v * sc
                for n, c, v, sc in zip(shares, steps, ev["verdict"], scales, strict=True)
            ]
            assert per_host == pytest.approx(want, rel=1e-5, abs=2e-6), (steps, ev)


def test_a_swarm_job_sent_without_the_cli_is_refused_the_same_way() -> None:
    from fusionnode.sync import job_refusals

    sync = _timed(SyncConfig("sparseloco", inner_steps=5))
    for params, says in [
        ({"offload": "off"}, "--offload on or auto"),
    ]:
        with pytest.raises(ConfigError, match=says):
            job_refusals(sync, params)
    job_refusals(sync, {"offload": "on", "planner": "simple"})
    # checkpointed and resumed (train/free_recovery.py)
    job_refusals(sync, {"offload": "on", "resume": True, "spec": {"save_dir": "/tmp/x"}})
    with pytest.raises(ConfigError, match="--round-close 'hourly'"):
        SyncConfig.from_dict({**sync.to_dict(), "round_close": "hourly"})
