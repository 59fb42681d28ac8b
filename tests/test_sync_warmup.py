"""`--sync-warmup W` (issue 19): the first W steps of a round mode run as rounds of
`--warmup-inner-steps` h steps, each installed at its close (no overlap), then rounds of H. The
schedule (SyncConfig), the in-process reference, and bad input (exit 2). The swarm following the
reference through the warm-up: tests/test_sync_swarm_e2e.py."""

from __future__ import annotations

import pytest
import torch

from fusionnode import cli
from fusionnode.bench import sync as bench_sync
from fusionnode.errors import ConfigError
from fusionnode.optim.rounds import round_of, round_tokens
from fusionnode.sync import SyncConfig
from fusionnode.train.jobdefaults import resumed_sync
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

torch.set_num_threads(1)
SPEC = JobSpec(steps=10, batch_size=4, seq_len=16, warmup_steps=2, seed=3)


def test_the_schedule_runs_warmup_rounds_then_rounds_of_h() -> None:
    cfg = SyncConfig("diloco", inner_steps=3, warmup_steps=6, warmup_inner_steps=2)
    # rounds: [0,1] [2,3] [4,5] | [6,7,8] [9,10,11] [12,13]
    assert [cfg.round_index(s) for s in range(14)] == [0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5]
    assert [cfg.round_start(q) for q in range(6)] == [0, 2, 4, 6, 9, 12]
    assert [s for s in range(14) if cfg.round_closes(s, 14)] == [1, 3, 5, 8, 11, 13]
    assert [round_of(cfg, s, 14) for s in (1, 5, 8, 13)] == [0, 2, 3, 5]
    assert [cfg.rounds_before(n) for n in (0, 1, 2, 6, 7, 9, 14)] == [0, 1, 1, 3, 4, 4, 6]
    assert [cfg.is_boundary(n) for n in (0, 2, 3, 6, 8, 9)] == [True, True, False, True, False, True]
    assert round_tokens(cfg, 8, samples=2, seq_len=16) == 2 * 16 * 3
    assert round_tokens(cfg, 3, samples=2, seq_len=16) == 2 * 16 * 2
    # checkpoints at round boundaries only, warm-up ones included
    assert [n for n in range(1, 15) if cfg.checkpoint_due(n, 4)] == [4, 9, 12]
    # without W the schedule is today's
    plain = SyncConfig("diloco", inner_steps=3)
    assert [plain.round_index(s) for s in range(7)] == [s // 3 for s in range(7)]
    assert [plain.round_start(q) for q in range(4)] == [0, 3, 6, 9]


def test_warmup_rounds_are_installed_at_their_close() -> None:
    over = SyncConfig("sparseloco", inner_steps=3, overlap=True, overlap_steps=1, warmup_steps=6)
    assert [s for s in range(12) if over.settles_at_close(s, 12, 0)] == [0, 1, 2, 3, 4, 5, 11]
    # the delayed update applies from the second round after the warm-up (the first has none pending)
    assert [s for s in range(12) if over.applies_delayed(s)] == [6, 9]
    assert [over.overlapped_before(s) for s in (5, 6, 8, 9)] == [False, False, False, True]


def test_reference_warmup_of_whole_rounds_equals_the_unoverlapped_run() -> None:
    # W = the whole job, h = H: every round is installed at its close, which is the run without overlap
    plain = SyncConfig("diloco", inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
    over = SyncConfig("diloco", inner_steps=2, outer_lr=1.0, outer_momentum=0.0, overlap=True)
    warm = SyncConfig(**{**over.to_dict(), "warmup_steps": 10, "warmup_inner_steps": 2})
    a = train_local_replicas(SPEC, plain, replicas=2)
    b = train_local_replicas(SPEC, warm, replicas=2)
    c = train_local_replicas(SPEC, over, replicas=2)
    assert a.losses == b.losses
    assert a.rounds == b.rounds == 5
    assert max(abs(x - y) for x, y in zip(a.losses[3:], c.losses[3:], strict=True)) > 1e-5  # overlap differs


def test_reference_counts_the_warmup_rounds_and_their_bytes() -> None:
    cfg = SyncConfig("sparseloco", inner_steps=2, warmup_steps=4, overlap=True, overlap_steps=1)
    res = train_local_replicas(SPEC, cfg, replicas=2)
    closed = [(r["step"], r["round_closed"]) for r in res.records if "round_closed" in r]
    assert closed == [(0, 0), (1, 1), (2, 2), (3, 3), (5, 4), (7, 5), (9, 6)]
    assert res.rounds == 7
    sent = [r["wire_bytes"] for r in res.records]
    assert all(b > 0 for b in sent[:4]) and sent[4] == 0 and sent[5] > 0
    plain = train_local_replicas(SPEC, SyncConfig(**{**cfg.to_dict(), "warmup_steps": 0}), replicas=2)
    assert plain.rounds == 5 and plain.bytes_up < res.bytes_up  # the warm-up's rounds are counted
    assert res.losses[0] == plain.losses[0] and res.losses[1] != plain.losses[1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "6"],
            "--sync-warmup 6: must be a multiple",
        ),
        (["--sync", "step", "--sync-warmup", "4"], "--sync-warmup: --sync step synchronises every step"),
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "-4"],
            "--sync-warmup -4: must be an integer >= 0",
        ),
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "8", "--warmup-inner-steps", "0"],
            "--warmup-inner-steps 0: must be an integer >= 1",
        ),
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "8", "--warmup-inner-steps", "8"],
            "--warmup-inner-steps 8: must lie in [1, H = 4]",
        ),
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "8", "--warmup-inner-steps", "3"],
            "--sync-warmup 8: must be a multiple",
        ),
        (
            ["--sync", "diloco", "--inner-steps", "4", "--sync-warmup", "x"],
            "argument --sync-warmup: invalid int",
        ),
        (  # h alone does nothing, and would put the warm-up's keys on the wire (review8 M2)
            ["--sync", "diloco", "--inner-steps", "4", "--warmup-inner-steps", "2"],
            "--warmup-inner-steps 2 needs --sync-warmup",
        ),
        (
            ["--sync", "step", "--warmup-inner-steps", "9"],
            "--warmup-inner-steps 9 needs --sync-warmup",
        ),
    ],
)
def test_bad_warmup_options_exit_2_naming_the_option(tmp_path, capsys, args, says) -> None:
    metrics = tmp_path / "m.jsonl"
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--local", "--state-dir", str(state), "--metrics-out", str(metrics), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert says in err.strip().splitlines()[-1], err
    assert not metrics.exists() and not state.exists()


