"""Tokenizers: the default byte-level one, Hugging Face `tokenizer.json` files, and training a byte-level BPE.

`load_tokenizer(None)` is the byte-level tokenizer (256 ids, the demo's default); a path loads a
`tokenizer.json` with the `tokenizers` library (an optional dependency: `pip install
fusionnode[hf]`). `train_bpe` learns a byte-level BPE on the user's own corpus, since none can
be downloaded: it round-trips any text byte for byte (no normaliser, no added prefix space).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256
MIN_BPE_VOCAB = BYTE_VOCAB_SIZE  # a byte-level BPE holds at least the 256 byte symbols
BPE_MIN_FREQUENCY = 2  # a pair seen once is not merged


class Tokenizer(Protocol):
    name: str  # "bytes" or the tokenizer file
    vocab_size: int
    digest: str  # pins the tokenizer in checkpoints ("bytes" for the byte-level one)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; decoding replaces invalid UTF-8 with U+FFFD."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    digest = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a tokenizer.json file."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:
            raise ConfigError(
                "--tokenizer needs the 'tokenizers' package: pip install 'fusionnode[hf]'"
            ) from exc
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            blob = file.read_bytes()
            self._tok = _Tok.from_str(blob.decode("utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--tokenizer {file}: cannot read: {exc}") from exc
        except Exception as exc:  # tokenizers raises its own Exception type on a malformed file
            raise ConfigError(f"--tokenizer {file}: not a Hugging Face tokenizer.json: {exc}") from exc
        self.name = str(file)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.digest = hashlib.sha256(blob).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def load_tokenizer(path: str | None) -> Tokenizer:
    """The byte-level tokenizer for None, else the tokenizer.json at `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def encode_tensor(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """1-D int64 ids of `text`."""
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


def check_vocab(tokenizer: Tokenizer, model_vocab: int, model_name: str) -> None:
    """ConfigError when the tokenizer can produce ids the model has no embedding for."""
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"--tokenizer {tokenizer.name}: its vocabulary of {tokenizer.vocab_size} tokens exceeds the "
            f"model's {model_vocab} ({model_name})"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train a byte-level BPE with `vocab_size` ids on `texts` and write its tokenizer.json to `out`."""
    try:
        from tokenizers import Tokenizer as _Tok
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise ConfigError(
            "tokenizer training needs the 'tokenizers' package: pip install 'fusionnode[hf]'"
        ) from exc
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB} ids")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=BPE_MIN_FREQUENCY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(out).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    logger.info("trained a byte-level BPE of %d ids -> %s", tok.get_vocab_size(), path)
    return path
