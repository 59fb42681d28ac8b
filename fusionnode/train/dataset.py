"""Streamed training data: documents from text, jsonl and parquet files, tokenized once into an on-disk cache.

`--data` names a file or a directory (read recursively in sorted order, hidden entries skipped):
  *.jsonl   one JSON object per line; the text is the field named by `--text-field`
  *.parquet one row per document; the text column named by `--text-field` (needs pyarrow)
  others    text files (a file with a NUL byte in its first 8 KiB is skipped as binary), cut into
            documents of about TEXT_DOC_BYTES at line starts
Nothing is loaded whole: files are read line by line / by parquet record batch, tokenized, and the
tokens appended to two flat files in the token cache (train.bin, val.bin), which training then
reads by memory map. Every VAL_EVERY-th document (ordinal `i % VAL_EVERY == VAL_EVERY - 1`, counted
over the whole data set in file order) goes to validation and never to training. The cache is
keyed by the files' paths, sizes and mtimes, the tokenizer's digest and the text field, so a
changed file or tokenizer builds a new one; it is written to a temporary directory and renamed.

Samples are windows of seq_len + 1 tokens at stride seq_len (`window_starts`): within an epoch
every window is used once, in an order permuted by (seed, epoch), so the samples of a step, and
thus the data-parallel replicas' slices of it, never share an input token.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_ENV = "FUSIONNODE_CACHE_DIR"  # overrides the token cache's location
CACHE_FORMAT = 1
VAL_EVERY = 20  # one document in 20 is held out for validation
TEXT_DOC_BYTES = 64 * 1024  # a plain text file is cut into documents of about this many bytes
BINARY_SNIFF_BYTES = 8192
PARQUET_BATCH_ROWS = 1024  # rows read at a time from a parquet file
WRITE_BUFFER_TOKENS = 1 << 18  # tokens buffered before they are appended to a cache file


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusionnode")) / "tokens"


def data_files(path: Path) -> list[Path]:
    """The files of `--data`: the file itself, or a directory's files in sorted order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"--data {path}: no such file or directory")
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _jsonl_documents(file: Path, field: str) -> Iterator[str]:
    with file.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{file}:{lineno}: not a JSON object: {exc}") from exc
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record)[:5] if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"{file}:{lineno}: no text field {field!r} (found {keys}); name it with --text-field"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(f"{file}:{lineno}: field {field!r} is {type(text).__name__}, not a string")
            yield text


def _parquet_documents(file: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"{file}: reading parquet needs pyarrow: pip install 'fusionnode[hf]'") from exc
    try:
        pf = pq.ParquetFile(str(file))
    except Exception as exc:  # pyarrow's own error types
        raise ConfigError(f"{file}: not a readable parquet file: {exc}") from exc
    if field not in pf.schema_arrow.names:
        raise ConfigError(
            f"{file}: no text column {field!r} (columns {pf.schema_arrow.names[:8]}); name it with --text-field"
        )
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text)


def _text_documents(file: Path) -> Iterator[str]:
    with file.open("rb") as f:
        if b"\x00" in f.read(BINARY_SNIFF_BYTES):
            return
        f.seek(0)
        chunk: list[bytes] = []
        size = 0
        for line in f:
            chunk.append(line)
            size += len(line)
            if size >= TEXT_DOC_BYTES:
                yield b"".join(chunk).decode("utf-8", errors="replace")
                chunk, size = [], 0
        if chunk:
            yield b"".join(chunk).decode("utf-8", errors="replace")


def iter_documents(files: list[Path], text_field: str) -> Iterator[tuple[Path, str]]:
    """(file, text) of every document, in order, streamed."""
    for file in files:
        name = file.name.lower()
        if name.endswith(".jsonl"):
            docs = _jsonl_documents(file, text_field)
        elif name.endswith(".parquet"):
            docs = _parquet_documents(file, text_field)
        else:
            docs = _text_documents(file)
        for text in docs:
            yield file, text


