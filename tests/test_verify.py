"""The verify package without a network: commitments bind, the check selector is unpredictable
without the driver's secret, an honest recompute never mismatches on CPU while a 1% lie always does,
robust aggregation bounds a liar, and the catch statistics follow from the rate."""

from __future__ import annotations

import itertools
import json
import math
import os

import msgpack
import pytest
import torch

from fusionnode.graph.portable import describe_stage
from fusionnode.graph.trace import trace_model
from fusionnode.models import build_model
from fusionnode.runtime.stage import StageModule, StageRunner
from fusionnode.train.checks import CHECK_NICE, CheckProcess, can_lift, idle_priority
from fusionnode.verify.audit import (
    AuditJob,
    join_payloads,
    judge_audit,
    pack_tensors,
    portable,
    split_payloads,
    unpack_tensors,
)
from fusionnode.verify.commitment import digest_encoded, digest_tensors
from fusionnode.verify.compare import CPU_REL_TOL, compare_loss, compare_tensor, relative_error
from fusionnode.verify.ledger import Ledger
from fusionnode.verify.liar import Liar
from fusionnode.verify.policy import DEFAULT_PUBLIC_GRAD_RATE, DEFAULT_PUBLIC_RATE, resolve_policy
from fusionnode.verify.score import (
    judge_contributions,
    median_clipped_mean,
    robust_aggregate,
    score_contributions,
    trimmed_mean,
    weights_from_scores,
)
from fusionnode.verify.selector import (
    CheckSelector,
    catch_probability,
    check_reveal,
    miss_probability,
    steps_to_catch,
)
from fusionnode.verify.verifier import chain_disputes, check_micro_batch
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import encode_tensor, pack_encoded, unpack_encoded

T = 32  # tokens per sample
V = 256  # gpt2-tiny vocabulary


# ---- commitments ---------------------------------------------------------------------------------
def enc(tensors):
    return {n: encode_tensor(t, "raw") for n, t in tensors.items()}


def test_the_digest_is_the_same_on_both_ends_of_a_link_and_binds_every_element():
    torch.manual_seed(0)
    x = {"h": torch.randn(2, 8, 16), "pos": torch.arange(8)}
    sent = enc(x)
    received = {n: unpack_encoded(pack_encoded(e)) for n, e in sent.items()}  # through the wire format
    d = digest_encoded(sent)
    assert digest_encoded(received) == d
    assert digest_tensors(x) == d  # the same for plain tensors
    odd = {"b": torch.tensor([True, False]), "bf": torch.randn(3).bfloat16(), "t": torch.randn(3, 4).t()}
    assert digest_tensors(odd) == digest_encoded(enc(odd))  # hashed in place or encoded: the same
    for i in range(0, x["h"].numel(), 97):  # any single element changed by one ulp changes it
        y = x["h"].clone().view(-1)
        y[i] = torch.nextafter(y[i], torch.tensor(float("inf")))
        assert digest_tensors({"h": y.view_as(x["h"]), "pos": x["pos"]}) != d
    assert digest_tensors({"h2": x["h"], "pos": x["pos"]}) != d  # the name
    assert digest_tensors({"h": x["h"].double(), "pos": x["pos"]}) != d  # the dtype
    assert digest_tensors({"h": x["h"].reshape(4, 4, 16), "pos": x["pos"]}) != d  # the shape
    assert digest_tensors({"h": x["h"]}) != d  # a tensor left out


def test_the_ledger_reports_one_commitment_per_part_and_micro_batch():
    led = Ledger(step=3, micro_batches=2, params_digest="p")
    m = TensorMessage("act", {}, enc({"h": torch.ones(2, 2)}))
    d = led.record(1, "out", m)
    assert led.commitments() == {"params": "p", "mbs": [{}, {"out": d}], "device": "cpu", "autocast": False}
    assert led.parts(1) == ["out"] and led.parts(0) == []
    with pytest.raises(ValueError):
        led.record(0, "bogus", m)


