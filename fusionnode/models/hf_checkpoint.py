"""Hugging Face checkpoint directories (config.json + safetensors, sharded or not) in and out.

Names and layouts are mapped exactly: the Llama family already uses HF's names and [out, in]
linear layout; GPT-2's HF checkpoints store the attention and MLP projections as Conv1D
([in, out]), so c_attn, c_proj and c_fc weights are transposed both ways. A tied output
projection is not stored (transformers ties it on load). Every tensor's shape is checked
against the model built from the config before anything is copied: a checkpoint that disagrees
with its config is refused naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.models.gpt2 import GPT2
from fusionnode.models.hf_config import CONFIG_FILE, hf_config_dict
from fusionnode.models.llama import Llama

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# constant buffers older checkpoints carry; recomputed by the model, never loaded
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: not a safetensors index ({exc})") from exc
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ConfigError(f"{directory}: no {WEIGHTS_FILE}, {INDEX_FILE} or *.safetensors file")
    return found


def _is_conv1d(model: nn.Module, name: str) -> bool:
    return isinstance(model, GPT2) and name.endswith(GPT2_CONV1D)


def load_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """Copy the weights of the HF checkpoint in `directory` into `model` (built from its config).

    ConfigError when a tensor is missing, unexpected, or of another shape than the config implies."""
    directory = Path(directory).expanduser()
    if not isinstance(model, (GPT2, Llama)):
        raise ConfigError(f"--init-from {directory}: the model is not a GPT-2 or Llama-family model")
    expected = dict(model.named_parameters())  # canonical names: a tied lm_head is not listed
    tied_head = "lm_head.weight" not in expected
    found: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in _weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    name = key
                    if isinstance(model, GPT2) and not name.startswith(("transformer.", "lm_head.")):
                        name = "transformer." + name  # the original OpenAI-converted checkpoints
                    if name.endswith(_IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
                        continue
                    if name not in expected:
                        raise ConfigError(
                            f"{file}: tensor {key!r} is not a parameter of the model in its config"
                        )
                    want = tuple(expected[name].shape)
                    if _is_conv1d(model, name):
                        want = want[::-1]
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != want:
                        raise ConfigError(
                            f"{file}: tensor {key!r} has shape {list(shape)}, but the config implies {list(want)}"
                        )
                    tensor = f.get_tensor(key)
                    found[name] = tensor.t() if _is_conv1d(model, name) else tensor
                    where[name] = file
        except (OSError, RuntimeError) as exc:  # safetensors raises these on a damaged file
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{file}: cannot read safetensors: {exc}") from exc
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ConfigError(
            f"{directory}: checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. {missing[:3]}"
        )
    with torch.no_grad():
        for name, p in expected.items():
            t = found[name]
            if not t.is_floating_point():
                raise ConfigError(f"{where[name]}: tensor {name!r} has dtype {t.dtype}, expected a float")
            p.copy_(t.to(p.dtype))
    logger.info("initialised %d tensors from %s", len(found), directory)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under HF names and layouts (contiguous; a tied lm_head left out)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().t() if _is_conv1d(model, name) else p.detach()
        out[name] = t.contiguous().clone()
    return out


def save_hf_checkpoint(model: nn.Module, directory: str | Path) -> Path:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads."""
    if not isinstance(model, (GPT2, Llama)):
        raise ConfigError(
            f"export --format hf: {type(model).__name__} is not a GPT-2 or Llama-family model; "
            "use the default single-file export"
        )
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_FILE}.tmp"
    save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config_dict(model.config), indent=2) + "\n")
    return out