def test_bad_warmup_of_a_swarm_job_and_of_the_bench_exit_2(tmp_path, capsys) -> None:
    state = tmp_path / "state"
    for argv in (
        ["train", "--state-dir", str(state), "--replicas", "2", "--sync", "diloco", "--inner-steps", "4",
         "--sync-warmup", "8", "--round-close", "time"],
        ["train", "--state-dir", str(state), "--replicas", "2", "--planner", "fusion", "--sync", "diloco",
         "--sync-warmup", "8"],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert "--sync-warmup with --" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--state-dir", str(state), "--replicas", "2", "--sync", "diloco", "--inner-steps", "4",
                  "--warmup-inner-steps", "2"])  # fmt: skip
    assert info.value.code == 2
    assert "--warmup-inner-steps 2 needs --sync-warmup" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not state.exists()
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--steps", "8", "--inner-steps", "4", "--sync-warmup", "6"])
    assert info.value.code == 2
    assert "--sync-warmup 6: must be a multiple" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--steps", "8", "--inner-steps", "4", "--warmup-inner-steps", "2"])
    assert info.value.code == 2
    assert "--warmup-inner-steps 2 needs --sync-warmup" in capsys.readouterr().err


def test_a_resume_keeps_the_checkpoints_warmup() -> None:
    saved = SyncConfig("diloco", inner_steps=4, warmup_steps=8).to_dict()
    same = {"sync": saved}
    assert resumed_sync(same, saved) == same
    with pytest.raises(ConfigError, match="the checkpoint's job ran --sync-warmup 8"):
        resumed_sync({"sync": SyncConfig("diloco", inner_steps=4).to_dict()}, saved)


def test_a_job_without_warmup_reads_as_before_to_older_peers() -> None:
    plain = SyncConfig("diloco", inner_steps=4).to_dict()
    assert "warmup_steps" not in plain and "warmup_inner_steps" not in plain
    warm = SyncConfig("diloco", inner_steps=4, warmup_steps=8, warmup_inner_steps=2)
    assert SyncConfig.from_dict(warm.to_dict()) == warm
    assert warm.to_dict()["warmup_steps"] == 8
    # h without W has no effect: refused (a job never carries the warm-up's keys without a warm-up),
    # also in a sync map a peer receives
    with pytest.raises(ConfigError, match="--warmup-inner-steps 3 needs --sync-warmup"):
        SyncConfig("diloco", inner_steps=4, warmup_inner_steps=3)
    with pytest.raises(ConfigError, match="--warmup-inner-steps 3 needs --sync-warmup"):
        SyncConfig.from_dict({**plain, "warmup_steps": 0, "warmup_inner_steps": 3})
