"""Streamed data sets: text, jsonl and parquet, tokenized into the cache; splits, determinism, replicas."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from fusionnode.cli import main
from fusionnode.errors import ConfigError
from fusionnode.train.data import BatchSource, step_seed, stream_files
from fusionnode.train.dataset import (
    VAL_EVERY,
    iter_documents,
    load_token_data,
    split_documents,
    window_starts,
)
from fusionnode.train.spec import JobSpec
from fusionnode.train.tokenizer import ByteTokenizer, load_tokenizer, train_bpe


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONNODE_CACHE_DIR", str(tmp_path / "cache"))


def _docs(n: int) -> list[str]:
    return [f"<doc {i:05d}> " + "lorem ipsum dolor sit amet " * (3 + i % 5) for i in range(n)]


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _spec(data, **kw) -> JobSpec:
    base = dict(model="llama-tiny", data=str(data), batch_size=8, seq_len=16, seed=4)
    base.update(kw)
    return JobSpec(**base)


def test_jsonl_parquet_and_text_in_one_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = _docs(200)
    d = tmp_path / "data"
    d.mkdir()
    _write_jsonl(d / "a.jsonl", docs[:80], field="body")
    pq.write_table(pa.table({"body": docs[80:160], "n": list(range(80))}), d / "b.parquet", row_group_size=16)
    (d / "c.txt").write_text("".join(docs[160:]))
    (d / ".hidden.jsonl").write_text("not read\n")
    files, _ = stream_files(str(d))
    assert [f.name for f in files] == ["a.jsonl", "b.parquet", "c.txt"]
    got = [text for _f, text in iter_documents(files, "body")]
    assert got[:160] == docs[:160] and "".join(got[160:]) == "".join(docs[160:])
    a = BatchSource.from_spec(_spec(d, text_field="body"), 16)
    b = BatchSource.from_spec(_spec(d, text_field="body"), 16)
    for step in (0, 7):
        assert all(torch.equal(x, y) for x, y in zip(a.batch(step), b.batch(step), strict=True))
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    assert not torch.equal(
        a.batch(0)[0], BatchSource.from_spec(_spec(d, text_field="body", seed=5), 16).batch(0)[0]
    )


def test_validation_documents_never_reach_training(tmp_path):
    docs = _docs(400)
    data = load_token_data([_write_jsonl(tmp_path / "d.jsonl", docs)], "d", ByteTokenizer(), "text")
    train, val = bytes(data.train).decode(), bytes(data.val).decode()
    for i, doc in enumerate(docs):
        held_out = i % VAL_EVERY == VAL_EVERY - 1
        marker = doc[:11]
        assert (marker in val) == held_out and (marker in train) != held_out, i


def test_windows_are_disjoint_within_an_epoch_and_across_replicas(tmp_path):
    spec = _spec(_write_jsonl(tmp_path / "d.jsonl", _docs(300)))
    source = BatchSource.from_spec(spec, 16)
    n_windows = (len(source.train) - 1) // 16
    steps = n_windows // spec.batch_size
    starts = window_starts(len(source.train), 16, torch.arange(steps * spec.batch_size), spec.seed, step_seed)
    assert len(set(starts.tolist())) == len(starts) and bool((starts % 16 == 0).all())  # disjoint inputs
    train = torch.from_numpy(source.train.astype("int64"))
    for step in (0, steps - 1):
        x, y = source.batch(step)
        for j in range(spec.batch_size):
            s0 = int(starts[step * spec.batch_size + j])
            assert torch.equal(x[j], train[s0 : s0 + 16]) and torch.equal(y[j], train[s0 + 1 : s0 + 17])
    # the next epoch uses every window again, in another order
    nxt = window_starts(len(source.train), 16, torch.arange(n_windows, 2 * n_windows), spec.seed, step_seed)
    assert sorted(nxt.tolist()) == sorted(range(0, n_windows * 16, 16)) and not torch.equal(
        nxt[: len(starts)], starts
    )
    ranges = source.shard(0, [3, 5])
    assert set(ranges[0]).isdisjoint(ranges[1]) and len(ranges[0]) + len(ranges[1]) == spec.batch_size


def test_data_is_streamed_not_loaded_whole(tmp_path):
    big = _write_jsonl(tmp_path / "big.jsonl", _docs(40000))  # about 7 MiB
    assert big.stat().st_size > 6 * 2**20
    tracemalloc.start()
    try:
        data = load_token_data([big], "big", ByteTokenizer(), "text")
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.n_tokens > 5 * 2**20
    assert peak < 3 * 2**20, (
        f"peak {peak / 2**20:.1f} MiB while tokenizing a {big.stat().st_size / 2**20:.1f} MiB file"
    )


def test_jsonl_line_without_the_text_field_is_exit_2(tmp_path, capsys):
    f = _write_jsonl(tmp_path / "d.jsonl", _docs(5))
    with f.open("a") as out:
        out.write(json.dumps({"content": "no text here"}) + "\n")
    argv = ["train", "--local", "--model", "llama-tiny", "--data", str(f), "--steps", "1", "--seq-len", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{f}:6: no text field 'text'" in err and "--text-field" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="no text column 'text'"):
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
        list(iter_documents([tmp_path / "p.parquet"], "text"))


def test_bpe_trained_on_the_default_corpus_round_trips_its_validation_split(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--vocab-size", "512", "--out", str(out)]) == 0
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 512
    files, _ = stream_files(None)
    n = 0
    for text in split_documents(iter_documents(files, "text"), validation=True):
        ids = tok.encode(text)
        assert tok.decode(ids).encode("utf-8") == text.encode("utf-8")
        assert len(ids) < len(text.encode("utf-8"))  # it compresses
        n += 1
    assert n > 10


def test_bpe_tokenizer_trains_a_model_and_generates(tmp_path):
    pytest.importorskip("tokenizers")
    tok = train_bpe(_docs(300), 300, tmp_path / "tok.json")
    data = _write_jsonl(tmp_path / "d.jsonl", _docs(300))
    from fusionnode.train.local import train_local

    spec = _spec(
        data, tokenizer=str(tok), steps=3, batch_size=4, micro_batches=1, save_dir=str(tmp_path / "run")
    )
    res = train_local(spec)
    assert res.model.vocab_size == 300 and len(res.losses) == 3
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "<doc", "--tokens", "5"]) == 0
