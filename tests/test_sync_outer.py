"""Outer optimizers of the low-communication sync modes and their settings: exact math by hand."""

from __future__ import annotations

import pytest
import torch

from fusionnode.errors import ConfigError
from fusionnode.optim.outer import AveragedOuter, NesterovOuter, make_outer, weighted_mean
from fusionnode.sync import SyncConfig, state_copies


def test_nesterov_hand_computed() -> None:
    # lr 0.5, momentum 0.9: round 1 buf = d1 = 2, u = 0.5 (2 + 0.9*2) = 1.9
    # round 2 d2 = -1: buf = 0.9*2 - 1 = 0.8, u = 0.5 (-1 + 0.9*0.8) = -0.14
    opt = NesterovOuter(0.5, 0.9)
    u1 = opt.update({"w": torch.tensor([2.0])})
    assert torch.allclose(u1["w"], torch.tensor([1.9]))
    u2 = opt.update({"w": torch.tensor([-1.0])})
    assert torch.allclose(u2["w"], torch.tensor([-0.14]))
    assert opt.rounds == 2


def test_nesterov_matches_torch_sgd() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.randn(5, generator=g)
    ref = p.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours = NesterovOuter(0.7, 0.9)
    mine = p.clone()
    for _ in range(4):
        d = torch.randn(5, generator=g)
        ref.grad = d.clone()
        sgd.step()
        mine -= ours.update({"w": d})["w"]
    assert torch.allclose(mine, ref.detach(), atol=1e-6)


def test_nesterov_state_round_trip() -> None:
    a = NesterovOuter(0.7, 0.9)
    a.update({"w": torch.tensor([1.0, 2.0])})
    b = NesterovOuter(0.1, 0.1)
    b.load_state_dict(a.state_dict())
    d = {"w": torch.tensor([0.5, -0.5])}
    assert torch.equal(a.update(d)["w"], b.update(d)["w"])


def test_averaged_step_and_token_weights() -> None:
    # replicas processed 100 and 300 tokens: mean = (100*4 + 300*0)/400 = 1; u = 2 * 1
    mean = weighted_mean([torch.tensor([4.0]), torch.tensor([0.0])], [100, 300])
    assert torch.equal(mean, torch.tensor([1.0]))
    assert torch.equal(AveragedOuter(2.0).update({"w": mean})["w"], torch.tensor([2.0]))
    with pytest.raises(ValueError):
        weighted_mean([torch.tensor([1.0])], [0])


def test_sync_config_defaults_and_rounds() -> None:
    d = SyncConfig("diloco", inner_steps=3)
    assert (d.outer_lr, d.outer_momentum, d.codec) == (0.7, 0.9, "raw")
    assert [s for s in range(8) if d.round_closes(s, 8)] == [2, 5, 7]
    s = SyncConfig("sparseloco", inner_steps=2, topk_density=0.02, chunk=100)
    assert (s.outer_lr, s.codec, s.k_per_chunk) == (1.0, "ctopk2", 2)
    assert SyncConfig.from_dict(s.to_dict()) == s
    assert isinstance(make_outer(d), NesterovOuter) and isinstance(make_outer(s), AveragedOuter)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"mode": "fedavg"}, "--sync"),
        ({"mode": "diloco", "inner_steps": 0}, "--inner-steps"),
        ({"mode": "step", "inner_steps": 5}, "--inner-steps"),
        ({"mode": "diloco", "codec": "ctopk2"}, "--sync-codec"),
        ({"mode": "sparseloco", "codec": "zip"}, "--sync-codec"),
        ({"mode": "diloco", "outer_lr": 0.0}, "--outer-lr"),
        ({"mode": "diloco", "outer_momentum": 1.0}, "--outer-momentum"),
        ({"mode": "sparseloco", "topk_density": 0.0}, "--topk-density"),
        ({"mode": "sparseloco", "chunk": 70000}, "--chunk"),
        ({"mode": "sparseloco", "ef_decay": 1.5}, "--ef-decay"),
    ],
)
def test_sync_config_refuses_bad_values(kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        SyncConfig(**kwargs)


def test_state_copies_a_worker_holds() -> None:
    assert state_copies(None, True) == 2 and state_copies(None, False) == 4
    assert state_copies(SyncConfig("diloco", inner_steps=2).to_dict(), True) == 5  # + theta_start
    assert state_copies(SyncConfig("sparseloco", inner_steps=2).to_dict(), True) == 6  # + error feedback
