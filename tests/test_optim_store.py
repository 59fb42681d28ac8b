"""ParameterStore: aggregation over replicas and tied weights, idempotency, rejects, deadlines."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.optim import (
    Contributor,
    ExpectedContributions,
    FlatOptimizer,
    OptimizerConfig,
    ParameterStore,
    StepNotReadyError,
    StepOrderError,
    UnknownParameterError,
)

torch.set_num_threads(1)

RTOL = 1e-6
CFG = OptimizerConfig("adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    scale = max(float(b.abs().max()), 1e-12)
    err = float((a - b).abs().max())
    assert err <= rtol * scale, f"max abs err {err:.3e} > {rtol} * {scale:.3e}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _torch_adamw(named: dict[str, nn.Parameter]) -> torch.optim.AdamW:
    decay = [p for p in named.values() if p.dim() >= 2]
    rest = [p for p in named.values() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
    )


TWO_REPLICAS = {"r0/s0": Contributor("r0", 3), "r1/s0": Contributor("r1", 5)}


def _small_store(contribs=None, **kw) -> ParameterStore:
    params = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    exp = ExpectedContributions.same_for_all(params, contribs or TWO_REPLICAS)
    return ParameterStore("job", params, CFG, exp, **kw)


def test_two_replicas_weighted_equal_one_replica_over_all_samples() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    ref = copy.deepcopy(model)
    ref_opt = _torch_adamw(dict(ref.named_parameters()))
    named = dict(model.named_parameters())
    store = ParameterStore(
        "job",
        {n: p.detach() for n, p in named.items()},
        CFG,
        ExpectedContributions.same_for_all(named, TWO_REPLICAS),
    )
    g = torch.Generator().manual_seed(1)
    for step in range(1, 21):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for key, sl, n_samples in (("r1/s0", slice(3, 8), 5), ("r0/s0", slice(0, 3), 3)):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()  # mean over its own samples
            for n, p in named.items():
                res = store.push(step, key, n, p.grad, n_samples)
                assert res.accepted
        assert res.step_complete
        result = store.apply(step)
        assert result.applied and not result.forced and dict(result.replica_samples) == {"r0": 3, "r1": 5}
        _, fresh = store.get_params()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(fresh[n])
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_rel_close(p.detach(), q.detach())


class Tied(nn.Module):
    """An embedding used at the input (stage 0) and as the output head (stage 1), like GPT-2's wte."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.randn(11, 4) * 0.5)
        self.mid = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor, wte_in: torch.Tensor, wte_out: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(wte_in[idx]))
        return h @ wte_out.t()


def test_tied_weight_contributions_from_two_stages_sum_per_replica() -> None:
    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    ref_opt = _torch_adamw(dict(ref.named_parameters()))
    replicas = {"r0": 2, "r1": 6}
    expected = {
        "wte": {f"{r}/s{s}": Contributor(r, n) for r, n in replicas.items() for s in (0, 1)},
        "mid.weight": {f"{r}/s0": Contributor(r, n) for r, n in replicas.items()},
        "mid.bias": {f"{r}/s0": Contributor(r, n) for r, n in replicas.items()},
    }
    store = ParameterStore(
        "job", {n: p.detach() for n, p in model.named_parameters()}, CFG, ExpectedContributions(expected)
    )
    g = torch.Generator().manual_seed(2)
    for step in range(1, 11):
        idx, tgt = torch.randint(0, 11, (8,), generator=g), torch.randint(0, 11, (8,), generator=g)
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ref(idx, ref.wte, ref.wte), tgt).backward()
        ref_opt.step()
        start = 0
        for r, n in replicas.items():
            sl = slice(start, start + n)
            start += n
            model.zero_grad(set_to_none=True)
            w_in = model.wte.detach().clone().requires_grad_()
            w_out = model.wte.detach().clone().requires_grad_()
            torch.nn.functional.cross_entropy(model(idx[sl], w_in, w_out), tgt[sl]).backward()
            assert store.push(step, f"{r}/s1", "wte", w_out.grad, n).accepted
            assert store.push(step, f"{r}/s0", "wte", w_in.grad, n).accepted
            assert store.push(step, f"{r}/s0", "mid.weight", model.mid.weight.grad, n).accepted
            assert store.push(step, f"{r}/s0", "mid.bias", model.mid.bias.grad, n).accepted
        assert store.apply(step).applied
        _, fresh = store.get_params()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(fresh[name])
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_rel_close(p.detach(), q.detach())