def test_an_audit_packs_into_chunks_within_the_wire_limits_and_unpacks_exactly(monkeypatch):
    from fusionnode.verify import ledger as L

    monkeypatch.setattr(L, "AUDIT_MAX_TENSORS", 3)
    led = Ledger(step=0, micro_batches=2, params_digest="p")
    for mb in range(2):
        for part in ("in", "out"):
            led.record(
                mb, part, TensorMessage("act", {}, enc({"a": torch.full((2,), mb), "b": torch.ones(3)}))
            )
    grads = enc({"w": torch.zeros(4)})
    chunks = L.pack_audit(led, [0, 1], grads)
    assert [len(c) for c in chunks] == [3, 3, 3]
    got = L.unpack_audit(chunks)
    assert set(got) == {(0, "in"), (0, "out"), (1, "in"), (1, "out"), (-1, "grads")}
    assert digest_encoded(got[(1, "out")]) == led.digests[(1, "out")]
    with pytest.raises(ValueError):
        L.unpack_audit([{"0/bogus/a": grads["w"]}])
    with pytest.raises(ValueError):
        L.unpack_audit([{"x/in/a": grads["w"]}])


# ---- the check selector --------------------------------------------------------------------------
def test_choices_are_fixed_by_the_secret_and_revealed_verifiably():
    a = CheckSelector(b"\x01" * 32)
    again = CheckSelector(b"\x01" * 32)
    assert [a.chosen(s, 2, 8, 0.25) for s in range(50)] == [again.chosen(s, 2, 8, 0.25) for s in range(50)]
    assert check_reveal(a.commitment, a.reveal())
    assert not check_reveal(a.commitment, (b"\x02" * 32).hex())
    assert not check_reveal(a.commitment, "not hex")
    assert a.chosen(0, 0, 8, 0.0) == [] and a.chosen(0, 0, 8, 1.0) == list(range(8))


