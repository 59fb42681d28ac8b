"""The single-process reference trainer: learning, metrics, micro-batching, exact resume, sampling."""

from __future__ import annotations

import pytest
import torch

from fusionnode.errors import ConfigError
from fusionnode.train.checkpoint import list_checkpoints
from fusionnode.train.data import BatchSource, load_corpus
from fusionnode.train.generate import generate
from fusionnode.train.local import DivergenceError, build_job_model, make_optimizer, train_local, train_step
from fusionnode.train.metrics import REQUIRED_STEP_KEYS, read_metrics
from fusionnode.train.spec import JobSpec


class Crash(Exception):
    """Raised from the progress callback to kill a run mid-way."""


def test_gpt2_tiny_learns_and_writes_metrics(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    seen: list[dict] = []
    spec = JobSpec(
        steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, seed=0, metrics_out=str(metrics)
    )
    result = train_local(spec, progress=seen.append)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    assert result.losses[0] == pytest.approx(5.55, abs=0.5)  # ~ln(256): an untrained byte model
    assert result.val_loss < 0.8 * first
    assert result.tokens_per_s > 0 and result.start_step == 0

    steps, events = read_metrics(metrics)
    assert [r["step"] for r in steps] == list(range(30)) and seen == steps
    for r in steps:
        assert set(REQUIRED_STEP_KEYS) <= set(r)
        assert (r["tokens"], r["wire_bytes"], r["plan_version"]) == (8 * 64, 0, 0)
        assert r["step_time_s"] > 0
    assert [r["loss"] for r in steps] == list(result.losses)
    assert [e["event"] for e in events] == ["start", "eval", "end"]


def test_micro_batches_accumulate_to_the_same_step() -> None:
    corpus = load_corpus()
    results = []
    for m in (1, 4):
        # SGD without clipping: its update is linear in the gradient, so a wrong loss scale shows
        # (Adam would normalise it away).
        spec = JobSpec(
            steps=3,
            batch_size=8,
            micro_batches=m,
            seq_len=32,
            warmup_steps=0,
            optimizer="sgd",
            lr=0.1,
            grad_clip=None,
        )
        model = build_job_model(spec)
        opt = make_optimizer(model, spec)
        source = BatchSource(corpus, batch_size=8, seq_len=32, seed=spec.seed)
        losses = [train_step(model, opt, source, step, spec)["loss"] for step in range(3)]
        results.append((losses, model.state_dict()))
    (l1, p1), (l4, p4) = results
    assert l1 == pytest.approx(l4, abs=1e-5)
    assert l1[2] < l1[0]  # the steps did move the weights
    for name in p1:
        torch.testing.assert_close(p1[name], p4[name], atol=1e-6, rtol=1e-5)


def test_resume_continues_the_exact_trajectory(tmp_path) -> None:
    base = dict(steps=6, batch_size=4, micro_batches=2, seq_len=32, warmup_steps=2, save_every=3)
    straight = train_local(JobSpec(**base, save_dir=str(tmp_path / "a")))

    spec = JobSpec(**base, save_dir=str(tmp_path / "b"), metrics_out=str(tmp_path / "b.jsonl"))

    def crash_at_step_4(record: dict) -> None:
        if record["step"] == 4:
            raise Crash

    with pytest.raises(Crash):
        train_local(spec, progress=crash_at_step_4)
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [3]

    resumed = train_local(spec, resume=True)
    assert resumed.start_step == 3
    assert resumed.losses == straight.losses[3:]
    for name, t in straight.params.items():
        assert torch.equal(resumed.params[name], t), name
    steps, events = read_metrics(tmp_path / "b.jsonl")
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4, 3, 4, 5]  # the crashed step 4 is replayed
    assert "resume" in [e["event"] for e in events]

    with pytest.raises(ConfigError, match="seed"):
        train_local(spec.replace(seed=1), resume=True)


def test_resume_without_save_dir_or_checkpoint(tmp_path) -> None:
    with pytest.raises(ConfigError, match="save"):
        train_local(JobSpec(steps=1), resume=True)
    fresh = train_local(
        JobSpec(steps=2, batch_size=2, seq_len=16, save_dir=str(tmp_path / "empty")), resume=True
    )
    assert fresh.start_step == 0 and len(fresh.losses) == 2


def test_seq_len_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ConfigError, match="context length"):
        train_local(JobSpec(steps=1, seq_len=4096))


def test_generate_is_deterministic_and_crops_the_context() -> None:
    model = build_job_model(JobSpec())
    long_prompt = "x = 1\n" * 40  # 240 bytes > n_ctx 128
    a = generate(model, long_prompt, max_new_tokens=20, seed=1)
    assert a == generate(model, long_prompt, max_new_tokens=20, seed=1)
    assert a.startswith(long_prompt) and len(a.encode()) > len(long_prompt)
    greedy = generate(model, "def ", max_new_tokens=10, temperature=0.0)
    assert greedy == generate(model, "def ", max_new_tokens=10, temperature=0.0, seed=5)
    assert generate(model, "", max_new_tokens=0) == ""
    assert model.training  # the caller's mode is restored


def test_divergence_is_reported_as_a_failure(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    spec = JobSpec(
        steps=10,
        batch_size=2,
        seq_len=16,
        optimizer="sgd",
        lr=1e9,
        warmup_steps=0,
        grad_clip=None,
        metrics_out=str(metrics),
    )
    with pytest.raises(DivergenceError, match="loss is"):
        train_local(spec)
    _, events = read_metrics(metrics)
    assert events[-1]["event"] == "failure" and events[-1]["reason"] == "non-finite loss"
