"""FlatOptimizer and the local path against torch.optim; LR schedule; sharding."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.optim import (
    Contributor,
    ExpectedContributions,
    FlatOptimizer,
    LRSchedule,
    OptimizerConfig,
    ParameterStore,
    clip_coefficient,
    lr_at,
    make_local_optimizer,
    shard_loads,
    shard_params,
)

torch.set_num_threads(1)

RTOL = 1e-6
SHAPES = {"w1": (16, 8), "b1": (16,), "emb": (10, 4), "ln": (4,), "conv": (3, 2, 2, 2), "s": ()}
STEPS = 20


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    """max |a - b| <= rtol * max(|b|, tiny): relative to the tensor's scale."""
    scale = max(float(b.abs().max()), 1e-12) if b.numel() else 1.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= rtol * scale, f"max abs err {err:.3e} > {rtol} * {scale:.3e}"


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _torch_groups(params: dict[str, nn.Parameter], wd: float) -> list[dict]:
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _run_pair(cfg: OptimizerConfig, torch_opt_factory, *, skip_some: bool = False, clip: float | None = None):
    base = _params()
    ref = {n: nn.Parameter(t.clone()) for n, t in base.items()}
    topt = torch_opt_factory(ref)
    flat = FlatOptimizer({n: t.clone() for n, t in base.items()}, cfg)
    g = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        lr = cfg.lr * (1.0 if step < 10 else 0.5)
        grads = {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()}
        if skip_some and step % 3 == 0:
            del grads["b1"], grads["conv"]
        for n, p in ref.items():
            p.grad = grads[n].clone() if n in grads else None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.values() if p.grad is not None], clip)
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        flat.step(grads, lr)
    for n in SHAPES:
        assert_rel_close(flat.params[n], ref[n].detach())
    return flat, topt, ref


@pytest.mark.parametrize("skip_some", [False, True])
def test_adamw_matches_torch(skip_some: bool) -> None:
    cfg = OptimizerConfig("adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    flat, topt, ref = _run_pair(
        cfg,
        lambda ps: torch.optim.AdamW(_torch_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8),
        skip_some=skip_some,
    )
    for n, p in ref.items():
        st = topt.state[p]
        assert flat.steps[n] == int(st["step"])
        assert_rel_close(flat.state["exp_avg"][n], st["exp_avg"])
        assert_rel_close(flat.state["exp_avg_sq"][n], st["exp_avg_sq"])


def test_adamw_with_global_clip_matches_torch() -> None:
    cfg = OptimizerConfig("adamw", lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    _run_pair(cfg, lambda ps: torch.optim.AdamW(_torch_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95)), clip=0.5)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_matches_torch(nesterov: bool) -> None:
    cfg = OptimizerConfig("sgd", lr=5e-2, weight_decay=0.01, momentum=0.9, nesterov=nesterov)
    flat, topt, ref = _run_pair(
        cfg,
        lambda ps: torch.optim.SGD(_torch_groups(ps, 0.01), lr=5e-2, momentum=0.9, nesterov=nesterov),
        skip_some=True,
    )
    for n, p in ref.items():
        assert_rel_close(flat.state["momentum_buffer"][n], topt.state[p]["momentum_buffer"])


def test_plain_sgd_matches_torch() -> None:
    cfg = OptimizerConfig("sgd", lr=0.1)
    _run_pair(cfg, lambda ps: torch.optim.SGD(list(ps.values()), lr=0.1))


def test_decay_names_override_ndim_rule() -> None:
    cfg = OptimizerConfig("adamw", lr=0.1, weight_decay=0.5, decay_names=frozenset({"b1"}))
    base = _params()
    flat = FlatOptimizer({n: t.clone() for n, t in base.items()}, cfg)
    zero = {n: torch.zeros(s) for n, s in SHAPES.items()}
    flat.step(zero, 0.1)  # zero grads: only decay moves parameters
    assert torch.equal(flat.params["b1"], base["b1"] * (1 - 0.1 * 0.5))
    assert torch.equal(flat.params["w1"], base["w1"])


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        OptimizerConfig("adam")
    with pytest.raises(ConfigError):
        OptimizerConfig(betas=(1.0, 0.9))
    with pytest.raises(ConfigError):
        OptimizerConfig("sgd", nesterov=True)
    with pytest.raises(ConfigError):
        OptimizerConfig(grad_clip=0.0)
    cfg = OptimizerConfig("adamw", lr=1e-3, decay_names=frozenset({"a", "b"}), grad_clip=1.0)
    assert OptimizerConfig.from_json(cfg.to_json()) == cfg


