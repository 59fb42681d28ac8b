"""Llama-family decoder (Llama, Qwen2, Mistral shapes), written to trace with torch.fx and describe portably.

RMSNorm, rotary position embeddings (the "rotate half" layout of Hugging Face's checkpoints),
a SwiGLU MLP and grouped-query attention, with tied or untied input/output embeddings.
Parameter names are exactly Hugging Face's `LlamaForCausalLM` names
(model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ..., model.norm.weight,
lm_head.weight), and every projection is an `nn.Linear` in HF's own [out, in] layout, so an HF
checkpoint loads without any transposition. A tied `lm_head.weight` IS
`model.embed_tokens.weight` (one Parameter; `named_parameters()` reports the latter).

Forward: `input_ids` LongTensor[B, T] -> logits FloatTensor[B, T, V]. Like GPT-2 here, the forward
avoids Python ints derived from shapes: positions come from a cumulative sum and travel between
layers as an int64 tensor; every attention layer computes its own cos/sin from them, so a stage
boundary carries the residual stream and the positions, never a non-tensor value.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # initializer_range of the Hugging Face Llama configs


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int  # max context, tokens
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (Llama's attention_bias)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    mlp_bias: bool = False  # bias on gate/up/down
    model_type: str = "llama"  # "llama" | "qwen2" | "mistral": what `export --format hf` writes

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


CONFIGS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    ),
    "qwen2-tiny": LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qkv_bias=True,
        model_type="qwen2",
    ),
    # Llama 3.2 1B shape
    "llama-1b": LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Llama 2 7B shape
    "llama-7b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Mistral 7B v0.1 shape (full attention: the sliding window is not implemented)
    "mistral-7b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        model_type="mistral",
    ),
}


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


def rotary(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for positions pos [B, T] (HF's default rope)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
    freqs = pos.unsqueeze(-1).float() * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return torch.cos(emb), torch.sin(emb)


def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    return torch.cat((-x.narrow(-1, half, half), x.narrow(-1, 0, half)), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        assert hd is not None
        self.n_head, self.n_kv, self.head_dim, self.theta = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            cfg.rope_theta,
        )
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_head * hd, cfg.hidden_size, bias=cfg.attention_bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.head_dim)).transpose(1, 2)  # [B, n, T, hd]

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.n_head // self.n_kv
        if rep == 1:
            return x
        return x.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)  # as HF's repeat_kv

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q_proj(x), self.n_head)
        k = self._heads(self.k_proj(x), self.n_kv)
        v = self._heads(self.v_proj(x), self.n_kv)
        cos, sin = rotary(pos, self.head_dim, self.theta)
        half = self.head_dim // 2
        q = q * cos + _rotate_half(q, half) * sin
        k = k * cos + _rotate_half(k, half) * sin
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-family language model; `vocab_size` and `max_seq_len` describe it to `model_info`."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_position_embeddings
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                "layers": nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)),
                "norm": RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            }
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model["embed_tokens"].weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF init: N(0, initializer_range) for linear and embedding weights, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if module is not self.lm_head or not self.config.tie_word_embeddings:
                    nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        pos = torch.cumsum(torch.ones_like(input_ids), dim=-1) - 1  # [B, T] positions 0..T-1
        x = m["embed_tokens"](input_ids)
        for layer in m["layers"]:
            x = layer(x, pos)
        return self.lm_head(m["norm"](x))


def build(name: str, *, vocab_size: int | None = None, seq_len: int | None = None) -> Llama:
    cfg = CONFIGS[name]
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, max_position_embeddings=seq_len)
    return Llama(cfg)