def split_documents(docs: Iterator[tuple[Path, str]], validation: bool) -> Iterator[str]:
    """The documents of one split (see VAL_EVERY)."""
    for i, (_file, text) in enumerate(docs):
        if (i % VAL_EVERY == VAL_EVERY - 1) == validation:
            yield text


@dataclass(frozen=True)
class TokenData:
    """A tokenized data set in the cache: memory-mapped splits and what pins them."""

    train: np.ndarray  # 1-D token ids (memory map)
    val: np.ndarray
    source: str
    n_files: int
    digest: str  # sha256 over both splits' token bytes

    @property
    def n_tokens(self) -> int:
        return int(self.train.size + self.val.size)


def _cache_key(files: list[Path], tokenizer: Any, text_field: str, source: str) -> str:
    h = hashlib.sha256(f"{CACHE_FORMAT}\0{tokenizer.digest}\0{text_field}\0{source}".encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def _encode(tokenizer: Any, text: str, dtype: np.dtype) -> np.ndarray:
    if tokenizer.digest == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype, copy=False)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


def _write_split(path: Path, docs: Iterator[str], tokenizer: Any, dtype: np.dtype, digest: Any) -> int:
    n = 0
    buf: list[np.ndarray] = []
    buffered = 0
    with path.open("wb") as f:
        for text in docs:
            ids = _encode(tokenizer, text, dtype)
            buf.append(ids)
            buffered += ids.size
            if buffered >= WRITE_BUFFER_TOKENS:
                blob = np.concatenate(buf).tobytes()
                f.write(blob)
                digest.update(blob)
                n += buffered
                buf, buffered = [], 0
        if buf:
            blob = np.concatenate(buf).tobytes()
            f.write(blob)
            digest.update(blob)
            n += buffered
    return n


def load_token_data(files: list[Path], source: str, tokenizer: Any, text_field: str) -> TokenData:
    """Tokenize `files` into the cache (once) and memory-map the two splits."""
    key = _cache_key(files, tokenizer, text_field, source)
    root = cache_root()
    final = root / key
    if not (final / "meta.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        try:
            dtype = _dtype(tokenizer.vocab_size)
            digest = hashlib.sha256()
            counts = {}
            for split in ("train", "val"):
                docs = split_documents(iter_documents(files, text_field), split == "val")
                counts[split] = _write_split(tmp / f"{split}.bin", docs, tokenizer, dtype, digest)
            meta = {
                "format": CACHE_FORMAT,
                "source": source,
                "files": len(files),
                "dtype": dtype.name,
                "tokens": counts,
                "sha256": digest.hexdigest(),
                "tokenizer": tokenizer.digest,
                "text_field": text_field,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                os.replace(tmp, final)
            except OSError:  # another process built the same cache first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("tokenized %s into %s: %s tokens", source, final, counts)
    meta = json.loads((final / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])

    def mapped(split: str) -> np.ndarray:
        if meta["tokens"][split] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(final / f"{split}.bin", dtype=dtype, mode="r")

    return TokenData(mapped("train"), mapped("val"), source, int(meta["files"]), meta["sha256"])


@functools.lru_cache(maxsize=2)
def _permutation(n_windows: int, seed: int) -> torch.Tensor:
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))


def window_starts(
    n_tokens: int, seq_len: int, sample_ids: torch.Tensor, seed: int, step_seed: Any
) -> torch.Tensor:
    """Start offsets of the windows for global sample ids (step * batch_size + j): stride-seq_len
    windows, each used once per epoch, in an order permuted by (seed, epoch)."""
    n_windows = (n_tokens - 1) // seq_len
    epochs = sample_ids // n_windows
    out = torch.empty_like(sample_ids)
    for epoch in epochs.unique().tolist():
        mask = epochs == epoch
        perm = _permutation(n_windows, step_seed(seed, int(epoch), "epoch"))
        out[mask] = perm[sample_ids[mask] % n_windows] * seq_len
    return out
