"""What the driver settles before it plans a job (train/jobdefaults.py): `--compress auto` where the
swarm's publicness is known, a resume's H, and the --sync refusals for clients other than the CLI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusionnode.cli.app import build_parser
from fusionnode.errors import ConfigError
from fusionnode.security.keys import SWARM_KEY_ENV
from fusionnode.sync import DEFAULT_INNER_STEPS, SyncConfig, job_refusals
from fusionnode.train.checkpoint import load_checkpoint, save_job
from fusionnode.train.checks import job_policy
from fusionnode.train.jobdefaults import job_defaults, resolve_compress, resumed_sync
from fusionnode.train.spec import JobSpec
from fusionnode.train.state import Job

PUBLIC = SimpleNamespace(swarm_key_file=None, listen=("/ip4/0.0.0.0/tcp/0",))
PRIVATE = SimpleNamespace(swarm_key_file="/k", listen=("/ip4/0.0.0.0/tcp/0",))
LOCAL = SimpleNamespace(swarm_key_file=None, listen=("/ip4/127.0.0.1/tcp/0",))


def test_train_compress_defaults_to_auto_and_public_jobs_get_adatopk_with_checks(monkeypatch):
    monkeypatch.delenv(SWARM_KEY_ENV, raising=False)
    args = build_parser().parse_args(["train", "--steps", "2"])
    assert args.compress == "auto"
    auto = JobSpec(model="gpt2-tiny", compress=args.compress)
    # a public swarm: AdaTopK, and the spot-checks still run (verify/lossy.py judges lossy links)
    spec = resolve_compress(auto, {}, PUBLIC)
    assert spec.compress == "adatopk" and spec.job_id == auto.job_id
    policy, why = job_policy({}, PUBLIC, spec)
    assert policy.on and why is None
    # private and local swarms: AdaTopK, checks off as before
    assert resolve_compress(auto, {}, PRIVATE).compress == "adatopk"
    assert resolve_compress(auto, {}, LOCAL).compress == "adatopk"
    # asked-for checks with AdaTopK: not refused, warm-up set
    asked = {"verify_policy": "sample"}
    # a round mode's checks (the workers commit to their inner parameters) are opt-in: auto leaves
    # them off with a reason, an asked-for policy turns them on
    diloco = {"sync": SyncConfig(mode="diloco", inner_steps=4).to_dict()}
    policy, why = job_policy(diloco, PUBLIC, resolve_compress(auto, diloco, PUBLIC))
    assert not policy.on and "opt-in" in why
    assert job_policy({**diloco, **asked}, PUBLIC, resolve_compress(auto, diloco, PUBLIC))[0].on
    explicit = JobSpec(model="gpt2-tiny", compress="adatopk")
    spec, params = job_defaults(explicit, dict(asked), None, LOCAL)
    assert spec.compress == "adatopk" and params["link_options"]["warmup_steps"] == int(0.3 * spec.steps)
    assert job_policy(params, LOCAL, spec)[0].on
    spec, params = job_defaults(auto, {}, None, PUBLIC)
    assert spec.compress == "adatopk" and params["link_options"]["warmup_steps"] == int(0.3 * spec.steps)
    # error feedback cannot be recomputed: asked-for checks refused, public default checks off
    feedback = {"link_options": {"error_feedback": True}}
    with pytest.raises(ConfigError, match="error feedback"):
        job_policy({**feedback, **asked}, LOCAL, spec)
    policy, why = job_policy(feedback, PUBLIC, spec)
    assert not policy.on and "error feedback" in why
    # an explicit --compress none stays the user's
    assert resolve_compress(JobSpec(model="gpt2-tiny", compress="none"), {}, PUBLIC).compress == "none"


def _diloco(**kw):
    return SyncConfig(mode="diloco", **kw).to_dict()


def test_a_resume_keeps_the_h_its_checkpoint_recorded():
    saved = _diloco(inner_steps=7)
    # --sync-budget (the CLI's default without --inner-steps): H is the checkpoint's, not chosen anew
    params = resumed_sync({"sync": _diloco(inner_steps=DEFAULT_INNER_STEPS, budget=0.1)}, saved)
    assert SyncConfig.from_dict(params["sync"]) == SyncConfig(mode="diloco", inner_steps=7)
    # the same H given: kept; another: refused, naming the option and the checkpoint's H
    assert resumed_sync({"sync": saved}, saved)["sync"] == saved
    with pytest.raises(ConfigError, match="--inner-steps 9: the checkpoint's job ran rounds of H = 7"):
        resumed_sync({"sync": _diloco(inner_steps=9)}, saved)
    # a checkpoint without the record (written before it), or --sync step: unchanged
    budget = {"sync": _diloco(budget=0.1)}
    assert resumed_sync(budget, None) == budget
    assert resumed_sync({}, saved) == {}


def test_the_driver_checkpoint_records_h_and_a_resume_reads_it_back(tmp_path):
    spec = JobSpec(model="gpt2-tiny", steps=10, save_dir=str(tmp_path / "ck"))
    job = Job(spec, "driver")
    job.sync = SyncConfig(mode="sparseloco", inner_steps=5)
    job.secret = "s" * 32
    source = SimpleNamespace(state=lambda step: {"step": step})
    save_job(job, 5, source, {"w": torch.ones(2)})
    ckpt = load_checkpoint(spec.save_dir)
    budget = {"sync": SyncConfig(mode="sparseloco", budget=0.1).to_dict()}
    _, params = job_defaults(spec, budget, ckpt, PRIVATE)
    assert SyncConfig.from_dict(params["sync"]).inner_steps == 5
    assert SyncConfig.from_dict(params["sync"]).budget is None


def test_the_driver_refuses_a_budget_it_cannot_honour():
    budget = SyncConfig(mode="diloco", budget=0.1)
    job_refusals(budget, {"planner": "fusion"})
    for params in ({"planner": "simple"}, {}):
        with pytest.raises(ConfigError, match="--sync-budget"):
            job_refusals(budget, params)
    with pytest.raises(ConfigError, match=r"--sync-budget 0\.1 with --inner-steps 30"):
        job_refusals(SyncConfig(mode="diloco", inner_steps=30, budget=0.1), {"planner": "fusion"})


def test_rounds_closed_by_time_turn_auto_checks_off_and_refuse_asked_ones(monkeypatch):
    """--round-close time runs without spot-checks (train/free_rounds.py refuses them after the plan):
    job_policy settles it before anything is planned, in a public swarm too."""
    monkeypatch.delenv(SWARM_KEY_ENV, raising=False)
    spec = JobSpec(model="gpt2-tiny", compress="adatopk")
    timed = {"sync": SyncConfig(mode="diloco", inner_steps=4, round_close="time").to_dict()}
    policy, why = job_policy(timed, PUBLIC, spec)  # auto in a public swarm: off, with the reason
    assert not policy.on and policy.rate == 0.0 and "--round-close time" in why
    assert job_policy({**timed, "verify_policy": "off"}, PUBLIC, spec) == (
        job_policy({"verify_policy": "off"}, PUBLIC, spec)[0],
        None,
    )
    assert job_policy(timed, PRIVATE, spec)[1] is None  # auto already off there: no notice
    for asked in ("sample", "all"):
        for config in (PUBLIC, LOCAL):
            with pytest.raises(ConfigError, match=f"--round-close time with --verify-policy {asked}"):
                job_policy({**timed, "verify_policy": asked}, config, spec)
    # rounds closed by steps are checked when asked (auto leaves a round mode's checks off: opt-in)
    steps = {"sync": SyncConfig(mode="diloco", inner_steps=4).to_dict()}
    assert not job_policy(steps, PUBLIC, spec)[0].on
    assert job_policy({**steps, "verify_policy": "all"}, PUBLIC, spec)[0].on