def test_state_dict_round_trip_continues_identically() -> None:
    cfg = OptimizerConfig("adamw", lr=1e-2, weight_decay=0.1)
    a = FlatOptimizer(_params(), cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        a.step({n: torch.randn(s, generator=g) for n, s in SHAPES.items()})
    sd = copy.deepcopy(a.state_dict())
    b = FlatOptimizer({n: t.clone() for n, t in a.params.items()}, cfg)
    b.load_state_dict(sd)
    grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    a.step(grads)
    b.step(grads)
    for n in SHAPES:
        assert torch.equal(a.params[n], b.params[n])


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_same_math_torch_local_and_store() -> None:
    torch.manual_seed(0)
    model_a = TwoLayer()
    model_b = copy.deepcopy(model_a)
    model_c = copy.deepcopy(model_a)
    cfg = OptimizerConfig("adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    named_a = dict(model_a.named_parameters())
    opt_a = torch.optim.AdamW(_torch_groups(named_a, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt_b = make_local_optimizer(dict(model_b.named_parameters()), cfg)
    named_c = dict(model_c.named_parameters())
    store = ParameterStore(
        "job",
        {n: p.detach() for n, p in named_c.items()},
        cfg,
        ExpectedContributions.same_for_all(named_c, {"r0/s0": Contributor("r0", 4)}),
    )
    g = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 6, generator=g)
        y = torch.randn(4, 3, generator=g)
        for model in (model_a, model_b, model_c):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt_a.step()
        opt_b.step()
        for n, p in named_c.items():
            assert store.push(step, "r0/s0", n, p.grad, 4).accepted
        assert store.ready(step)
        assert store.apply(step).applied
        got_step, fresh = store.get_params(min_step=step)
        assert got_step == step
        with torch.no_grad():
            for n, p in named_c.items():
                p.copy_(fresh[n])
    for (n, pa), pb, pc in zip(
        model_a.named_parameters(), model_b.parameters(), model_c.parameters(), strict=True
    ):
        assert_rel_close(pb.detach(), pa.detach())
        assert_rel_close(pc.detach(), pa.detach())
        assert not torch.equal(pa.detach(), dict(TwoLayer().named_parameters())[n].detach())


def test_local_optimizer_non_fp32_params_keep_fp32_masters() -> None:
    p = nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = make_local_optimizer({"p": p}, OptimizerConfig("sgd", lr=1e-3))
    for _ in range(10):
        p.grad = torch.ones(4, 4, dtype=torch.bfloat16)
        opt.step()
    # in bf16 alone each 1e-3 step would round away (spacing below 1.0 is 2^-8); the fp32 master keeps them
    assert abs(float(opt.opt.params["p"][0, 0]) - 0.99) < 1e-6
    assert p.dtype == torch.bfloat16 and float(p.detach()[0, 0]) == pytest.approx(0.99, abs=4e-3)


def test_lr_schedule() -> None:
    s = LRSchedule(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, s) == 0.0
    assert lr_at(1, s) == pytest.approx(0.1)
    assert lr_at(10, s) == pytest.approx(1.0)
    assert lr_at(60, s) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_at(110, s) == pytest.approx(0.1)
    assert lr_at(1000, s) == pytest.approx(0.1)
    values = [lr_at(i, s) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    with pytest.raises(ConfigError):
        LRSchedule(lr=1.0, warmup_steps=5, total_steps=4)


def test_clip_coefficient() -> None:
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert clip_coefficient(16.0, 1.0) == pytest.approx(0.25)


def test_shard_params_balanced_and_deterministic() -> None:
    rng = random.Random(0)
    sizes = {f"p{i}": rng.randint(1, 10_000) * 4 for i in range(200)}
    hosts = ["h2", "h0", "h1"]
    a = shard_params(sizes, hosts)
    shuffled = dict(rng.sample(list(sizes.items()), len(sizes)))
    b = shard_params(shuffled, list(reversed(hosts)))
    assert a == b
    assert set(a) == set(sizes) and set(a.values()) == set(hosts)
    loads = shard_loads(a, sizes)
    lower = max(sum(sizes.values()) / len(hosts), max(sizes.values()))
    assert max(loads.values()) <= 4 / 3 * lower
    assert max(loads.values()) - min(loads.values()) <= max(sizes.values())


def test_shard_params_edge_cases() -> None:
    assert shard_params({"a": 8, "b": 4}, ["x", "x"]) == {"a": "x", "b": "x"}
    assert shard_params({"a": 8, "b": 4, "c": 4}, ["x", "y"]) == {"a": "x", "b": "y", "c": "y"}
    with pytest.raises(ConfigError):
        shard_params({"a": 1}, [])