@pytest.mark.parametrize("tied", [False, True])
def test_push_does_not_mutate_callers_tensor_unless_owned(tied: bool) -> None:
    replica = (lambda key: "r0") if tied else (lambda key: key)
    store = _small_store({k: Contributor(replica(k), 2) for k in ("a", "b", "c")})
    g1, g2, g3 = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 4.0)
    store.push(1, "a", "b", g1, 2)
    store.push(1, "b", "b", g2, 2)
    store.push(1, "c", "b", g3, 2, owned=True)  # the store may keep and modify g3
    assert torch.equal(g1, torch.ones(3)) and torch.equal(g2, torch.full((3,), 2.0))
    expected = 7.0 if tied else 7.0 / 3  # tied: one replica, partial gradients add up
    assert store.pending_grad_sq_norm(1) == pytest.approx(3 * expected**2)


def test_idempotent_retry_counts_once() -> None:
    store = _small_store()
    ref = _small_store()
    gw, gb = torch.ones(2, 3), torch.full((3,), 2.0)
    for s in (store, ref):
        assert s.push(1, "r0/s0", "w", gw, 3).accepted
    dup = store.push(1, "r0/s0", "w", gw * 100, 3)  # a retry: counted once, first payload wins
    assert dup.duplicate and not dup.accepted and dup.reason is None and dup.name_complete is False
    for s in (store, ref):
        s.push(1, "r1/s0", "w", gw, 5)
        s.push(1, "r0/s0", "b", gb, 3)
        last = s.push(1, "r1/s0", "b", gb, 5)
        assert last.step_complete
        s.apply(1)
    again = store.push(1, "r1/s0", "b", gb, 5)
    assert again.reason == "rejected_stale"
    assert store.counters["duplicates"] == 1 and store.counters["pushes"] == 4
    for n, t in store.get_params()[1].items():
        assert torch.equal(t, ref.get_params()[1][n])


@pytest.mark.parametrize(
    ("grad", "reason"),
    [
        (torch.ones(1), "rejected_shape"),  # one element must not broadcast into a vector
        (torch.ones(()), "rejected_shape"),
        (torch.ones(1, 3), "rejected_shape"),
        (torch.ones(4), "rejected_shape"),
        (torch.ones(3, dtype=torch.float64), "rejected_dtype"),
        (torch.ones(3, dtype=torch.bfloat16), "rejected_dtype"),
        (torch.ones(3, dtype=torch.int64), "rejected_dtype"),
        (torch.tensor([1.0, float("nan"), 0.0]), "rejected_nonfinite"),
        (torch.tensor([1.0, float("inf"), 0.0]), "rejected_nonfinite"),
        (torch.tensor([1.0, -float("inf"), 0.0]), "rejected_nonfinite"),
    ],
)
def test_bad_gradients_rejected_and_counted(grad: torch.Tensor, reason: str) -> None:
    store = _small_store()
    res = store.push(1, "r0/s0", "b", grad, 3)
    assert not res.accepted and res.reason == reason
    assert store.counters[reason] == 1 and store.counters["pushes"] == 0
    assert store.push(1, "r0/s0", "b", torch.ones(3), 3).accepted  # a corrected retry still counts


def test_unknown_contributor_name_samples_and_steps_rejected() -> None:
    store = _small_store()
    g = torch.ones(3)
    assert store.push(1, "r9/s0", "b", g, 3).reason == "rejected_unknown"
    assert store.push(1, "r0/s0", "nope", g, 3).reason == "rejected_unknown_name"
    assert store.push(1, "r0/s0", "b", g, 4).reason == "rejected_samples"  # above the plan (3)
    assert store.push(1, "r0/s0", "b", g, 0).reason == "rejected_samples"
    assert store.push(0, "r0/s0", "b", g, 3).reason == "rejected_stale"
    assert store.push(3, "r0/s0", "b", g, 3).reason == "rejected_future"  # window: steps 1..2
    assert store.push(2, "r0/s0", "b", g, 3).accepted
    c = store.counters
    assert (c["rejected_unknown"], c["rejected_unknown_name"], c["rejected_samples"]) == (1, 1, 2)
    assert (c["rejected_stale"], c["rejected_future"], c["pushes"]) == (1, 1, 1)


def test_samples_mismatch_within_replica_rejected() -> None:
    store = _small_store({"r0/s0": Contributor("r0", 4), "r0/s1": Contributor("r0", 4)})
    assert store.push(1, "r0/s0", "b", torch.ones(3), 4).accepted
    assert store.push(1, "r0/s1", "b", torch.ones(3), 2).reason == "rejected_samples_mismatch"


def test_expected_contributions_validation() -> None:
    with pytest.raises(ConfigError):
        ExpectedContributions({"a": {}})
    with pytest.raises(ConfigError):
        ExpectedContributions({"a": {"x": Contributor("r0", 2), "y": Contributor("r0", 3)}})
    with pytest.raises(ConfigError):
        ParameterStore(
            "j", {"a": torch.ones(1)}, CFG, ExpectedContributions({"b": {"x": Contributor("r", 1)}})
        )


