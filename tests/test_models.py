"""Bundled models and the model-spec resolver."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.models import BUNDLED_MODELS, build_model, model_info
from fusionnode.models.gpt2 import CONFIGS

torch.set_num_threads(1)

# published parameter counts of the GPT-2 checkpoints (tied lm_head counted once)
KNOWN_GPT2_PARAMS = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}
# torchvision's counts
KNOWN_RESNET_PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "resnet101": 44_549_160}


def factory() -> nn.Module:
    """Referenced as the spec "tests.test_models:factory"."""
    return nn.Sequential(nn.Linear(3, 4))


def not_a_module() -> dict:
    return {}


def analytic_gpt2_params(name: str) -> int:
    c = CONFIGS[name]
    d, L = c.n_embd, c.n_layer
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return c.vocab_size * d + c.n_ctx * d + L * per_block + 2 * d


def test_every_bundled_model_builds_on_meta_quickly():
    t0 = time.perf_counter()
    for name in BUNDLED_MODELS:
        with torch.device("meta"):
            model = build_model(name)
        assert all(p.is_meta for p in model.parameters())
        info = model_info(name)
        assert info.name == name and info.n_params > 0
        assert info.kind == BUNDLED_MODELS[name].kind == ("vision" if name.startswith("resnet") else "lm")
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("name", sorted(KNOWN_GPT2_PARAMS))
def test_gpt2_param_counts(name):
    info = model_info(name)
    assert info.n_params == KNOWN_GPT2_PARAMS[name] == analytic_gpt2_params(name)
    assert (info.vocab_size, info.seq_len, info.sample_shape, info.input_dtype) == (
        50257,
        1024,
        (1024,),
        "int64",
    )


@pytest.mark.parametrize("name", sorted(KNOWN_RESNET_PARAMS))
def test_resnet_param_counts(name):
    info = model_info(name)
    assert info.n_params == KNOWN_RESNET_PARAMS[name]
    assert info.sample_shape == (3, 224, 224) and info.vocab_size == 1000


def test_gpt2_shapes_of_standard_sizes():
    expected = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20)}
    expected["gpt2-xl"] = (48, 1600, 25)
    for name, (layers, d, heads) in expected.items():
        c = CONFIGS[name]
        assert (c.n_layer, c.n_embd, c.n_head, c.n_ctx, c.vocab_size) == (layers, d, heads, 1024, 50257)
    tiny = model_info("gpt2-tiny")
    assert (tiny.vocab_size, tiny.seq_len) == (256, 128)


def test_hf_parameter_names_and_tied_head():
    with torch.device("meta"):
        model = build_model("gpt2-small")
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    block0 = [n for n in names if n.startswith("transformer.h.0.")]
    assert block0 == [
        f"transformer.h.0.{s}"
        for s in (
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        )
    ]
    assert names[-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert "lm_head.weight" not in names  # tied: reported once, under wte
    assert "lm_head.weight" in model.state_dict()
    assert model.lm_head.weight is model.transformer.wte.weight
    # nn.Linear layout ([out, in]), not HF Conv1D ([in, out])
    assert tuple(model.transformer.h[0].attn.c_attn.weight.shape) == (3 * 768, 768)


def test_gpt2_tiny_forward_and_deterministic_init():
    torch.manual_seed(3)
    a = build_model("gpt2-tiny")
    torch.manual_seed(3)
    b = build_model("gpt2-tiny")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)
    assert abs(a.transformer.wte.weight.std().item() - 0.02) < 0.002
    proj = a.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(proj - 0.02 / math.sqrt(2 * 4)) < 0.001
    x = torch.randint(0, 256, (2, 16))
    logits = a(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    targets = torch.randint(0, 256, (2, 16))
    loss = F.cross_entropy(logits.view(-1, 256), targets.view(-1))
    assert abs(loss.item() - math.log(256)) < 0.3  # near-uniform at init (logit std ~0.02*sqrt(d))
    # causal: changing a later token leaves earlier logits unchanged
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    assert torch.allclose(a(y)[:, :10], logits[:, :10], atol=1e-6)


def test_overrides_and_resnet_forward():
    info = model_info("gpt2-small", vocab_size=256, seq_len=256)
    assert (info.vocab_size, info.seq_len) == (256, 256)
    torch.manual_seed(0)
    model = build_model("resnet18", vocab_size=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="seq_len"):
        build_model("resnet18", seq_len=10)
    with pytest.raises(ConfigError, match="positive int"):
        build_model("gpt2-tiny", vocab_size=0)


def test_factory_specs(monkeypatch):
    model = build_model("fusionnode.models.gpt2:tiny", seq_len=64)
    assert model.max_seq_len == 64
    assert model_info("fusionnode.models.gpt2:tiny").n_params == model_info("gpt2-tiny").n_params
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seq = build_model("tests.test_models:factory")
    assert isinstance(seq, nn.Sequential)
    with pytest.raises(ConfigError, match="must expose vocab_size"):
        model_info("tests.test_models:factory")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt3-huge", "unknown model 'gpt3-huge'.*gpt2-tiny"),
        ("no_such_package_xyz.mod:fn", "cannot import"),
        ("fusionnode.models.gpt2:nope", "no callable 'nope'"),
        ("tests.test_models:not_a_module", "returned dict, not a torch.nn.Module"),
        ("fusionnode.models.gpt2:GPT2", "factory failed"),
    ],
)
def test_bad_specs_raise_config_error(spec, message, monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(ConfigError, match=message):
        build_model(spec)
