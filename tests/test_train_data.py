"""Job inputs and outputs: the byte tokenizer, corpora, deterministic batches, JobSpec, lr schedule, metrics."""

from __future__ import annotations

import itertools
import json
import math

import msgpack
import pytest
import torch

from fusionnode.errors import ConfigError
from fusionnode.train.data import (
    VOCAB_SIZE,
    BatchSource,
    Corpus,
    _load_corpus_cached,
    decode,
    encode,
    load_corpus,
    loss_scale,
    shard_ranges,
)
from fusionnode.train.metrics import REQUIRED_STEP_KEYS, MetricsWriter, read_metrics
from fusionnode.train.spec import JobSpec, lr_at, trajectory_mismatch


def _corpus(text: bytes) -> Corpus:
    return Corpus(
        tokens=torch.frombuffer(bytearray(text), dtype=torch.uint8), source="test", n_files=1, digest="x"
    )


# --- tokenizer -------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    text = "héllo, wörld ✓\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.numel() == len(text.encode())
    assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB_SIZE
    assert decode(ids) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is replaced, not raised
    assert encode(b"").numel() == 0


# --- corpora ----------------------------------------------------------------------------------


def test_default_corpus_is_deterministic_stdlib_source() -> None:
    first = load_corpus()
    _load_corpus_cached.cache_clear()
    second = load_corpus()
    assert first is not second and first.digest == second.digest
    assert first.source == "python-stdlib" and first.n_files > 100
    assert 1_000_000 < first.n_bytes <= 16 * 2**20
    assert b"def " in bytes(first.tokens[:200_000].tolist())


def test_data_directory_is_read_recursively_in_sorted_order(tmp_path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("TWO")
    (tmp_path / "a.txt").write_text("ONE")
    (tmp_path / ".hidden").write_text("HIDDEN")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    corpus = load_corpus(str(tmp_path))
    assert bytes(corpus.tokens.tolist()) == b"ONETWO"
    assert corpus.n_files == 2


def test_data_file_and_errors(tmp_path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("hello world")
    assert bytes(load_corpus(str(f)).tokens.tolist()) == b"hello world"
    with pytest.raises(ConfigError, match="no such file"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no readable text"):
        load_corpus(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="validation split"):
        BatchSource(load_corpus(str(f)), batch_size=2, seq_len=8, seed=0)


# --- batches ----------------------------------------------------------------------------------


def test_batches_depend_only_on_seed_and_step() -> None:
    corpus = load_corpus()
    a = BatchSource(corpus, batch_size=4, seq_len=32, seed=7)
    b = BatchSource(corpus, batch_size=4, seq_len=32, seed=7)
    a_batches = {step: a.batch(step) for step in (0, 1, 1000)}
    for step in (1000, 0, 1):  # another order, another instance: same batches
        x, y = b.batch(step)
        assert torch.equal(x, a_batches[step][0]) and torch.equal(y, a_batches[step][1])
    x, y = a_batches[0]
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert not torch.equal(a.batch(1)[0], x)
    assert not torch.equal(BatchSource(corpus, batch_size=4, seq_len=32, seed=8).batch(0)[0], x)


def test_train_and_validation_splits_are_disjoint() -> None:
    source = BatchSource(_corpus(b"a" * 950 + b"b" * 50), batch_size=16, seq_len=8, seed=0)
    for step in range(20):
        x, y = source.batch(step)
        assert set(x.unique().tolist()) == set(y.unique().tolist()) == {ord("a")}
    vx, _ = source.eval_batch(0)
    assert set(vx.unique().tolist()) == {ord("b")}
    assert torch.equal(source.eval_batch(3)[0], source.eval_batch(3)[0])


def test_microbatches_split_the_batch_evenly() -> None:
    source = BatchSource(load_corpus(), batch_size=8, seq_len=16, seed=1)
    x, y = source.batch(5)
    parts = source.microbatches(5, 4)
    assert [p[0].shape[0] for p in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(
        torch.cat([p[1] for p in parts]), y
    )
    with pytest.raises(ConfigError):
        source.microbatches(5, 3)
    assert loss_scale(2, 8) == 0.25


def test_shards_are_contiguous_slices_by_share() -> None:
    assert shard_ranges([3, 5, 0], 8) == [range(0, 3), range(3, 8), range(8, 8)]
    with pytest.raises(ConfigError, match="add up"):
        shard_ranges([3, 4], 8)
    source = BatchSource(load_corpus(), batch_size=8, seq_len=16, seed=1)
    x, _ = source.batch(2)
    parts = source.shard_batches(2, [5, 3])
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and parts[1][0].shape[0] == 3


def test_data_state_check_refuses_other_data() -> None:
    corpus = load_corpus()
    source = BatchSource(corpus, batch_size=4, seq_len=16, seed=3)
    state = source.state(12)
    assert source.check_state(state) == 12
    with pytest.raises(ConfigError, match="seed"):
        BatchSource(corpus, batch_size=4, seq_len=16, seed=4).check_state(state)
    with pytest.raises(ConfigError, match="corpus_sha256"):
        source.check_state({**state, "corpus_sha256": "0" * 64})


# --- JobSpec and lr schedule ------------------------------------------------------------------


def test_jobspec_round_trips_through_json_and_msgpack() -> None:
    spec = JobSpec(steps=10, batch_size=8, micro_batches=2, seq_len=64, grad_clip=None, data="/x")
    assert spec.job_id.startswith("job-")
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert JobSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec
    assert JobSpec(steps=10).job_id != JobSpec(steps=11).job_id
    assert JobSpec(steps=10).job_id == JobSpec(steps=10).job_id
    assert spec.micro_batch_size == 4
    assert JobSpec.from_dict({"lr": 1}).lr == 1.0  # JSON integers accepted for floats
    assert trajectory_mismatch(spec, spec.replace(save_dir="/y", steps=99)) == []
    assert trajectory_mismatch(spec, spec.replace(lr=1e-4, seed=1)) == ["seed", "lr"]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"batch_size": 10, "micro_batches": 3}, "divisible"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"steps": 0}, "steps"),
        ({"steps": True}, "steps"),
        ({"seq_len": 0}, "seq_len"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"job_id": "a b"}, "job_id"),
        ({"save_every": -1}, "save_every"),
    ],
)
def test_jobspec_rejects_bad_values(changes, match) -> None:
    with pytest.raises(ConfigError, match=match):
        JobSpec(**changes)


