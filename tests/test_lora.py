"""LoRA adapters: frozen base, merge, export (merged into HF weights or as PEFT adapters), bad targets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fusionnode.cli import main
from fusionnode.errors import ConfigError
from fusionnode.models import build_model
from fusionnode.models.lora import LoRALinear, apply_lora, merge_lora
from fusionnode.train.export import load_model_from_checkpoint
from fusionnode.train.local import train_local
from fusionnode.train.spec import JobSpec

torch.set_num_threads(1)


def test_adapters_start_at_the_base_and_merge_exactly():
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = base(ids)
    adapted = apply_lora(base, ("q_proj", "o_proj", "up_proj"), rank=4, alpha=8.0)
    assert len(adapted) == 3 * base.config.num_hidden_layers
    trainable = [n for n, p in base.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with torch.no_grad():
        assert torch.equal(base(ids), want)  # lora_B starts at zero
        for m in base.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_()
        adapted_out = base(ids)
        merged = merge_lora(base)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert (merged(ids) - adapted_out).abs().max().item() < 1e-4
        assert (adapted_out - want).abs().max().item() > 1e-2


def test_unknown_or_tied_target_is_refused(capsys):
    with pytest.raises(ConfigError, match=r"no linear layer named \['nope'\]"):
        apply_lora(build_model("llama-tiny"), ("q_proj", "nope"), 4, 8.0)
    with pytest.raises(ConfigError, match="tied"):
        apply_lora(build_model("gpt2-tiny"), ("lm_head",), 4, 8.0)
    argv = ["train", "--local", "--model", "llama-tiny", "--lora-rank", "2", "--lora-targets", "c_attn"]
    assert main([*argv, "--steps", "1", "--seq-len", "8"]) == 2
    assert "no linear layer named ['c_attn']" in capsys.readouterr().err


@pytest.mark.parametrize("model,targets", [("llama-tiny", "q_proj,v_proj"), ("gpt2-tiny", "c_attn,c_fc")])
def test_lora_export_merged_and_as_adapters(tmp_path, model, targets):
    transformers = pytest.importorskip("transformers")
    spec = JobSpec(
        model=model,
        steps=3,
        batch_size=4,
        micro_batches=1,
        seq_len=16,
        lr=3e-2,
        warmup_steps=1,
        lora_rank=4,
        lora_targets=targets,
        save_dir=str(tmp_path / "run"),
        save_every=0,
    )
    res = train_local(spec)
    frozen_before = {n: p for n, p in build_model(model).named_parameters()}
    assert set(res.params) > set(frozen_before)
    ours = load_model_from_checkpoint(tmp_path / "run")
    run = str(tmp_path / "run")
    assert main(["export", "--checkpoint", run, "--format", "hf", "--out", str(tmp_path / "merged")]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf.eval()(ids).logits - ours(ids)).abs().max().item() < 1e-4
    out = tmp_path / "adapters"
    assert (
        main(["export", "--checkpoint", run, "--format", "hf", "--lora", "adapters", "--out", str(out)]) == 0
    )
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (
        cfg["peft_type"] == "LORA"
        and cfg["r"] == 4
        and sorted(cfg["target_modules"]) == sorted(targets.split(","))
    )
    tensors = load_file(str(out / "adapter_model.safetensors"))
    lora_names = {n for n in res.params if ".lora_" in n}
    assert set(tensors) == {f"base_model.model.{n}" for n in lora_names}
    for n in lora_names:
        assert torch.equal(tensors[f"base_model.model.{n}"], res.params[n])