def test_apply_waits_then_applies_once() -> None:
    store = _small_store()
    g = torch.ones(3)
    store.push(1, "r0/s0", "b", g, 3)
    waiting = store.apply(1)
    assert not waiting.applied and waiting.missing == ("r0/s0", "r1/s0")
    assert store.missing(1) == {"w": ("r0/s0", "r1/s0"), "b": ("r1/s0",)}
    with pytest.raises(StepOrderError):
        store.apply(2)
    for key, n in (("r1/s0", 5),):
        store.push(1, key, "b", g, n)
    for key, n in (("r0/s0", 3), ("r1/s0", 5)):
        store.push(1, key, "w", torch.ones(2, 3), n)
    assert store.ready(1)
    first = store.apply(1)
    _, after_first = store.get_params()
    second = store.apply(1, lr=5.0, force=True)
    assert second is first and store.applied_step == 1 and store.counters["applied"] == 1
    _, after_second = store.get_params()
    for n in after_first:
        assert torch.equal(after_first[n], after_second[n])


def test_deadline_forces_with_what_arrived_weighted() -> None:
    clock = FakeClock()
    store = _small_store(clock=clock, step_deadline_s=10.0)
    start = {n: t.clone() for n, t in store.get_params()[1].items()}
    g_b = torch.tensor([1.0, -2.0, 3.0])
    store.push(1, "r1/s0", "b", g_b, 4)  # 4 of 5 planned samples
    clock.now += 9.9
    assert store.maybe_apply_due() == []
    assert store.next_deadline() == pytest.approx(1010.0)
    clock.now += 0.2
    assert store.maybe_apply_due() == [1]
    res = store.apply(1)
    assert res.forced and res.updated == ("b",) and res.missing == ("r0/s0", "r1/s0")
    assert dict(res.replica_samples) == {"r1": 4}
    expected = FlatOptimizer({n: t.clone() for n, t in start.items()}, CFG)
    expected.step({"b": g_b}, CFG.lr)  # only one replica arrived: its mean gradient, unscaled
    _, now = store.get_params()
    assert torch.equal(now["b"], expected.params["b"]) and torch.equal(now["w"], start["w"])
    c = store.counters
    assert c["forced"] == 1 and c["applied"] == 1


def test_deadline_weights_two_arrived_replicas_out_of_three() -> None:
    clock = FakeClock()
    contribs = {**TWO_REPLICAS, "r2/s0": Contributor("r2", 7)}
    store = _small_store(contribs, clock=clock, step_deadline_s=1.0)
    start = {n: t.clone() for n, t in store.get_params()[1].items()}
    g0, g1 = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 4.0, -1.0])
    store.push(1, "r0/s0", "b", g0, 3)
    store.push(1, "r1/s0", "b", g1, 5)
    clock.now += 1.0
    assert store.maybe_apply_due() == [1]
    expected = FlatOptimizer({n: t.clone() for n, t in start.items()}, CFG)
    expected.step({"b": (3 * g0 + 5 * g1) / 8}, CFG.lr)
    assert_rel_close(store.get_params(["b"])[1]["b"], expected.params["b"])


def test_forced_step_drops_incomplete_tied_replica() -> None:
    clock = FakeClock()
    contribs = {"r0/s0": Contributor("r0", 2), "r0/s1": Contributor("r0", 2), "r1/s0": Contributor("r1", 2)}
    store = _small_store(contribs, clock=clock, step_deadline_s=1.0)
    store.push(1, "r0/s0", "b", torch.ones(3), 2)  # r0's s1 half never comes
    store.push(1, "r1/s0", "b", torch.full((3,), 3.0), 2)
    clock.now += 2
    assert store.maybe_apply_due() == [1]
    res = store.apply(1)
    assert dict(res.replica_samples) == {"r1": 2} and store.counters["dropped_partial"] == 1


def test_empty_step_skipped_only_when_a_later_step_is_due() -> None:
    clock = FakeClock()
    store = _small_store({"a": Contributor("r0", 1)}, clock=clock, step_deadline_s=5.0)
    assert store.maybe_apply_due() == []
    clock.now += 100
    assert store.maybe_apply_due() == []  # nothing pending: the job is idle, never advance
    store.push(2, "a", "b", torch.ones(3), 1)
    store.push(2, "a", "w", torch.ones(2, 3), 1)
    assert store.maybe_apply_due() == []  # step 2 is complete, but step 1 may still come
    clock.now += 5.0
    assert store.maybe_apply_due() == [1, 2]  # step 2 is past its deadline: skip the empty step 1
    assert store.counters["empty_steps"] == 1 and store.applied_step == 2


