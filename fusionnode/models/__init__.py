"""Bundled models and the model-spec resolver.

A model spec is a bundled name (see BUNDLED_MODELS), a local Hugging Face config (a
config.json file or a directory holding one: llama, qwen2, mistral or gpt2, see
`hf_config`), or "package.module:factory": the factory is imported and called (with
`vocab_size=` / `seq_len=` keywords only when those are given) and must return an `nn.Module`.

Language models take input_ids LongTensor[B, T] and return logits [B, T, V]; the
caller computes the loss. A factory model describes itself to `model_info` through
attributes: `vocab_size` and `max_seq_len` (language model) or `num_classes` and
`image_size` (vision model, input [B, 3, image_size, image_size]).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import torch
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.models import gpt2, hf_config, llama, resnet

__all__ = ["BUNDLED_MODELS", "ModelInfo", "build_model", "model_info"]


@dataclasses.dataclass(frozen=True)
class BundledModel:
    kind: str  # "lm" | "vision"
    factory: Callable[..., nn.Module]  # factory(vocab_size=..., seq_len=...) -> nn.Module


def _gpt2(name: str) -> BundledModel:
    return BundledModel("lm", functools.partial(gpt2.build, name))


def _llama(name: str) -> BundledModel:
    return BundledModel("lm", functools.partial(llama.build, name))


def _hf(spec: str) -> Callable[..., nn.Module]:
    """Factory for a local HF config.json (read at every build, so a changed file is seen)."""

    def factory(*, vocab_size: int | None = None, seq_len: int | None = None) -> nn.Module:
        cfg = hf_config.read_hf_config(spec)
        if isinstance(cfg, gpt2.GPT2Config):
            changes = {"vocab_size": vocab_size, "n_ctx": seq_len}
            cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
            return gpt2.GPT2(cfg)
        changes = {"vocab_size": vocab_size, "max_position_embeddings": seq_len}
        cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
        return llama.Llama(cfg)

    return factory


def _resnet(name: str) -> BundledModel:
    def factory(*, vocab_size: int | None = None, seq_len: int | None = None) -> nn.Module:
        if seq_len is not None:
            raise ConfigError(f"seq_len does not apply to the vision model {name!r}")
        return resnet.build(name, num_classes=vocab_size)

    return BundledModel("vision", factory)


BUNDLED_MODELS: dict[str, BundledModel] = {
    **{name: _gpt2(name) for name in gpt2.CONFIGS},
    **{name: _llama(name) for name in llama.CONFIGS},
    **{name: _resnet(name) for name in resnet.VARIANTS},
}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str  # the spec it was built from
    kind: str  # "lm" | "vision"
    vocab_size: int  # LM vocabulary; number of classes for a vision model
    seq_len: int  # max context in tokens (0 for vision)
    n_params: int  # unique parameters (tied weights counted once)
    sample_shape: tuple[int, ...]  # shape of one input sample without the batch dim, at max context
    input_dtype: str  # "int64" for token ids, "float32" for images


def _resolve_factory(spec: str) -> Callable[..., object]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        known = ", ".join(BUNDLED_MODELS)
        raise ConfigError(
            f"unknown model {spec!r}: expected one of {known}, a Hugging Face config.json (or its directory) or 'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"model {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"model {spec!r}: {module_name!r} has no callable {attr!r}")
    return factory


def build_model(spec: str, *, vocab_size: int | None = None, seq_len: int | None = None) -> nn.Module:
    """Build the model named by `spec` on the current default device (use `torch.device("meta")`
    as a context manager to build without allocating). Deterministic given torch.manual_seed."""
    kwargs = {k: v for k, v in (("vocab_size", vocab_size), ("seq_len", seq_len)) if v is not None}
    for key, value in kwargs.items():
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model {spec!r}: {key} must be a positive int, got {value!r}")
    bundled = BUNDLED_MODELS.get(spec)
    if bundled is not None:
        factory = bundled.factory
    elif hf_config.looks_like_hf_config(spec):
        factory = _hf(spec)
    else:
        factory = _resolve_factory(spec)
    try:
        model = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"model {spec!r}: factory failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec!r}: factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


@functools.lru_cache(maxsize=64)
def model_info(spec: str, *, vocab_size: int | None = None, seq_len: int | None = None) -> ModelInfo:
    """Describe a model without allocating its weights (it is built on the meta device)."""
    with torch.device("meta"):
        model = build_model(spec, vocab_size=vocab_size, seq_len=seq_len)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    if hasattr(model, "vocab_size") and hasattr(model, "max_seq_len"):
        v, t = int(model.vocab_size), int(model.max_seq_len)
        return ModelInfo(spec, "lm", v, t, n_params, (t,), "int64")
    if hasattr(model, "num_classes") and hasattr(model, "image_size"):
        c, s = int(model.num_classes), int(model.image_size)
        return ModelInfo(spec, "vision", c, 0, n_params, (3, s, s), "float32")
    raise ConfigError(
        f"model {spec!r} must expose vocab_size and max_seq_len (language model) "
        "or num_classes and image_size (vision model)"
    )
