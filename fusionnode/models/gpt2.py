"""GPT-2 family, written to trace cleanly with torch.fx and to describe portably.

Parameter names follow the usual GPT-2 checkpoint layout (transformer.wte.weight,
transformer.h.0.attn.c_attn.weight, ..., transformer.ln_f.weight, lm_head.weight),
but the projections are `nn.Linear` (weight [out, in]), not HF's Conv1D
(weight [in, out]): loading an HF checkpoint means transposing the c_attn, c_proj
and c_fc weights. `lm_head.weight` IS `transformer.wte.weight` (one Parameter);
`named_parameters()` reports it once, as `transformer.wte.weight`.

Forward: `input_ids` LongTensor[B, T] -> logits FloatTensor[B, T, V]. The loss is
computed by the caller. The forward pass avoids Python ints derived from shapes
(positions come from a cumulative sum, heads from `unflatten`, q/k/v from
`narrow`) so every node of the traced graph produces a tensor and any cut of it
carries only tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

GPT2_VOCAB = 50257  # BPE vocabulary of the released GPT-2 checkpoints
GPT2_CTX = 1024  # tokens
INIT_STD = 0.02  # GPT-2 weight init standard deviation


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = GPT2_VOCAB
    n_ctx: int = GPT2_CTX  # max context, tokens
    dropout: float = 0.0  # embedding, attention and residual dropout probability

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_ctx=128),
    "gpt2-small": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_embd = cfg.n_embd
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _heads(self, qkv: torch.Tensor, index: int) -> torch.Tensor:
        # [B, T, 3C] -> [B, H, T, Dh]
        part = qkv.narrow(-1, index * self.n_embd, self.n_embd)
        return part.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)
        q, k, v = self._heads(qkv, 0), self._heads(qkv, 1), self._heads(qkv, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).flatten(2)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 language model; `vocab_size` and `max_seq_len` describe it to `model_info`."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.n_ctx
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.n_ctx, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd, eps=1e-5),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # tied: one Parameter
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2L)."""
        proj_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = proj_std if name.endswith("c_proj") else INIT_STD
                if module is not self.lm_head:  # tied to wte, initialised there
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        pos = torch.cumsum(torch.ones_like(input_ids), dim=-1) - 1  # [B, T] positions 0..T-1
        x = tr["drop"](tr["wte"](input_ids) + tr["wpe"](pos))
        for block in tr["h"]:
            x = block(x)
        return self.lm_head(tr["ln_f"](x))


def build(name: str, *, vocab_size: int | None = None, seq_len: int | None = None) -> GPT2:
    cfg = CONFIGS[name]
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, n_ctx=seq_len)
    return GPT2(cfg)


def tiny(*, vocab_size: int | None = None, seq_len: int | None = None) -> GPT2:
    """Factory usable as the spec "fusionnode.models.gpt2:tiny"."""
    return build("gpt2-tiny", vocab_size=vocab_size, seq_len=seq_len)


def small(*, vocab_size: int | None = None, seq_len: int | None = None) -> GPT2:
    return build("gpt2-small", vocab_size=vocab_size, seq_len=seq_len)
