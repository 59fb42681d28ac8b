"""Hugging Face `config.json` <-> the bundled model configs (GPT-2, Llama family), refusing what is not implemented.

`read_hf_config(path)` turns a local config.json (or a directory holding one) into a `GPT2Config`
or a `LlamaConfig`. A field that would change the model's arithmetic and that the code does not
implement (a rope scaling type, a sliding window shorter than the context, an activation other
than the family's, attention dropout, ...) raises `ConfigError` naming the file and the field:
such a config is refused, never silently trained as a different model. Fields that do not
change the forward pass (token ids, `use_cache`, `dtype`, labels, ...) are ignored.

`hf_config_dict(cfg)` is the inverse, for `fusionnode export --format hf`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fusionnode.errors import ConfigError
from fusionnode.models.gpt2 import GPT2Config
from fusionnode.models.llama import LlamaConfig

CONFIG_FILE = "config.json"
LLAMA_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_TYPES = ("gpt2", *LLAMA_TYPES)
GPT2_LN_EPS = 1e-5  # the bundled GPT-2's LayerNorm epsilon
EXPORT_TRANSFORMERS_VERSION = "4.46.0"  # written into exported configs (any >= 4.40 reads them)


def config_path(path: str | Path) -> Path:
    """The config.json named by `path`: the file itself, or `path/config.json`."""
    p = Path(path).expanduser()
    return p / CONFIG_FILE if p.is_dir() else p


def looks_like_hf_config(spec: str) -> bool:
    """Whether a model spec names a local HF config (a .json file or a directory with config.json)."""
    p = Path(spec).expanduser()
    return (p.is_file() and p.suffix == ".json") or (p.is_dir() and (p / CONFIG_FILE).is_file())


def read_hf_config(path: str | Path) -> GPT2Config | LlamaConfig:
    """Parse a local HF config.json into the bundled model config; ConfigError names what is unsupported."""
    file = config_path(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{file}: no such file (expected a Hugging Face config.json)") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: not a readable JSON config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: a config must be a JSON object")
    return parse_hf_config(raw, str(file))


def parse_hf_config(raw: dict[str, Any], where: str) -> GPT2Config | LlamaConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        arch = raw.get("architectures")
        raise ConfigError(
            f"{where}: model_type {model_type!r} (architectures {arch}) is not supported; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )

    def get(key: str, default: Any = ..., kind: type | tuple[type, ...] = int) -> Any:
        if key not in raw or raw[key] is None:
            if default is ...:
                raise ConfigError(f"{where}: required field {key!r} is missing")
            return default
        value = raw[key]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: {key}={value!r} must be a positive integer")
        if kind is float and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ConfigError(f"{where}: {key}={value!r} must be a number")
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}={value!r} must be true or false")
        return float(value) if kind is float else value

    def refuse(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{where}: {key}={value!r} is not supported ({why})")

    if model_type == "gpt2":
        return _parse_gpt2(raw, get, refuse)
    try:
        return _parse_llama(raw, model_type, get, refuse)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _parse_gpt2(raw: dict[str, Any], get: Any, refuse: Any) -> GPT2Config:
    n_embd = get("n_embd")
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise refuse("activation_function", act, "only the tanh GELU (gelu_new) is implemented")
    n_inner = raw.get("n_inner")
    if n_inner not in (None, 4 * n_embd):
        raise refuse("n_inner", n_inner, f"the MLP width is fixed at 4 * n_embd = {4 * n_embd}")
    eps = get("layer_norm_epsilon", GPT2_LN_EPS, float)
    if eps != GPT2_LN_EPS:
        raise refuse("layer_norm_epsilon", eps, f"the LayerNorm epsilon is fixed at {GPT2_LN_EPS}")
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if raw.get(key, want) != want:
            raise refuse(key, raw[key], f"only {key}={json.dumps(want)} is implemented")
    drops = {k: get(k, 0.0, float) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        raise refuse(
            "attn_pdrop", drops["attn_pdrop"], f"one dropout rate for all three is implemented: {drops}"
        )
    return GPT2Config(
        n_layer=get("n_layer"),
        n_embd=n_embd,
        n_head=get("n_head"),
        vocab_size=get("vocab_size"),
        n_ctx=get("n_positions", raw.get("n_ctx", ...)),
        dropout=drops["resid_pdrop"],
    )


def _rope_theta(raw: dict[str, Any], get: Any, refuse: Any) -> float:
    """rope_theta from `rope_parameters` (transformers >= 5) or the top level; only the default rope."""
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise refuse(key, params, "expected an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise refuse(f"{key}.rope_type", rope_type, "only the default rotary embedding is implemented")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise refuse(
                f"{key}.{extra[0]}", params[extra[0]], "only the default rotary embedding is implemented"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return get("rope_theta", 10000.0, float)


def _parse_llama(raw: dict[str, Any], model_type: str, get: Any, refuse: Any) -> LlamaConfig:
    hidden = get("hidden_size")
    n_head = get("num_attention_heads")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", act, "the SwiGLU MLP uses silu")
    dropout = get("attention_dropout", 0.0, float)
    if dropout != 0.0:
        raise refuse("attention_dropout", dropout, "attention dropout is not implemented")
    tp = raw.get("pretraining_tp", 1)
    if tp != 1:
        raise refuse("pretraining_tp", tp, "only 1 is implemented")
    ctx = get("max_position_embeddings")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", model_type == "mistral")
    if uses_window and window is not None and window < ctx:
        raise refuse("sliding_window", window, f"sliding-window attention is not implemented (context {ctx})")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = next(t for t in layer_types if t != "full_attention")
        raise refuse("layer_types", bad, "only full_attention layers are implemented")
    for key in ("quantization_config", "num_experts", "num_local_experts", "moe_intermediate_size"):
        if raw.get(key) not in (None, 0):
            raise refuse(key, raw[key], "not implemented")
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=n_head,
        num_key_value_heads=get("num_key_value_heads", n_head),
        vocab_size=get("vocab_size"),
        max_position_embeddings=ctx,
        head_dim=get("head_dim", None),
        rms_norm_eps=get("rms_norm_eps", 1e-6, float),
        rope_theta=_rope_theta(raw, get, refuse),
        tie_word_embeddings=get("tie_word_embeddings", False, bool),
        attention_bias=get("attention_bias", False, bool) if model_type == "llama" else False,
        qkv_bias=model_type == "qwen2",
        mlp_bias=get("mlp_bias", False, bool) if model_type == "llama" else False,
        model_type=model_type,
    )


def hf_config_dict(cfg: GPT2Config | LlamaConfig) -> dict[str, Any]:
    """The config.json that transformers reads back as the same model."""
    if isinstance(cfg, GPT2Config):
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.n_ctx,
            "n_ctx": cfg.n_ctx,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,
            "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": GPT2_LN_EPS,
            "initializer_range": 0.02,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "torch_dtype": "float32",
            "transformers_version": EXPORT_TRANSFORMERS_VERSION,
        }
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    out: dict[str, Any] = {
        "architectures": [arch[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "transformers_version": EXPORT_TRANSFORMERS_VERSION,
    }
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    elif cfg.model_type == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(sliding_window=None)
    return out