def test_without_the_secret_the_choices_are_unpredictable():
    """A worker that knows the rate and every earlier choice (of another secret, or of other micro-
    batches) predicts no better than chance: agreement between two secrets' choices is what two
    independent coins give, and the rate is what was asked."""
    rate, n = 0.25, 20_000
    sel = [CheckSelector(bytes([i]) * 32) for i in range(2)]
    draws = [[s.draw(step, 1, mb) < rate for step in range(n // 4) for mb in range(4)] for s in sel]
    for d in draws:
        assert abs(sum(d) / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    agree = sum(x == y for x, y in zip(*draws, strict=True)) / n
    expected = rate**2 + (1 - rate) ** 2
    assert abs(agree - expected) < 4 * math.sqrt(expected * (1 - expected) / n)
    # knowing micro-batch 0 was checked says nothing about micro-batch 1 of the same step
    d0 = draws[0]
    after_checked = [d0[i + 1] for i in range(0, n, 4) if d0[i]]
    assert abs(sum(after_checked) / len(after_checked) - rate) < 4 * math.sqrt(
        rate * (1 - rate) / len(after_checked)
    )


def test_catch_statistics_follow_from_the_rate():
    assert catch_probability(0.25, 0) == 0.0
    assert catch_probability(0.25, 17) > 0.99 > catch_probability(0.25, 16)
    # the default rates, from the target (verify/policy.py): a quarter of 4 micro-batches lied on,
    # gradient checks (all 4 micro-batches) and spot-checks together: within 20 steps with
    # probability > 0.999 (the closed form against the sum over the lied micro-batches); a liar in
    # its pushed gradients only, or on every micro-batch: > 0.99999
    miss_step = sum(
        math.comb(4, k)
        * 0.25**k
        * 0.75 ** (4 - k)
        * (1 if k == 0 else (1 - DEFAULT_PUBLIC_GRAD_RATE) * (1 - DEFAULT_PUBLIC_RATE) ** k)
        for k in range(5)
    )
    fraction = miss_probability(DEFAULT_PUBLIC_RATE, DEFAULT_PUBLIC_GRAD_RATE, 4, 0.25, 20)
    assert abs(fraction - miss_step**20) < 1e-12 and fraction < 1e-3
    assert catch_probability(DEFAULT_PUBLIC_GRAD_RATE, 20) > 0.99999
    assert miss_probability(DEFAULT_PUBLIC_RATE, DEFAULT_PUBLIC_GRAD_RATE, 4, 1.0, 20) < 1e-5
    # the rates before were no better at the binding cases (the gradient liar 8e-4)
    assert fraction < (1 - 0.3) ** 20
    assert steps_to_catch(0.25, 4, 1.0) == 5
    assert steps_to_catch(0.0, 4, 1.0) == math.inf
    n = steps_to_catch(0.25, 2, 0.5)
    assert 1 - (1 - 0.125) ** (2 * n) >= 0.99 > 1 - (1 - 0.125) ** (2 * (n - 1))


def test_policy_defaults_public_on_private_off_and_refuses_nonsense():
    assert resolve_policy(None, None, private=False).to_dict() == {
        "policy": "sample",
        "rate": 0.0,
        "grad_rate": 0.45,
    }
    assert resolve_policy(None, None, private=False).on  # gradient checks alone: on
    assert resolve_policy("sample", 0.25, private=False).grad_rate == 0.25  # an explicit rate: both
    assert resolve_policy("sample", 0.2, private=True, grad_rate=0.3).grad_rate == 0.3
    with pytest.raises(ValueError):
        resolve_policy("sample", None, private=False, grad_rate=1.5)
    assert not resolve_policy("auto", None, private=True).on
    assert resolve_policy("sample", None, private=True).rate == 0.05
    assert resolve_policy("sample", 0.5, private=True).rate == 0.5
    assert resolve_policy("all", None, private=False).rate == 1.0
    for bad in [("sometimes", None), ("sample", 1.5), ("sample", float("nan"))]:
        with pytest.raises(ValueError):
            resolve_policy(*bad, private=False)


# ---- recompute and compare on a real model split into stages ----------------------------------------
@pytest.fixture(scope="module")
def stages():
    torch.manual_seed(0)
    model = build_model("gpt2-tiny")
    traced = trace_model(model, torch.zeros(1, T, dtype=torch.long), "gpt2-tiny")
    names = traced.node_names
    bounds = [
        0,
        names.index("transformer_h_1_ln_1"),
        names.index("transformer_h_3_ln_1"),
        traced.graph.num_nodes,
    ]
    state = model.state_dict()
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        desc = msgpack.unpackb(msgpack.packb(describe_stage(traced, lo, hi)))
        params = {n: state[n].detach().clone() for n in [*desc["params"], *desc["buffers"]]}
        a = {
            "stage": i,
            "pos": i,
            "num_stages": len(bounds) - 1,
            "replica": 0,
            "peer": f"peer{i}xxxxxxxxxx",
            "description": desc,
            "send_specs": {} if i == len(bounds) - 2 else {n: {} for n in desc["outputs"]},
        }
        out.append((a, params))
    return out


def honest_run(stages, batches, lie=None):
    """The workers' side: StageRunner (the runtime's own remote autodiff, 1 thread), GPipe order;
    returns each stage's ledger parts per micro-batch and the losses. `lie(stage, mb, sent)` may
    change what a stage sends."""
    torch.set_num_threads(1)
    runners = [StageRunner(StageModule.from_description(a["description"], dict(p)), 8) for a, p in stages]
    m = len(batches)
    parts = [[{} for _ in range(m)] for _ in stages]
    losses = []
    for mb, (x, y) in enumerate(batches):
        acts = {"input_ids": x}
        for i, r in enumerate(runners[:-1]):
            parts[i][mb]["in"] = acts
            acts = r.forward(mb, {k: v.clone() for k, v in acts.items()})
            if lie is not None:
                acts = lie(i, mb, acts)
            parts[i][mb]["out"] = acts
        parts[-1][mb]["in"] = acts
        parts[-1][mb]["target"] = {"target": y}
        losses.append(
            runners[-1].forward_loss(mb, {k: v.clone() for k, v in acts.items()}, y, loss_scale=1 / m)
        )
    for mb in range(m):
        grads = runners[-1].backward_loss(mb)
        if lie is not None:
            grads = lie(len(runners) - 1, mb, grads)
        parts[-1][mb]["gout"] = grads
        for i in reversed(range(len(runners) - 1)):
            parts[i][mb]["gin"] = grads
            grads = runners[i].backward(mb, {k: v.clone() for k, v in grads.items()})
            if i > 0:
                parts[i][mb]["gout"] = grads
    return parts, losses


def batches(seed, m=4, rows=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g))
        for _ in range(m)
    ]


def check_all(stages, parts, losses, m, threads):
    torch.set_num_threads(threads)
    try:
        found = []
        for i, (a, params) in enumerate(stages):
            module = StageModule.from_description(a["description"], dict(params))
            for mb in range(m):
                loss = losses[mb] if i == len(stages) - 1 else None
                found.append(check_micro_batch(module, a, parts[i][mb], m, loss, CPU_REL_TOL))
        return found
    finally:
        torch.set_num_threads(1)


def test_an_honest_recompute_never_mismatches_on_cpu(stages):
    """0 false positives: every micro-batch of every stage of several batches, the verifier on
    another thread count than the worker (summation order may differ)."""
    worst = 0.0
    for seed in range(3):
        parts, losses = honest_run(stages, batches(seed))
        for found in check_all(stages, parts, losses, 4, threads=2):
            assert found == []
        # and how far from the tolerance: the honest error is orders of magnitude below it
        a, params = stages[1]
        from fusionnode.verify.recompute import recompute

        res = recompute(
            StageModule.from_description(a["description"], dict(params)),
            inputs=parts[1][0]["in"],
            send_names=list(a["send_specs"]),
            is_last=False,
            is_first=False,
            micro_batches=4,
            output_grads=parts[1][0]["gin"],
        )
        for n, t in res.outputs.items():
            worst = max(worst, relative_error(parts[1][0]["out"][n], t))
    assert worst < CPU_REL_TOL / 100


@pytest.mark.parametrize(
    "kind,stage",
    [("scale", 0), ("scale", 1), ("scale", 2), ("noise", 1), ("stale", 1), ("other", 1)],
)
def test_each_kind_of_lie_mismatches(stages, kind, stage):
    """Every kind of lie (1% scaling, 1% noise, a previous step's tensors, another micro-batch's) on
    activations (first and middle stage) or on gradients (last stage) mismatches."""
    liar = Liar(kind=kind, factor=1.01, sigma=0.01, stage=stage)
    m = 4
    parts, losses = honest_run(stages, batches(0, m))  # step 0: what "stale" replays
    for mb in range(m):
        liar.tamper(
            "act" if stage < 2 else "grad",
            stage,
            0,
            mb,
            stage == 2,
            parts[stage][mb]["out" if stage < 2 else "gout"],
        )

    def lie(i, mb, sent):
        return liar.tamper("act" if i < 2 else "grad", i, 1, mb, i == 2, sent)

    parts, losses = honest_run(stages, batches(1, m), lie)
    found = check_all(stages, parts, losses, m, threads=1)
    for i in range(len(stages)):
        for mb in range(m):
            lied = i == stage and (kind != "other" or mb > 0)  # "other" has no micro-batch before 0
            assert bool(found[i * m + mb]) == lied, (i, mb, found[i * m + mb])


def test_the_comparator_checks_shape_dtype_integers_and_loss():
    x = torch.randn(3, 4)
    assert compare_tensor("x", x, x.clone(), CPU_REL_TOL) is None
    assert compare_tensor("x", x * 1.01, x, CPU_REL_TOL) is not None
    assert compare_tensor("x", x[:2], x, CPU_REL_TOL) is not None
    assert compare_tensor("x", x.double(), x, CPU_REL_TOL) is not None
    assert compare_tensor("x", torch.full_like(x, float("nan")), x, CPU_REL_TOL) is not None
    i = torch.arange(5)
    assert compare_tensor("i", i, i.clone(), 1.0) is None
    assert compare_tensor("i", i + (i == 3), i, 1.0) is not None
    assert compare_loss(2.0, 2.0, CPU_REL_TOL) is None and compare_loss(2.02, 2.0, CPU_REL_TOL) is not None


def test_the_liar_lies_on_the_fraction_asked_and_reads_its_file(tmp_path):
    liar = Liar(kind="scale", factor=2.0, fraction=0.3, seed=1)
    x = {"h": torch.ones(2)}
    lied = sum(liar.tamper("act", 0, s, 0, False, x)["h"][0].item() == 2.0 for s in range(2000))
    assert abs(lied / 2000 - 0.3) < 0.05 and liar.lied == lied
    assert Liar.read(tmp_path) is None
    (tmp_path / "debug_lie").write_text(json.dumps({"kind": "noise", "sigma": 0.1, "fraction": 0.5}))
    assert Liar.read(tmp_path).kind == "noise"
    for bad in [{"kind": "bribe"}, {"kind": "scale", "fraction": 0}, {"kind": "scale", "colour": 1}]:
        with pytest.raises((ValueError, TypeError)):
            Liar.from_dict(bad)
    g = torch.randn(10)
    r = Liar(kind="random_pseudo_gradient").pseudo_gradient(g)
    assert torch.isclose(r.norm(), g.norm()) and not torch.allclose(r, g)


# ---- the commitments' cross-check --------------------------------------------------------------
def test_neighbours_that_disagree_on_a_link_are_a_dispute_and_missing_commitments_are_caught():
    sa = [{"stage": i, "pos": i, "num_stages": 2, "replica": 0, "peer": f"p{i}"} for i in range(2)]
    good = [
        {"params": "x", "mbs": [{"in": "i0", "out": "a0", "gin": "g0"}]},
        {"params": "y", "mbs": [{"in": "a0", "target": "t0", "gout": "g0"}]},
    ]
    fed = {(0, 0, "in"): "i0", (1, 0, "target"): "t0"}
    assert chain_disputes(sa, good, fed, lambda a: 1) == ({}, [])
    bad = json.loads(json.dumps(good))
    bad[1]["mbs"][0]["in"] = "zz"
    assert chain_disputes(sa, bad, fed, lambda a: 1)[1] == [(0, 1, 0, "activations")]
    bad[1]["mbs"][0]["gout"] = "zz"
    assert len(chain_disputes(sa, bad, fed, lambda a: 1)[1]) == 2
    assert chain_disputes(sa, good, {**fed, (0, 0, "in"): "other"}, lambda a: 1)[1] == [(0, -1, 0, "input")]
    caught, _ = chain_disputes(sa, [good[0], None], fed, lambda a: 1)
    assert list(caught) == ["p1"]
    caught, _ = chain_disputes(sa, good, fed, lambda a: 2)  # too few micro-batches committed
    assert sorted(caught) == ["p0", "p1"]


# ---- scoring data-parallel contributions ---------------------------------------------------------
def quadratic_problem(seed=0, n=5, d=50):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(d, generator=g)
    params = {"w": torch.zeros(d)}
    true_grad = params["w"] - target  # gradient of 0.5 ||w - target||^2
    honest = [{"w": true_grad + 0.3 * torch.randn(d, generator=g)} for _ in range(n)]
    return target, params, honest


def test_trimmed_mean_and_median_clipping_bound_a_scaled_liar():
    _target, _params, honest = quadratic_problem()
    mean = {"w": torch.stack([c["w"] for c in honest]).mean(0)}
    liar = {"w": honest[0]["w"] * 1000}
    for agg in (trimmed_mean([*honest, liar], 0.2), median_clipped_mean([*honest, liar], 2.0)):
        assert (agg["w"] - mean["w"]).norm() < 0.5 * mean["w"].norm()
    naive = {"w": torch.stack([c["w"] for c in [*honest, liar]]).mean(0)}
    assert (naive["w"] - mean["w"]).norm() > 100 * mean["w"].norm()
    # exact math on a small case: [1, 2, 3, 4, 100] trimmed by one each side -> mean of 2, 3, 4
    xs = [{"v": torch.tensor([float(v)])} for v in (1, 2, 3, 4, 100)]
    assert trimmed_mean(xs, 0.2)["v"].item() == pytest.approx(3.0)
    # norms 1, 2, 3, 4, 100: median 3, clip at 6 -> (1 + 2 + 3 + 4 + 6) / 5
    assert median_clipped_mean(xs, 2.0)["v"].item() == pytest.approx(16 / 5)
    assert robust_aggregate(xs, "median_clip", weights=[1, 1, 1, 1, 0])["v"].item() == pytest.approx(2.5)
    with pytest.raises(ValueError):
        robust_aggregate(xs, "mean")


def test_scores_drop_a_random_pseudo_gradient_and_keep_honest_ones():
    target, params, honest = quadratic_problem()

    def loss(p):
        return float(0.5 * (p["w"] - target).pow(2).sum())

    rnd = Liar(kind="random_pseudo_gradient", seed=3)
    contribs = [*honest, {"w": rnd.pseudo_gradient(honest[0]["w"])}, {"w": -honest[1]["w"]}]
    scores = score_contributions(loss, params, contribs, step_size=0.1)
    weights = weights_from_scores(scores)
    assert weights == [1.0] * len(honest) + [0.0, 0.0]
    agg = robust_aggregate(contribs, "median_clip", weights=weights)
    assert loss({"w": params["w"] - agg["w"]}) < loss(params)
    assert weights_from_scores([float("nan"), 1.0]) == [0.0, 1.0]
    j = judge_contributions(loss, params, contribs, step_size=0.1)
    assert j.weights == weights and torch.equal(j.aggregate["w"], agg["w"])
    # as pseudo-gradients (parameter change before - after, step size 1) the verdict is the same
    j1 = judge_contributions(loss, params, [{"w": 0.1 * c["w"]} for c in contribs], step_size=1.0)
    assert j1.weights == weights


def test_a_worker_claiming_a_gpu_its_record_does_not_name_is_compared_at_the_cpu_tolerance():
    from fusionnode.verify.compare import CUDA_BF16_REL_TOL
    from fusionnode.verify.policy import VerifyPolicy
    from fusionnode.verify.verifier import Verifier

    v = Verifier(None, "job", VerifyPolicy("sample", 0.25), timeout_s=1.0, build_stage=None)
    v.device_kinds = {"gpu-peer": "cuda", "cpu-peer": "cpu"}
    claim = {"device": "cuda", "autocast": True}
    assert v.tolerance("gpu-peer", claim) == CUDA_BF16_REL_TOL
    assert v.tolerance("cpu-peer", claim) == CPU_REL_TOL
    assert v.tolerance("unknown-peer", claim) == CPU_REL_TOL
    assert v.tolerance("cpu-peer", {"device": "cpu"}) == CPU_REL_TOL


def test_the_job_policy_follows_the_swarm_and_checks_lossy_links_but_not_error_feedback(monkeypatch):
    from types import SimpleNamespace

    from fusionnode.errors import ConfigError
    from fusionnode.security.keys import SWARM_KEY_ENV
    from fusionnode.train.checks import job_policy
    from fusionnode.train.spec import JobSpec

    monkeypatch.delenv(SWARM_KEY_ENV, raising=False)
    public = SimpleNamespace(swarm_key_file=None, listen=("/ip4/0.0.0.0/tcp/0",))
    private = SimpleNamespace(swarm_key_file="/k", listen=("/ip4/0.0.0.0/tcp/0",))
    local = SimpleNamespace(swarm_key_file=None, listen=("/ip4/127.0.0.1/tcp/0",))
    dense, lossy = JobSpec(model="gpt2-tiny"), JobSpec(model="gpt2-tiny", compress="adatopk")
    assert job_policy({}, public, dense) == (resolve_policy("sample", None, private=False), None)
    assert not job_policy({}, private, dense)[0].on
    assert not job_policy({}, local, dense)[0].on  # loopback only: this machine's own processes
    assert job_policy({"verify_policy": "sample"}, local, dense)[0].rate == 0.05  # still on request
    monkeypatch.setenv(SWARM_KEY_ENV, "/k")
    assert not job_policy({}, public, dense)[0].on  # the key from the environment: private too
    monkeypatch.delenv(SWARM_KEY_ENV)
    # lossy links are checked within their codec's bounds (verify/lossy.py)
    assert job_policy({}, public, lossy) == (resolve_policy("sample", None, private=False), None)
    assert job_policy({"verify_policy": "all"}, public, lossy)[0].on
    feedback = {"link_options": {"error_feedback": True}}  # not reproducible by a recompute
    policy, why = job_policy(feedback, public, lossy)
    assert not policy.on and "error feedback" in why
    with pytest.raises(ConfigError, match="error feedback"):
        job_policy({**feedback, "verify_policy": "all"}, public, lossy)
    with pytest.raises(ConfigError):
        job_policy({"verify_policy": "sample", "verify_rate": 2.0}, public, dense)


# ---- an audit judged off the driver's process (verify/audit.py, train/checks.py) -----------------


def test_packed_tensors_travel_as_one_buffer_and_come_back_exactly():
    tensors = {
        "w": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(4).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
        "strided": torch.randn(6, 4).t(),  # not contiguous
    }
    buf, _index = packed = pack_tensors(tensors)
    assert buf.dtype == torch.uint8 and buf.dim() == 1  # one storage: one shared segment
    back = unpack_tensors(packed)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)
    assert back["w"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # views, no copy


def _audit(a, parts_of_mbs, mbs, losses, m, step=3):
    """An audit as a worker answers it (raw-encoded kept messages) and its report's commitments."""
    commit = {"mbs": [{} for _ in range(m)]}
    chunk = {}
    for mb, parts in parts_of_mbs.items():
        for part, tensors in parts.items():
            encoded = {n: encode_tensor(t.detach().contiguous(), "raw") for n, t in tensors.items()}
            commit["mbs"][mb][part] = digest_encoded(encoded)
            chunk.update({f"{mb}/{part}/{n}": e for n, e in encoded.items()})
    listed = {str(mb): sorted(parts_of_mbs[mb]) for mb in mbs}
    a = {**a, "param_specs": {}, "frozen": [], "offload": None}
    return AuditJob(
        a, commit, listed, portable([chunk]), a["peer"], mbs, False, None, losses, m, CPU_REL_TOL, step
    )


def test_an_audit_is_judged_against_its_commitments_then_recomputed(stages):
    m = 4
    parts, losses = honest_run(stages, batches(5, m))
    a, params = stages[1]
    mbs = [0, 2]

    def module_for(a, mine):
        return StageModule.from_description(a["description"], dict(mine))

    honest = _audit(a, {mb: parts[1][mb] for mb in mbs}, mbs, losses, m)
    assert judge_audit(honest, params, module_for) == ""
    # a shown tensor other than the one committed to
    swapped = _audit(a, {mb: parts[1][mb] for mb in mbs}, mbs, losses, m)
    key = next(k for k in swapped.chunks[0] if k.startswith("2/out/"))
    other = _audit(a, {mb: parts[1][mb] for mb in [0]}, [0], losses, m)
    swapped.chunks[0][key] = other.chunks[0][key.replace("2/", "0/", 1)]
    assert "other than it committed to" in judge_audit(swapped, params, module_for)
    # a lie committed to (the worker hashed what it sent): the recompute finds it
    lied = {mb: dict(parts[1][mb]) for mb in mbs}
    lied[2]["out"] = {n: t * 1.01 for n, t in lied[2]["out"].items()}
    why = judge_audit(_audit(a, lied, mbs, losses, m), params, module_for)
    assert "failed a spot-check at step 3, micro-batch 2" in why


def test_an_audit_whose_payloads_cross_in_the_parameters_buffer_is_judged_the_same(stages):
    """The verifier hands the check process the audit's payloads inside the shared buffer that carries
    the parameters (audit.split_payloads / join_payloads): honest passes, a swapped shown tensor and
    a lie are refused as when the payloads travel as bytes."""
    import asyncio

    m = 4
    parts, losses = honest_run(stages, batches(7, m))
    a, params = stages[1]
    lied = {1: {**parts[1][1], "out": {n: t * 1.01 for n, t in parts[1][1]["out"].items()}}}
    swapped = _audit(a, {mb: parts[1][mb] for mb in (1, 2)}, [1, 2], losses, m)
    key = next(k for k in swapped.chunks[0] if k.startswith("2/out/"))
    swapped.chunks[0][key] = swapped.chunks[0][key.replace("2/", "1/", 1)]
    proc = CheckProcess("job-payloads-test")

    async def judged(audit):
        light, payloads = split_payloads([{k: e for k, e in c.items()} for c in audit.chunks])
        assert all(e.data == b"" for c in light for e in c.values())
        audit.chunks = light
        return await proc(audit, proc.pack({**params, **payloads}))

    async def go():
        return [
            await judged(x)
            for x in (_audit(a, {1: parts[1][1]}, [1], losses, m), _audit(a, lied, [1], losses, m), swapped)
        ]

    honest, caught, refused = asyncio.run(go())
    assert honest == "" and "micro-batch 1" in caught and "other than it committed to" in refused
    # in this process: the joined payloads are views of the unpacked buffer, the parameters apart
    audit = _audit(a, {1: parts[1][1]}, [1], losses, m)
    light, payloads = split_payloads(audit.chunks)
    chunks, mine = join_payloads(light, unpack_tensors(pack_tensors({**params, **payloads})))
    assert set(mine) == set(params) and chunks[0].keys() == audit.chunks[0].keys()
    assert all(bytes(chunks[0][k].data) == bytes(e.data) for k, e in audit.chunks[0].items())


def test_the_check_process_judges_at_idle_priority_and_is_lifted_while_waited_for(stages):
    """The daemon's check process (spawned): an honest audit passes and a lie is caught there; it
    runs under SCHED_IDLE (only on cores nothing else wants) and `urgent` lifts it while a step
    waits for it."""
    import asyncio

    m = 4
    parts, losses = honest_run(stages, batches(6, m))
    a, params = stages[1]
    lied = {1: {**parts[1][1], "out": {n: t * 1.01 for n, t in parts[1][1]["out"].items()}}}
    proc = CheckProcess("job-audit-test")

    async def go():
        honest = await proc(_audit(a, {1: parts[1][1]}, [1], losses, m), pack_tensors(params))
        caught = await proc(_audit(a, lied, [1], losses, m), pack_tensors(params))
        return honest, caught

    honest, caught = asyncio.run(go())
    assert honest == "" and "micro-batch 1" in caught
    pid = CheckProcess._pid
    assert pid is not None and pid != os.getpid()
    if hasattr(os, "SCHED_IDLE") and can_lift():
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        with proc.urgent():
            lifted = os.sched_getscheduler(pid)
        assert lifted in (os.SCHED_OTHER, os.SCHED_IDLE)  # SCHED_IDLE: the OS refused (no RLIMIT_NICE)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE


def test_sched_idle_only_where_the_check_process_can_be_lifted_from_it():
    """SCHED_IDLE only for root or an RLIMIT_NICE of 20 (what lifting it back to SCHED_OTHER needs);
    otherwise nice CHECK_NICE, so a step never waits on a process it cannot lift."""
    import resource
    import subprocess
    import sys

    assert can_lift(euid=0, nice_limit=0)
    assert can_lift(euid=1000, nice_limit=20)
    assert can_lift(euid=1000, nice_limit=resource.RLIM_INFINITY)
    assert not can_lift(euid=1000, nice_limit=0)
    assert not can_lift(euid=1000, nice_limit=19)
    if not hasattr(os, "SCHED_IDLE"):
        return
    for liftable, want in ((False, f"nice {CHECK_NICE}"), (True, "idle")):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert idle_priority(child.pid, liftable=liftable) == want
            policy = os.sched_getscheduler(child.pid)
            assert policy == (os.SCHED_IDLE if liftable else os.SCHED_OTHER)
            if not liftable:
                assert os.getpriority(os.PRIO_PROCESS, child.pid) == CHECK_NICE
        finally:
            child.kill()
            child.wait()
