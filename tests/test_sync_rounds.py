"""The round protocol and the in-process replicated reference (`train --local --replicas R --sync`)."""

from __future__ import annotations

import pytest
import torch

from fusionnode import cli
from fusionnode.optim.rounds import (
    ReplicaSync,
    RoundCombiner,
    RoundError,
    apply_update,
    contributing_names,
    encoded_bytes,
    round_of,
    round_tokens,
)
from fusionnode.sync import SyncConfig
from fusionnode.train.local import train_local
from fusionnode.train.replicas import step_bytes_per_replica, train_local_replicas
from fusionnode.train.spec import JobSpec
from fusionnode.wire.tensors import encode_tensor

torch.set_num_threads(1)
SPEC = JobSpec(steps=6, batch_size=4, seq_len=16, warmup_steps=1)


def _raw(x: float) -> dict:
    return {"w": encode_tensor(torch.tensor([x]), "raw")}


def test_combiner_weights_by_tokens_and_applies_each_round_once() -> None:
    cfg = SyncConfig("diloco", inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
    host = RoundCombiner(cfg, replicas=2)
    theta = {"w": torch.tensor([10.0])}
    assert not host.add(0, 0, 100, _raw(4.0))
    with pytest.raises(RoundError, match="already contributed"):
        host.add(0, 0, 100, _raw(4.0))
    with pytest.raises(RoundError, match="not open yet"):
        host.add(1, 1, 300, _raw(0.0))
    assert host.add(0, 1, 300, _raw(0.0))
    update = host.close(theta)
    # (100 * 4 + 300 * 0) / 400 = 1: theta 10 -> 9, on the host and on a replica holding the same theta
    assert torch.equal(theta["w"], torch.tensor([9.0]))
    replica = {"w": torch.tensor([10.0])}
    apply_update(replica, update)
    assert torch.equal(replica["w"], theta["w"])
    with pytest.raises(RoundError, match="already applied"):
        host.add(0, 1, 300, _raw(0.0))
    with pytest.raises(RoundError, match="tokens"):
        host.add(1, 0, 0, _raw(1.0))
    assert host.received_bytes == 2 * encoded_bytes(_raw(0.0))
    assert host.sent_bytes == 2 * update.nbytes()


def test_sparseloco_update_relays_messages_and_every_receiver_agrees() -> None:
    cfg = SyncConfig("sparseloco", inner_steps=1, outer_lr=0.5, topk_density=0.5, chunk=4)
    host = RoundCombiner(cfg, replicas=2)
    senders = [ReplicaSync(cfg), ReplicaSync(cfg)]
    deltas = [torch.tensor([4.0, 0.0, -2.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 3.0])]
    for r, d in enumerate(deltas):
        host.add(0, r, 50, senders[r].encode({"w": d}))
    theta = {"w": torch.zeros(4)}
    update = host.close(theta)
    # replica 0 sends 4, -2 (levels 4 and 2), replica 1 sends 1, 3: mean [2, 0.5, -1, 1.5] * 0.5
    assert torch.allclose(theta["w"], -torch.tensor([1.0, 0.25, -0.5, 0.75]))
    other = {"w": torch.zeros(4)}
    apply_update(other, update)
    assert torch.equal(other["w"], theta["w"])
    assert update.nbytes() == 2 * encoded_bytes(update.relayed[0][1])


def test_step_mode_is_the_single_process_trajectory_with_bytes() -> None:
    ref = train_local(SPEC)
    res = train_local_replicas(SPEC, SyncConfig(), replicas=2)
    assert res.losses == ref.losses
    up, down = step_bytes_per_replica(ref.model)
    assert res.bytes_up == SPEC.steps * 2 * up and res.bytes_down == SPEC.steps * 2 * down
    hosts = [r["optimizer_hosts"][0] for r in res.records]
    assert [h["received_bytes"] for h in hosts] == [(i + 1) * 2 * up for i in range(SPEC.steps)]


def test_one_replica_diloco_with_plain_outer_step_is_plain_training() -> None:
    # θ − (θ − θ_end) = θ_end: rounds change nothing but rounding
    ref = train_local(SPEC)
    cfg = SyncConfig("diloco", inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
    res = train_local_replicas(SPEC, cfg, replicas=1)
    assert res.rounds == 3
    assert max(abs(a - b) for a, b in zip(res.losses, ref.losses, strict=True)) < 1e-4
    for name, p in res.params.items():
        assert torch.allclose(p, ref.params[name].float(), atol=1e-5), name


def test_two_replica_rounds_differ_from_step_and_count_bytes() -> None:
    step = train_local_replicas(SPEC, SyncConfig(), replicas=2)
    d = train_local_replicas(SPEC, SyncConfig("diloco", inner_steps=3), replicas=2)
    s = train_local_replicas(SPEC, SyncConfig("sparseloco", inner_steps=3), replicas=2, shares=[1, 3])
    assert d.rounds == s.rounds == 2
    assert d.losses[0] == pytest.approx(step.losses[0], abs=1e-6)  # the same start and batch
    assert abs(d.losses[1] - step.losses[1]) > 1e-4  # two inner AdamW steps on halves differ from one
    # raw diloco: Δ up and u down once per round instead of every step
    assert d.bytes_up == pytest.approx(step.bytes_up / 3, rel=0.01)
    assert step.bytes_up + step.bytes_down > 100 * (s.bytes_up + s.bytes_down)
    closed = [r["step"] for r in d.records if "round_closed" in r]
    assert closed == [2, 5]
    assert all(r["wire_bytes"] == 0 for r in d.records if "round_closed" not in r)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sync", "diloco", "--inner-steps", "0"], "--inner-steps 0: must be an integer >= 1"),
        (["--sync", "lazy"], "argument --sync: invalid choice: 'lazy'"),
        (["--sync", "diloco", "--sync-codec", "gzip"], "--sync-codec 'gzip'"),
        (["--sync", "sparseloco", "--sync-codec", "q8"], "--sync-codec 'q8'"),
        (["--sync", "diloco", "--shares", "0,4"], "--shares: every share must be at least 1"),
        (["--sync", "diloco", "--planner", "even"], "--planner even"),
        (["--sync", "sparseloco", "--offload", "off"], "--offload"),
        (["--sync", "step", "--inner-steps", "4"], "--inner-steps 4"),
        (["--sync", "sparseloco", "--topk-density", "0"], "--topk-density"),
        (["--sync", "step", "--sync-overlap"], "--sync-overlap: --sync step has no rounds"),
    ],
)
def test_bad_sync_options_exit_2_naming_the_option_before_anything_starts(
    tmp_path, capsys, args, says
) -> None:
    metrics = tmp_path / "m.jsonl"
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--local", "--state-dir", str(state), "--metrics-out", str(metrics), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: fusionnode train"), err
    assert says in err.strip().splitlines()[-1], err
    assert not metrics.exists() and not state.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sync", "diloco", "--inner-steps", "-1"], "--inner-steps -1: must be an integer >= 1"),
        (["--sync", "diloco", "--inner-steps", "two"], "argument --inner-steps: invalid int value: 'two'"),
        (["--sync", "DiLoCo"], "argument --sync: invalid choice: 'DiLoCo'"),
        (["--sync", "sparseloco", "--sync-codec", "ctopk3"], "--sync-codec 'ctopk3'"),
        (["--sync", "sparseloco", "--shares", "3,0"], "--shares: every share must be at least 1"),
        (["--sync", "diloco", "--planner", "even"], "--planner even"),
        (["--sync", "diloco", "--planner", "memory"], "--planner memory"),
        (["--sync", "diloco", "--rebalance-every", "5"], "--rebalance-every"),
    ],
)
def test_bad_sync_options_of_a_swarm_job_exit_2_before_any_daemon_is_asked(
    tmp_path, capsys, args, says
) -> None:
    """The same checks for a job sent to the daemon (no --local): refused before the control socket
    is opened (the state directory, where it would live, is never created)."""
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--state-dir", str(state), "--replicas", "2", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert says in err.strip().splitlines()[-1], err
    assert not state.exists()


