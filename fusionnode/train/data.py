"""Training data: the byte-level encoding, the corpora, and batches that depend only on (seed, step).

Every batch is a pure function of (corpus, seed, step, batch size, sequence length): a batch
can be regenerated exactly after a resume or a re-plan, and the local and distributed
trainers see the same samples in the same order.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fusionnode.errors import ConfigError
from fusionnode.train.spec import JobSpec

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256  # byte-level tokens
DEFAULT_CORPUS_MAX_BYTES = 16 * 2**20  # bytes of stdlib source used as the default corpus
DATA_MAX_BYTES = 1 * 2**30  # bytes; a --data corpus is cut (with a warning) at this size
VALIDATION_FRACTION = 0.05  # the last 5% of the corpus bytes are held out
BINARY_SNIFF_BYTES = 8192  # a file with a NUL byte in its first 8 KiB is skipped as binary
DEFAULT_CORPUS_NAME = "python-stdlib"
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def encode(text: str | bytes) -> torch.Tensor:
    """Text (UTF-8) or raw bytes -> a 1-D int64 tensor of byte ids in [0, 255]."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        if data
        else torch.empty(0, dtype=torch.long)
    )


def decode(ids: Sequence[int] | torch.Tensor) -> str:
    """Byte ids -> text; invalid UTF-8 becomes U+FFFD. Ids outside [0, 255] raise ValueError."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: the concatenated bytes, where they came from, and a digest to pin them."""

    tokens: torch.Tensor  # uint8, 1-D, read-only by convention
    source: str  # "python-stdlib" or the resolved --data path
    n_files: int
    digest: str  # sha256 of the bytes, hex

    @property
    def n_bytes(self) -> int:
        return int(self.tokens.numel())


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _concat(files: list[Path], max_bytes: int) -> tuple[bytes, int]:
    chunks: list[bytes] = []
    total = used = 0
    for f in files:
        try:
            blob = f.read_bytes()
        except OSError as exc:
            logger.warning("skipping unreadable file %s: %s", f, exc)
            continue
        if b"\x00" in blob[:BINARY_SNIFF_BYTES] or not blob:
            continue
        if total + len(blob) > max_bytes:
            logger.info("corpus capped at %d bytes, inside %s", max_bytes, f)
            blob = blob[: max_bytes - total]
        chunks.append(blob)
        total += len(blob)
        used += 1
        if total >= max_bytes:
            break
    return b"".join(chunks), used


@functools.lru_cache(maxsize=4)
def _load_corpus_cached(key: str, max_bytes: int) -> Corpus:
    if key == DEFAULT_CORPUS_NAME:
        files = _stdlib_files()
        source = DEFAULT_CORPUS_NAME
    else:
        path = Path(key)
        if not path.exists():
            raise ConfigError(f"--data {key}: no such file or directory")
        files = _data_files(path)
        source = str(path)
    blob, used = _concat(files, max_bytes)
    if not blob:
        raise ConfigError(f"--data {source}: no readable text found ({len(files)} file(s) looked at)")
    tokens = torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())
    digest = hashlib.sha256(blob).hexdigest()
    logger.info("corpus %s: %d bytes from %d file(s), sha256 %s", source, len(blob), used, digest[:16])
    return Corpus(tokens=tokens, source=source, n_files=used, digest=digest)


def load_corpus(data: str | None = None, *, max_bytes: int | None = None) -> Corpus:
    """The corpus for `--data` (a file, or a directory read recursively in sorted order), or the default.

    The default corpus is this Python's own standard-library source (no download); it is capped
    at `DEFAULT_CORPUS_MAX_BYTES`. Results are cached in memory per path.
    """
    if data is None:
        return _load_corpus_cached(DEFAULT_CORPUS_NAME, max_bytes or DEFAULT_CORPUS_MAX_BYTES)
    return _load_corpus_cached(str(Path(data).expanduser().resolve()), max_bytes or DATA_MAX_BYTES)