def test_get_params_min_step_names_and_dtype() -> None:
    store = _small_store({"a": Contributor("r0", 1)})
    with pytest.raises(StepNotReadyError):
        store.get_params(min_step=1)
    with pytest.raises(UnknownParameterError):
        store.get_params(["zzz"])
    step, got = store.get_params(["w"], dtype=torch.bfloat16)
    assert step == 0 and list(got) == ["w"] and got["w"].dtype == torch.bfloat16
    got["w"].add_(1)  # a copy: the store is unaffected
    assert torch.equal(store.get_params(["w"])[1]["w"], torch.arange(6.0).reshape(2, 3))


def test_concurrent_pushes_from_threads() -> None:
    contribs = {f"r{i}/s0": Contributor(f"r{i}", 1) for i in range(4)}
    names = [f"p{i}" for i in range(50)]
    store = ParameterStore(
        "job", {n: torch.zeros(8) for n in names}, CFG, ExpectedContributions.same_for_all(names, contribs)
    )
    barrier = threading.Barrier(len(contribs))

    def worker(key: str, value: float) -> None:
        barrier.wait(timeout=10)
        for n in names:
            store.push(1, key, n, torch.full((8,), value), 1)
            store.push(1, key, n, torch.full((8,), value), 1)  # retry

    threads = [threading.Thread(target=worker, args=(k, float(i))) for i, k in enumerate(contribs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert store.ready(1)
    assert store.counters["pushes"] == 200 and store.counters["duplicates"] == 200
    assert store.pending_grad_sq_norm(1) == pytest.approx(50 * 8 * 1.5**2)


def _push_all(store: ParameterStore, step: int, scale: float) -> None:
    for key, n in (("r0/s0", 3), ("r1/s0", 5)):
        store.push(step, key, "b", torch.full((3,), scale), n)
        store.push(step, key, "w", torch.full((2, 3), -scale), n)


def test_rollback_undoes_the_kept_step_exactly() -> None:
    """A spot-checked job's hosts keep the state before each step (`keep`): rolling back the lied
    step and applying the honest one gives bit for bit what an honest run has (params and Adam)."""
    honest, lied = _small_store(), _small_store()
    for store in (honest, lied):
        _push_all(store, 1, 1.0)
        store.apply(1, keep=True)
    _push_all(honest, 2, 0.5)
    honest.apply(2, keep=True)
    _push_all(lied, 2, 40.0)  # a lie, applied before its check ended
    lied.apply(2, keep=True)
    lied.push(3, "r0/s0", "b", torch.ones(3), 3)  # the next step's pushes: dropped by the rollback
    assert lied.rollback(1) is True
    assert lied.applied_step == 1 and not lied.ready(3) and lied.counters["rolled_back"] == 1
    assert lied.rollback(1) is False  # already there: nothing undone
    with pytest.raises(StepOrderError):
        lied.rollback(0)  # one step deep only
    _push_all(lied, 2, 0.5)  # the replay, without the liar
    lied.apply(2, keep=True)
    _, want = honest.get_params()
    _, got = lied.get_params()
    assert all(torch.equal(want[n], got[n]) for n in want)
    sw, sg = honest.state_dict(), lied.state_dict()
    assert sw["steps"] == sg["steps"]
    assert all(torch.equal(sw["state"][k][n], sg["state"][k][n]) for k in sw["state"] for n in sw["state"][k])


def test_rollback_needs_a_kept_step() -> None:
    store = _small_store()
    _push_all(store, 1, 1.0)
    store.apply(1)  # not kept
    with pytest.raises(StepOrderError):
        store.rollback(0)
    assert store.applied_step == 1


def test_rollback_to_the_mark_undoes_every_step_since() -> None:
    """A liar caught late in its plan: the hosts go back to the state marked at the plan's start
    (`mark`), undoing every step since, and the replay equals an honest run exactly."""
    honest, lied = _small_store(), _small_store()
    for store, scales in ((honest, (1.0, 0.5, 0.25)), (lied, (1.0, 30.0, -7.0))):
        for step, scale in enumerate(scales, start=1):
            _push_all(store, step, scale)
            store.apply(step, keep=True, mark=step == 2)  # the plan started at step 2
    assert lied.rollback(1) is True and lied.applied_step == 1
    assert lied.counters["rolled_back"] == 2
    for step, scale in ((2, 0.5), (3, 0.25)):
        _push_all(lied, step, scale)
        lied.apply(step, keep=True)
    _, want = honest.get_params()
    _, got = lied.get_params()
    assert all(torch.equal(want[n], got[n]) for n in want)
    with pytest.raises(StepOrderError):
        lied.rollback(0)  # never marked
