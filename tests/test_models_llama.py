"""The Llama-family decoder: exact against transformers, built from HF configs, traced and portable."""

from __future__ import annotations

import itertools
import json

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import ConfigError, GraphError
from fusionnode.graph.portable import check_portable, describe_stage
from fusionnode.graph.trace import tensor_only_cuts, trace_model
from fusionnode.models import build_model, model_info
from fusionnode.models.hf_config import read_hf_config
from fusionnode.runtime.stage import StageModule, StageRunner

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

LOGIT_TOL = 1e-5
# published parameter counts (Llama 2 7B, Mistral 7B v0.1, Llama 3.2 1B with tied embeddings)
KNOWN_PARAMS = {"llama-7b": 6_738_415_616, "mistral-7b": 7_241_732_096, "llama-1b": 1_235_814_400}


def hf_tiny(kind: str, **extra):
    """A random tiny transformers model of `kind` (grouped-query attention: 4 heads, 2 kv heads)."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    cfg_cls, model_cls = classes[kind]
    base = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
    )
    if kind == "mistral":
        base["sliding_window"] = None
    base.update(extra)
    torch.manual_seed(0)
    return model_cls(cfg_cls(**base)).eval()


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "rope_theta": 500000.0, "attention_bias": True}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("mistral", {}),
    ],
)
def test_logits_match_transformers(tmp_path, kind, extra):
    hf = hf_tiny(kind, **extra)
    with torch.no_grad():  # biases are zero-initialised by transformers: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    ours = build_model(str(tmp_path)).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    assert (want - got).abs().max().item() < LOGIT_TOL
    tied = ours.lm_head.weight is ours.model["embed_tokens"].weight
    assert tied == bool(extra.get("tie_word_embeddings"))


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS))
def test_bundled_7b_shapes_have_the_published_sizes(name):
    assert model_info(name).n_params == KNOWN_PARAMS[name]


def _write(tmp_path, raw: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_unimplemented_config_fields_are_refused_by_name(tmp_path):
    hf = hf_tiny("llama")
    good = hf.config.to_dict()
    cases = {
        "rope_scaling.rope_type": dict(good, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        "rope_parameters.rope_type": dict(good, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
        "hidden_act": dict(good, hidden_act="gelu"),
        "attention_dropout": dict(good, attention_dropout=0.1),
        "sliding_window": dict(good, model_type="mistral", sliding_window=16),
        "model_type 'bert'": dict(good, model_type="bert"),
        "required field 'hidden_size'": {k: v for k, v in good.items() if k != "hidden_size"},
    }
    for field, raw in cases.items():
        path = _write(tmp_path, raw)
        with pytest.raises(ConfigError, match=r"config\.json") as info:
            build_model(path)
        assert field in str(info.value), str(info.value)
    # a window at least as long as the context changes nothing and is accepted
    cfg = read_hf_config(_write(tmp_path, dict(good, model_type="mistral", sliding_window=64)))
    assert cfg.model_type == "mistral"


def test_gpt2_config_maps_to_the_bundled_gpt2(tmp_path):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64)
    cfg.save_pretrained(tmp_path)
    model = build_model(str(tmp_path))
    assert type(model).__name__ == "GPT2" and model.config.dropout == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="activation_function"):
        build_model(_write(tmp_path, dict(cfg.to_dict(), activation_function="relu")))


def _chain_grads(model: nn.Module, traced, bounds, x, y):
    state = model.state_dict()
    runners = []
    for lo, hi in itertools.pairwise(bounds):
        wire = msgpack.unpackb(msgpack.packb(describe_stage(traced, lo, hi)))
        values = {n: state[n].detach().clone() for n in [*wire["params"], *wire["buffers"]]}
        runners.append(StageRunner(StageModule.from_description(wire, values)))
    acts = {"input_ids": x}
    for r in runners[:-1]:
        acts = r.forward(0, {k: v.clone() for k, v in acts.items()})
    loss = runners[-1].forward_loss(0, acts, y)
    grads = runners[-1].backward_loss(0)
    for r in reversed(runners[:-1]):
        grads = r.backward(0, grads)
    out: dict[str, torch.Tensor] = {}
    for r in runners:
        for n, p in r.module.named_stage_parameters().items():
            out[n] = out[n] + p.grad if n in out else p.grad.clone()
    return loss, out


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_portable_stages_match_single_process_autograd(name):
    torch.manual_seed(0)
    model = build_model(name)
    T = 24
    traced = trace_model(model, torch.zeros(1, T, dtype=torch.long), name)
    check_portable(traced)
    ok = tensor_only_cuts(traced.graph)
    n = traced.graph.num_nodes
    names = traced.node_names
    # at layer boundaries, and inside a layer's attention (only tensors cross: positions are int64)
    cuts = [
        names.index("model_layers_1_input_layernorm_weight"),
        names.index("model_layers_2_self_attn_o_proj"),
    ]
    assert all(ok[c] for c in cuts)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 256, (3, T), generator=g), torch.randint(0, 256, (3, T), generator=g)
    model.zero_grad()
    ref_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    loss, grads = _chain_grads(model, traced, [0, *cuts, n], x, y)
    assert abs(loss - ref_loss.item()) < 1e-5
    for pname, p in model.named_parameters():
        err = (grads[pname] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)
        assert err < 1e-5, f"{pname}: {err:.2e}"


class _Gelu2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfcx(x)


def test_operator_outside_the_allowlist_names_the_operator_and_its_module():
    model = build_model("llama-tiny")
    model.model["layers"][1].mlp.act = _Gelu2()
    mlp = model.model["layers"][1].mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x))
    traced = trace_model(model, torch.zeros(1, 8, dtype=torch.long), "llama-tiny")
    with pytest.raises(GraphError, match=r"special_erfcx.*model\.layers\.1\.mlp\.act.*erfcx is not in"):
        check_portable(traced)