def test_cli_local_replicas_runs_and_reports_rounds(capsys) -> None:
    args = ["--steps", "4", "--batch-size", "4", "--seq-len", "16", "--replicas", "2"]
    code = cli.main(["train", "--local", *args, "--sync", "sparseloco", "--inner-steps", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "local x2 --sync sparseloco (H=2): 4 steps, 2 rounds" in out


def test_driver_side_round_helpers() -> None:
    cfg = SyncConfig("diloco", inner_steps=4)
    assert [round_of(cfg, s, 10) for s in range(10)] == [None, None, None, 0, None, None, None, 1, None, 2]
    # a replica of 3 sequences of 16 tokens: 4 steps in round 0, the last round (steps 8, 9) has 2
    assert round_tokens(cfg, 3, 3, 16) == 4 * 48 and round_tokens(cfg, 9, 3, 16) == 2 * 48
    args = [
        {"stage": 0, "replica": 0, "param_specs": {"wte": {}, "h0": {}}},
        {"stage": 1, "replica": 0, "param_specs": {"wte": {}, "h1": {}}},
        {"stage": 2, "replica": 1, "param_specs": {"wte": {}, "h0": {}}},
        {"stage": 3, "replica": 1, "param_specs": {"wte": {}, "h1": {}, "lora": {}}, "frozen": ["lora"]},
    ]
    # the tied wte is sent once per replica, by its first stage; a frozen tensor never
    assert contributing_names(args) == {0: ["h0", "wte"], 1: ["h1"], 2: ["h0", "wte"], 3: ["h1"]}


def test_int8_diloco_sends_a_quarter_of_raw_and_stays_close() -> None:
    raw = train_local_replicas(SPEC, SyncConfig("diloco", inner_steps=3), replicas=2)
    q8 = train_local_replicas(SPEC, SyncConfig("diloco", inner_steps=3, codec="q8"), replicas=2)
    # int8 values plus a float32 scale per row, against float32: a bit over a quarter
    assert 0.25 < q8.bytes_up / raw.bytes_up < 0.30 and 0.25 < q8.bytes_down / raw.bytes_down < 0.30
    assert q8.losses[:3] == raw.losses[:3]  # the first round is the same until it closes
    assert max(abs(a - b) for a, b in zip(q8.losses, raw.losses, strict=True)) < 0.05
    assert q8.losses[3:] != raw.losses[3:]  # and the quantised round really differs after


def test_replicated_reference_writes_its_metrics(tmp_path) -> None:
    import json

    path = tmp_path / "m.jsonl"
    res = train_local_replicas(
        SPEC.replace(metrics_out=str(path)), SyncConfig("sparseloco", inner_steps=3), replicas=2
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if r["type"] == "step"]
    assert [r["loss"] for r in steps] == list(res.losses)
    assert steps[-1]["optimizer_hosts"][0]["received_bytes"] == res.bytes_up
    assert [r["event"] for r in rows if r["type"] == "event"] == ["start", "eval", "end"]
