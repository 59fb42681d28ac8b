"""Sampling text from a trained language model (byte-level, or with the job's tokenizer)."""

from __future__ import annotations

import codecs
import logging

import torch
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.train.tokenizer import ByteTokenizer, Tokenizer, encode_tensor

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 100  # bytes
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
EMPTY_PROMPT = "\n"  # what an empty prompt is replaced with (the model needs one token)


def context_length(model: nn.Module) -> int:
    """The model's maximum context in tokens (`max_seq_len`, as `fusionnode.models` exposes it)."""
    n_ctx = getattr(model, "max_seq_len", None)
    if not isinstance(n_ctx, int) or n_ctx < 1:
        raise ConfigError(f"{type(model).__name__} does not expose max_seq_len; cannot crop its context")
    return n_ctx


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int | None = DEFAULT_TOP_K,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, decoded (byte-level: invalid UTF-8 replaced).

    temperature 0 is greedy decoding; `top_k` None or 0 samples from the whole distribution.
    The context is cropped to the model's last `max_seq_len` tokens. Deterministic for a seed.
    """
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    n_ctx = context_length(model)
    device = next(model.parameters()).device
    tok = tokenizer or ByteTokenizer()
    ids = encode_tensor(tok, prompt or EMPTY_PROMPT).to(device)
    if ids.numel() == 0:
        ids = encode_tensor(tok, EMPTY_PROMPT).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(ids[-n_ctx:].unsqueeze(0))[0, -1].float()
            if temperature == 0:
                nxt = logits.argmax().view(1)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            ids = torch.cat([ids, nxt])
    finally:
        model.train(was_training)
    n_prompt = len(tok.encode(EMPTY_PROMPT)) if not prompt else 0
    generated = ids[n_prompt:].cpu().tolist()
    if isinstance(tok, ByteTokenizer):
        return decode_whole(generated, cut_start=not prompt)
    return tok.decode(generated)


def decode_whole(ids: list[int], *, cut_start: bool = False) -> str:
    """Sampled bytes as text, without the characters cut in two where the sample ends (and, with
    `cut_start`, where it starts): those would show as U+FFFD. Bytes the model got wrong in the
    middle still do."""
    data = bytes(ids)
    if cut_start:
        data = data.lstrip(bytes(range(0x80, 0xC0)))  # continuation bytes of a character begun earlier
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)