def split_corpus(
    tokens: torch.Tensor, val_fraction: float = VALIDATION_FRACTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last `val_fraction` of the bytes are the validation split."""
    n_val = int(tokens.numel() * val_fraction)
    return tokens[: tokens.numel() - n_val], tokens[tokens.numel() - n_val :]


def step_seed(seed: int, step: int, purpose: str = "batch") -> int:
    """A 63-bit seed derived from (purpose, seed, step) alone: never from process history."""
    digest = hashlib.blake2b(f"fusionnode:{purpose}:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def shard_ranges(replica_sizes: Sequence[int], batch_size: int) -> list[range]:
    """Contiguous sample ranges of a step's batch, one per data-parallel replica, in replica order."""
    if any(not isinstance(n, int) or n < 0 for n in replica_sizes):
        raise ConfigError(f"replica batch sizes must be integers >= 0, got {list(replica_sizes)}")
    if sum(replica_sizes) != batch_size:
        raise ConfigError(
            f"replica batch sizes {list(replica_sizes)} do not add up to the batch size {batch_size}"
        )
    ranges, start = [], 0
    for n in replica_sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def loss_scale(micro_batch_size: int, batch_size: int) -> float:
    """Weight of one micro-batch's mean loss in the step's loss (the mean over every token of the batch)."""
    return micro_batch_size / batch_size


def stream_files(data: str | None) -> tuple[list[Path], str]:
    """(files, source name) that the streamed path reads for `--data` (or the default corpus, capped
    at DEFAULT_CORPUS_MAX_BYTES as in memory)."""
    from fusionnode.train.dataset import data_files

    if data is not None:
        path = Path(data).expanduser().resolve()
        files = data_files(path)
        if not files:
            raise ConfigError(f"--data {path}: no files found")
        return files, str(path)
    files, total = [], 0
    for f in _stdlib_files():
        files.append(f)
        total += f.stat().st_size
        if total >= DEFAULT_CORPUS_MAX_BYTES:
            break
    return files, DEFAULT_CORPUS_NAME


class BatchSource:
    """Windows of the training split; `batch(step)` depends only on (data, seed, step, B, T).

    Two kinds of data: an in-memory byte corpus (`Corpus`, the default corpus without --data and
    --tokenizer: random windows, as the demo has always trained), or a streamed, tokenized data set
    (`dataset.TokenData`, for --data and --tokenizer: disjoint windows permuted per epoch)."""

    def __init__(
        self,
        corpus: Corpus | None,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        token_data: Any = None,
        tokenizer_digest: str = "bytes",
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        self.corpus = corpus
        self.token_data = token_data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.tokenizer_digest = tokenizer_digest
        if token_data is not None:
            self.train, self.val = token_data.train, token_data.val
            self.source_name, self.n_tokens, self.digest = (
                token_data.source,
                token_data.n_tokens,
                token_data.digest,
            )
        else:
            assert corpus is not None
            self.train, self.val = split_corpus(corpus.tokens)
            self.source_name, self.n_tokens, self.digest = corpus.source, corpus.n_bytes, corpus.digest
        unit = "tokens" if token_data is not None else "bytes"
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) < seq_len + 1:
                raise ConfigError(
                    f"corpus {self.source_name}: {len(split)} {unit} in the {name} split, "
                    f"need at least seq_len + 1 = {seq_len + 1}"
                )
        self._offsets = torch.arange(seq_len + 1)

    @classmethod
    def from_spec(cls, spec: JobSpec, seq_len: int) -> BatchSource:
        """The batch source of a `JobSpec` (`seq_len` resolved by the caller, see `resolve_seq_len`)."""
        if spec.data is None and spec.tokenizer is None:
            return cls(load_corpus(), batch_size=spec.batch_size, seq_len=seq_len, seed=spec.seed)
        from fusionnode.train.dataset import load_token_data
        from fusionnode.train.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer)
        files, source = stream_files(spec.data)
        data = load_token_data(files, source, tokenizer, spec.text_field)
        return cls(
            None,
            batch_size=spec.batch_size,
            seq_len=seq_len,
            seed=spec.seed,
            token_data=data,
            tokenizer_digest=tokenizer.digest,
        )

    def _take(self, split: Any, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = starts[:, None] + self._offsets
        if isinstance(split, torch.Tensor):
            windows = split[index].long()
        else:  # a memory-mapped token file: only the windows' pages are read
            windows = torch.from_numpy(np.asarray(split[index.numpy()]).astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _windows(self, split: Any, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(split) - self.seq_len, (n,), generator=gen)
        return self._take(split, starts)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [batch_size, seq_len]; targets are inputs shifted by one token."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.token_data is None:
            return self._windows(self.train, step_seed(self.seed, step), self.batch_size)
        from fusionnode.train.dataset import window_starts

        ids = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        return self._take(self.train, window_starts(len(self.train), self.seq_len, ids, self.seed, step_seed))

    def microbatches(self, step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's batch split evenly along dim 0 into `m` micro-batches, in order."""
        if m < 1 or self.batch_size % m:
            raise ConfigError(f"batch size {self.batch_size} cannot be split into {m} equal micro-batches")
        inputs, targets = self.batch(step)
        return list(zip(inputs.chunk(m), targets.chunk(m), strict=True))

    def shard(self, step: int, replica_sizes: Sequence[int]) -> list[range]:
        """Sample ranges of step `step`'s batch per data-parallel replica (contiguous, by batch share).

        The ranges depend only on the shares; `step` is validated so that a caller cannot ask for
        a shard of a step that has no batch.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return shard_ranges(replica_sizes, self.batch_size)

    def shard_batches(
        self, step: int, replica_sizes: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of each replica's slice of the step's batch."""
        inputs, targets = self.batch(step)
        return [
            (inputs[r.start : r.stop], targets[r.start : r.stop]) for r in self.shard(step, replica_sizes)
        ]

    def eval_batch(self, index: int = 0, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed batch of the validation split: the same for a given (seed, index) in every run."""
        return self._windows(self.val, step_seed(self.seed, index, "eval"), batch_size or self.batch_size)

    def state(self, next_step: int) -> dict[str, Any]:
        """What a checkpoint records so a resume can check it replays the same data."""
        return {
            "next_step": next_step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "corpus_source": self.source_name,
            "corpus_bytes": self.n_tokens,
            "corpus_sha256": self.digest,
            "tokenizer": self.tokenizer_digest,
        }

    def check_state(self, state: dict[str, Any]) -> int:
        """Verify a checkpoint's data state matches this source; return the step to resume at."""
        mine = self.state(0)
        diffs = [k for k in ("seed", "batch_size", "seq_len", "corpus_sha256") if state.get(k) != mine[k]]
        if state.get("tokenizer", "bytes") != mine["tokenizer"]:
            diffs.append("tokenizer")
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {state.get(k)!r} vs now {mine[k]!r}" for k in diffs)
            raise ConfigError(f"cannot resume: the data differs from the checkpoint's ({detail})")
        return int(state["next_step"])