def test_jobspec_from_dict_rejects_unknown_fields_and_non_mappings() -> None:
    with pytest.raises(ConfigError, match="unknown field"):
        JobSpec.from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match="mapping"):
        JobSpec.from_dict([1, 2])


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    spec = JobSpec(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, spec) == pytest.approx(0.1)
    assert lr_at(9, spec) == pytest.approx(1.0)
    assert lr_at(10, spec) == pytest.approx(1.0)
    assert lr_at(109, spec) == pytest.approx(0.1)
    assert lr_at(500, spec) == pytest.approx(0.1)
    assert lr_at(59, spec) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 49 / 99)))
    decay = [lr_at(s, spec) for s in range(10, 110)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_at(0, JobSpec(steps=1, warmup_steps=0, lr=0.5)) == 0.5


# --- metrics ----------------------------------------------------------------------------------


def _record(step: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "tokens": 100,
        "step_time_s": 0.5,
        "wire_bytes": 10,
        "plan_version": 1,
    }


def test_metrics_writer_requires_keys_and_round_trips(tmp_path) -> None:
    path = tmp_path / "m" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for key in REQUIRED_STEP_KEYS:
            bad = _record(0, 1.0)
            del bad[key]
            with pytest.raises(ValueError, match=key):
                w.step(bad)
        with pytest.raises(ValueError, match="unknown event"):
            w.event("exploded")
        w.event("join", peer="abc")
        w.step(_record(0, 4.0))
        w.step({**_record(1, float("nan")), "extra": torch.tensor(2.5)})
        w.step(_record(2, 2.0))
        w.event("replan", plan_version=2)
        assert path.read_text().count("\n") == 5  # flushed per record, readable while open
        s = w.summary
        assert (s.steps, s.first_loss, s.last_loss, s.tokens, s.wire_bytes) == (3, 4.0, 2.0, 300, 30)
        assert s.tokens_per_s == pytest.approx(200.0) and s.events == {"join": 1, "replan": 1}
    with path.open("a") as f:
        f.write('{"type": "step", "st')  # a writer killed mid-line
    steps, events = read_metrics(path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[1]["loss"] is None and steps[1]["extra"] == 2.5
    assert [e["event"] for e in events] == ["join", "replan"] and events[0]["peer"] == "abc"
    assert all(isinstance(r["ts"], float) for r in steps + events)


def test_metrics_writer_without_path_only_summarises() -> None:
    w = MetricsWriter(None)
    w.step(_record(0, 3.0))
    assert w.summary.last_loss == 3.0
    w.close()
