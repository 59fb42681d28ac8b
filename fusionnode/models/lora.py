"""LoRA adapters: chosen linear layers get a trainable low-rank update, everything else is frozen.

`apply_lora(model, targets, rank, alpha)` replaces every `nn.Linear` whose module name ends with
one of `targets` (e.g. "q_proj", "v_proj", "c_attn") by a `LoRALinear`:
    y = F.linear(x, W, b) + lora_B(lora_A(x)) * (alpha / rank)
W and b keep their names ("...q_proj.weight"), so the base checkpoint's names are unchanged;
the adapters are "...q_proj.lora_A.weight" [rank, in] (nn.Linear's default init) and
"...q_proj.lora_B.weight" [out, rank] (zeros: the adapted model starts equal to the base).
Every parameter except the adapters gets requires_grad=False; the trainers train only what
requires grad, and a swarm job sends only those to its optimizer hosts.

`merge_lora` folds the adapters back into plain `nn.Linear` layers (W + scale * B @ A), and
`peft_adapter` gives the adapter tensors and config in PEFT's layout for `export --lora adapters`.
LoRALinear is not a leaf module for tracing: it traces into get_attr + F.linear and two leaf
Linears, all inside the portable allowlist.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import ConfigError

DEFAULT_RANK = 8
DEFAULT_ALPHA = 16.0


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling


def parse_targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise ConfigError("--lora-targets: name at least one linear layer, e.g. q_proj,v_proj")
    return targets


def apply_lora(model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float) -> list[str]:
    """Adapt the matching linear layers in place and freeze the rest; returns the adapted module names.
    ConfigError when a target matches no linear layer (or matches the tied output projection)."""
    if rank < 1:
        raise ConfigError(f"--lora-rank must be >= 1, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted: list[str] = []
    matched = dict.fromkeys(targets, 0)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        hit = [t for t in targets if name == t or name.endswith("." + t)]
        if not hit:
            continue
        for t in hit:
            matched[t] += 1
        if name == "lm_head" and getattr(model, "lm_head", None) is module and _is_tied(model, module):
            raise ConfigError("--lora-targets: lm_head is tied to the input embedding; adapt other layers")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, rank, alpha))
        adapted.append(name)
    unmatched = [t for t, n in matched.items() if n == 0]
    if unmatched:
        raise ConfigError(f"--lora-targets: no linear layer named {unmatched} in {type(model).__name__}")
    return adapted


def _is_tied(model: nn.Module, module: nn.Linear) -> bool:
    return sum(1 for _n, p in model.named_parameters(remove_duplicate=False) if p is module.weight) > 1


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRALinear into a plain nn.Linear in place (W += scale * B @ A); returns the model."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            delta = module.lora_B.weight @ module.lora_A.weight * module.scaling
            linear.weight = nn.Parameter(module.weight.detach() + delta)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().clone())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    return model


def peft_adapter(model: nn.Module, base: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config.json) in PEFT's layout (peft.PeftModel.from_pretrained reads them)."""
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    rank = alpha = None
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for part in ("lora_A", "lora_B"):
                w = getattr(module, part).weight.detach().contiguous().clone()
                tensors[f"base_model.model.{name}.{part}.weight"] = w
            targets.add(name.rpartition(".")[2])
            rank, alpha = module.rank, module.alpha
    if rank is None:
        raise ConfigError("the checkpoint has no LoRA adapters (train with --lora-rank)")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(targets),
        "fan_in_fan_out": type(model).__name__ == "GPT2",
        "inference_mode": True,
    }
    return tensors, config
