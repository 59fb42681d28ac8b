"""Weighing the replicas' round contributions (issue 20, verify/contrib.py): the hosts' norm floor,
the driver's scoring on a held-out batch, and a replica sending a random pseudo-gradient."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.compress.pseudograd import encode_pseudograd
from fusionnode.errors import ConfigError
from fusionnode.optim.rounds import RoundCombiner, RoundError, update_tensors
from fusionnode.runtime.hooks import PacingHook
from fusionnode.sync import SyncConfig
from fusionnode.train.local import train_local
from fusionnode.train.replicas import train_local_replicas
from fusionnode.verify.contrib import agreement, clip_scales, conclusive, resolve_contrib_policy, verdict
from fusionnode.verify.liar import Liar

torch.set_num_threads(1)
DILOCO = SyncConfig("diloco", inner_steps=2)


# ---- the rules -----------------------------------------------------------------------------------
def test_clip_scales_bound_a_contribution_against_the_lower_median():
    assert clip_scales([1.0, 1.3, 0.9]) == [1.0, 1.0, 1.0]  # honest spread: untouched
    assert clip_scales([1.0, 1000.0]) == [1.0, 2.0 / 1000.0]  # two replicas: against the smaller one
    assert clip_scales([1.0, 1.1, 50.0], mult=3.0) == [1.0, 1.0, 3.0 * 1.1 / 50.0]
    assert clip_scales([1.0, math.nan]) == [1.0, 0.0]
    assert clip_scales([0.0, 0.0]) == [1.0, 1.0]


def test_the_verdict_drops_what_does_not_help_and_keeps_all_when_nothing_helps():
    assert verdict([0.4, 0.3]) == [1.0, 1.0]
    assert verdict([0.4, -0.002]) == [1.0, 0.0]
    assert verdict([0.4, 0.002]) == [1.0, 0.0]  # under a quarter of the best gain
    assert verdict([0.4, 0.11, math.nan]) == [1.0, 1.0, 0.0]
    assert verdict([-0.1, -0.2]) == [1.0, 1.0]  # the batch tells nothing: the floor alone
    assert verdict([0.5, 0.2], keep_ratio=0.5) == [1.0, 0.0]
    # a noisy honest gain is kept when its direction agrees with another replica's; a random one not
    assert verdict([-0.0075, 0.1019], agree=[0.45, 0.45]) == [1.0, 1.0]
    assert verdict([0.29, -0.005], agree=[0.002, 0.002]) == [1.0, 0.0]
    assert verdict([0.3, 0.28, 0.001], agree=[0.5, 0.5, 0.01]) == [1.0, 1.0, 0.0]
    # inconclusive: the honest replica's loss went up on this batch by more than the liar's gain
    assert verdict([-0.052, 0.0009], agree=[0.001, 0.001]) == [1.0, 1.0]
    assert not conclusive([-0.052, 0.0009]) and conclusive([0.1, 0.0009]) and not conclusive([-0.1, -0.2])


def test_a_zero_contribution_does_not_scale_the_others_down():
    """A liar sending zeros contributes nothing; it used to make the bound 0 and every honest replica's
    weight 0 (two replicas: [0, 1]; four: two liars)."""
    assert clip_scales([1.0, 0.0]) == [1.0, 1.0]
    assert clip_scales([1.0, 1.2, 0.0, 0.0]) == [1.0, 1.0, 1.0, 1.0]
    assert clip_scales([1.0, 0.0, 0.0, 10.0]) == [1.0, 1.0, 1.0, 0.2]  # a big one: still bounded
    assert clip_scales([math.inf, 0.0]) == [0.0, 1.0]


def test_agreement_does_not_rescue_a_clearly_harmful_gain():
    """A liar mixing ~12% of its honest delta into junk agrees a little (cos 0.058 >= 0.03) but raises
    the loss clearly: dropped. A gain within noise (over -keep_ratio x the best) is still rescued by
    weak agreement; a clearly negative one only by strong agreement (STRONG_AGREE), as an honest
    diloco pair needed in tests/test_sync_components.py (scores [-0.113, 0.034] at cosine 0.45)."""
    from fusionnode.verify.contrib import STRONG_AGREE

    assert verdict([0.3, -0.2], agree=[0.058, 0.058]) == [1.0, 0.0]
    assert verdict([0.3, -0.08], agree=[0.1, 0.1]) == [1.0, 0.0]
    assert verdict([0.3, -0.07], agree=[0.1, 0.1]) == [1.0, 1.0]  # -0.07 > -0.25 x 0.3
    assert verdict([-0.1132, 0.0342], agree=[0.4508, 0.4508]) == [1.0, 1.0]
    assert verdict([0.3, -0.2], agree=[STRONG_AGREE, STRONG_AGREE]) == [1.0, 1.0]


def test_agreement_is_the_largest_cosine_with_another_contribution():
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, -1.0])
    gram = [[float(x @ y) for y in (a, b, c)] for x in (a, b, c)]
    got = agreement(gram)
    assert got == pytest.approx([math.sqrt(0.5), math.sqrt(0.5), 0.0])
    assert agreement([[4.0]]) == [1.0]


def test_the_policy_scores_public_round_jobs_and_leaves_private_and_step_jobs_alone():
    assert resolve_contrib_policy(None, private=False, rounds=True).policy == "score"
    assert resolve_contrib_policy("auto", private=True, rounds=True).policy == "off"
    assert resolve_contrib_policy("auto", private=False, rounds=False).policy == "clip"  # --sync step
    assert resolve_contrib_policy("auto", private=True, rounds=False).policy == "off"
    p = resolve_contrib_policy("clip", private=True, rounds=True, clip=3)
    assert (p.policy, p.clip, p.score, p.host_config()) == ("clip", 3.0, False, {"clip": 3.0, "score": False})
    assert resolve_contrib_policy("off", private=False, rounds=True).host_config() is None
    for bad in (
        dict(policy="score", private=False, rounds=False),
        dict(policy="vote", private=False, rounds=True),
        dict(policy="clip", private=False, rounds=True, clip=0.5),
    ):
        with pytest.raises(ValueError):
            resolve_contrib_policy(bad.pop("policy"), **bad)


# ---- the combiner (an optimizer host's rounds) ---------------------------------------------------
def _round(cfg: SyncConfig, deltas: list[dict[str, torch.Tensor]], clip: float | None, verdict=None):
    comb = RoundCombiner(cfg, len(deltas), {"w", "b"})
    comb.clip = clip
    for r, d in enumerate(deltas):
        comb.add(0, r, 4.0, {n: encode_pseudograd(t, cfg.codec) for n, t in d.items()})
    masters = {"w": torch.zeros(6, 5), "b": torch.zeros(5)}
    update = comb.close(masters, verdict)
    return comb, update, masters


def _deltas(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    return [{k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(n)]


def test_the_floor_leaves_honest_rounds_bit_for_bit_and_bounds_a_scaled_liar():
    honest = _deltas(3)
    _, _, plain = _round(DILOCO, honest, None)
    comb, _, floored = _round(DILOCO, honest, 2.0)
    assert comb.last_weights == [4.0, 4.0, 4.0]
    assert all(torch.equal(plain[n], floored[n]) for n in plain)
    liar = [*honest[:2], {n: 1000.0 * t for n, t in honest[2].items()}]
    _, _, unguarded = _round(DILOCO, liar, None)
    comb, _, guarded = _round(DILOCO, liar, 2.0)
    assert comb.last_weights[:2] == [4.0, 4.0] and comb.last_weights[2] < 4.0 * 2.0 / 900
    step = lambda m: math.sqrt(sum(float(t.pow(2).sum()) for t in m.values()))  # noqa: E731
    assert step(unguarded) > 100 * step(plain)
    # the liar's term in the mean is at most clip x median x its weight share (w / 2w here): one more
    # honest-sized step at most, in the same direction as this liar's (a scaled honest one)
    assert step(guarded) < 2.2 * step(plain)


def test_a_verdict_leaves_a_replica_out_and_sparseloco_relays_only_the_kept():
    deltas = _deltas(3, seed=1)
    _, _, two = _round(DILOCO, deltas[:2], None)
    comb, _, judged = _round(DILOCO, [*deltas[:2], {n: -t for n, t in deltas[2].items()}], 2.0, [1, 1, 0])
    assert comb.last_weights == [4.0, 4.0, 0.0]
    assert all(torch.allclose(two[n], judged[n], atol=1e-6) for n in two)
    comb, _, nothing = _round(DILOCO, deltas, None, [0, 0, 0])  # dropping everyone: nothing applied
    assert comb.last_weights == [0.0, 0.0, 0.0] and all(float(t.abs().sum()) == 0 for t in nothing.values())
    with pytest.raises(RoundError):
        _round(DILOCO, deltas, None, [1, 2, 0])
    sparse = SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 4, chunk=16)
    big = [*deltas[:2], {n: 50.0 * t for n, t in deltas[2].items()}]
    comb, update, _ = _round(sparse, big, 2.0, [1, 0, 1])
    assert update.relayed[0][0] == 4.0 and len(update.relayed) == 2
    assert 0 < update.relayed[1][0] < 4.0 * 2.0 / 40  # the scaled-up liar, its weight scaled down
    assert set(update_tensors(update, ["w", "b"])) == {"w", "b"}  # what every receiver computes


def test_a_dropped_tiny_or_zero_contribution_never_takes_the_round():
    """The verdict drops a liar sending zeros or a tiny contribution: the floor's reference is the kept
    replicas' norms, so the honest one keeps its full weight and the liar gets none (it used to be
    given the whole round: the honest weight floored to 0, then the floor alone weighed the round)."""
    honest = _deltas(2, seed=4)
    _, _, alone = _round(DILOCO, honest[:1], 2.0)
    for lie in (0.0, 1e-3):
        liar = {n: lie * t for n, t in honest[1].items()}
        comb, _, judged = _round(DILOCO, [honest[0], liar], 2.0, [1, 0])
        assert comb.last_weights == [4.0, 0.0], lie
        assert all(torch.allclose(alone[n], judged[n], atol=1e-6) for n in alone)
    zero = {n: 0.0 * t for n, t in honest[1].items()}
    comb, _, _ = _round(DILOCO, [honest[0], zero], 2.0)  # the floor alone: zeros weigh, scale nobody
    assert comb.last_weights == [4.0, 4.0]


# ---- a 2 x 2 diloco job on an in-memory swarm (driver, workers, hosts: tests/memnet.py) -----------
def _run(
    tmp_path, sync: SyncConfig, policy: str | None, liar: dict | None, steps: int = 6, replicas: int = 2
):
    """A job of `replicas` x 2 stages; `liar`: both workers of replica 1 send random pseudo-gradients
    (under --sync step: random gradients). Returns (result, scored events, losses)."""
    spec = small_spec(steps=steps, micro_batches=2, batch_size=4 * replicas)
    s = Swarm(tmp_path, workers=2 * replicas, hosts=2)
    params = round_job(spec, sync, contrib_policy=policy, verify_policy="off", replicas=replicas)

    async def main():
        job = asyncio.ensure_future(s.driver.run_job(params, s.emit))
        while liar is not None and not job.done():
            await asyncio.sleep(0.005)
            held = {pid: sj for pid, w in s.workers.items() for sj in w.jobs.values()}
            if len(held) == 2 * replicas:  # before the first round closes (step 1's commit)
                for pid, sj in held.items():
                    if sj.replica == 1:
                        s.workers[pid].hook = PacingHook(None)
                        s.workers[pid].hook.liar = Liar(**liar)
                break
        return await job

    result = asyncio.run(main())
    scored = [e for e in s.events if e.get("kind") == "scored"]
    return result, scored, [e["loss"] for e in s.steps()]


def test_an_honest_scored_job_keeps_every_replica_and_follows_the_local_reference(tmp_path):
    """No false positive: every round scored, nobody dropped, every weight the plan's, and the losses
    those of the single-process reference (the floor and the held rounds change no bit)."""
    result, scored, losses = _run(tmp_path, DILOCO, "score", None)
    assert [e["round"] for e in scored] == [0, 1, 2]
    for e in scored:
        assert e["verdict"] == [1.0, 1.0] and all(g > 0 for g in e["scores"]), e
        assert e["weights"] == [[4.0, 4.0], [4.0, 4.0]] and "error" not in e
    assert result["contrib"] == {
        "policy": "score",
        "clip": 2.0,
        "keep_ratio": 0.25,
        "rounds_scored": 3,
        "dropped": {},
        "failed": 0,
        "judge_s": result["contrib"]["judge_s"],
    }
    assert result["contrib"]["judge_s"] > 0
    ref = train_local_replicas(small_spec(steps=6, micro_batches=2), DILOCO, replicas=2).losses
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-4


@pytest.mark.parametrize("failure", ["malformed", "slow"])
def test_a_round_whose_scoring_fails_or_overruns_closes_on_the_floor(tmp_path, monkeypatch, failure):
    """Any exception while scoring (a KeyError from a malformed reply here), or scoring past its
    budget, sends the all-kept verdict: the job runs on, every round closed on the floor alone. A
    KeyError used to escape `judge`: no verdict, the hosts held the round past the pulls' deadline."""
    from fusionnode.train import scoring

    if failure == "malformed":

        async def malformed(self, *args):
            raise KeyError("tensors")

        monkeypatch.setattr(scoring.RoundScorer, "_fetch", malformed)
    else:
        monkeypatch.setattr(scoring, "SCORE_BUDGET", 1e-4)  # of the 20 s step timeout: 2 ms
    result, scored, _ = _run(tmp_path, DILOCO, "score", None)
    assert [e["round"] for e in scored] == [0, 1, 2]
    for e in scored:
        assert e["error"].startswith("KeyError" if failure == "malformed" else "TimeoutError"), e
        assert e["weights"] == [[4.0, 4.0], [4.0, 4.0]]
    assert result["contrib"]["failed"] == 3


@pytest.mark.parametrize(
    "sync",
    [DILOCO, SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256)],
    ids=["diloco", "sparseloco"],
)
def test_a_replica_sending_random_pseudo_gradients_is_dropped_every_round(tmp_path, sync):
    result, scored, _ = _run(tmp_path, sync, "score", {"kind": "random_pseudo_gradient", "seed": 1})
    assert len(scored) == 3
    for e in scored:
        assert e["verdict"] == [1.0, 0.0] and max(e["agree"]) < 0.03, e
        assert e["scores"][0] > 0.05 and e["scores"][1] < 0.25 * e["scores"][0]
        assert all(ws[1] == 0.0 and ws[0] > 0 for ws in e["weights"])  # every host left it out
    assert result["contrib"]["dropped"] == {"1": 3}


def test_three_replicas_a_scaled_liar_is_dropped_and_the_two_honest_ones_agree(tmp_path):
    lie = {"kind": "random_pseudo_gradient", "seed": 1, "norm": 10.0}
    result, scored, _ = _run(tmp_path, DILOCO, "score", lie, replicas=3)
    assert len(scored) == 3
    for e in scored:
        assert e["verdict"] == [1.0, 0.0, 1.0], e
        assert min(e["agree"][0], e["agree"][2]) > 0.2 and e["agree"][1] < 0.03
        assert all(s[1] < 0.25 and s[0] == s[2] == 1.0 for s in e["scales"])  # the floor, on each host
    assert result["contrib"]["dropped"] == {"1": 3}


def test_without_scoring_the_liar_costs_loss_and_the_floor_bounds_a_scaled_one(tmp_path):
    lie = {"kind": "random_pseudo_gradient", "seed": 1}
    honest, _, _ = _run(tmp_path / "h", DILOCO, "off", None)
    scored, _, _ = _run(tmp_path / "s", DILOCO, "score", lie)
    unchecked, _, _ = _run(tmp_path / "u", DILOCO, "off", lie)
    assert unchecked["val_loss"] > honest["val_loss"] + 0.05  # the lie does damage unchecked
    assert abs(scored["val_loss"] - honest["val_loss"]) < 0.02
    big = {**lie, "norm": 100.0}
    clipped, _, _ = _run(tmp_path / "c", DILOCO, "clip", big)
    wild, _, _ = _run(tmp_path / "w", DILOCO, "off", big)
    assert wild["val_loss"] > honest["val_loss"] + 0.3
    assert clipped["val_loss"] < unchecked["val_loss"]  # scaled back to 2x the honest norm, then weighed


def test_the_step_floor_on_a_store_scales_a_huge_replica_and_leaves_honest_ones():
    """--sync step: the store holds the replicas' gradients apart and scales one above 2x the median."""
    from fusionnode.optim.contributions import Contributor, ExpectedContributions
    from fusionnode.optim.optimizers import OptimizerConfig
    from fusionnode.optim.store import ParameterStore

    params = {"w": torch.zeros(6, 5), "b": torch.zeros(5)}
    expected = ExpectedContributions.same_for_all(
        params, {f"r{r}/s0": Contributor(str(r), 2) for r in range(3)}
    )
    grads = _deltas(3, seed=2)
    liar = {n: 1000.0 * t for n, t in _deltas(1, seed=3)[0].items()}

    def step(gs, clip):
        store = ParameterStore("j", params, OptimizerConfig(name="sgd", lr=1.0), expected, clip=clip)
        for r, g in enumerate(gs):
            for n in params:
                assert store.push(1, f"r{r}/s0", n, g[n], 2).accepted
        assert store.apply(1).applied
        return store.get_params()[1]

    honest_plain, honest_floor = step(grads, None), step(grads, 2.0)
    assert all(torch.allclose(honest_plain[n], honest_floor[n], atol=1e-6) for n in params)
    wild, floored = step([*grads[:2], liar], None), step([*grads[:2], liar], 2.0)
    size = lambda m: math.sqrt(sum(float(t.pow(2).sum()) for t in m.values()))  # noqa: E731
    assert size(wild) > 100 * size(honest_plain)
    assert size(floored) < 2 * size(honest_plain)


def test_the_step_floor_with_a_replica_sending_zeros_keeps_the_honest_gradient():
    from fusionnode.optim.robust import floor_mean

    g = _deltas(1, seed=5)[0]
    apart = {n: {"a": (g[n], 2), "b": (torch.zeros_like(g[n]), 2)} for n in g}
    mean, _weight, scales = floor_mean(apart, 5.0)
    assert scales == {"a": 1.0, "b": 1.0}  # it used to be {"a": 0.0, ...}: a zero step
    assert all(torch.allclose(mean[n], g[n] / 2) for n in g)


def test_a_step_job_in_a_public_swarm_has_the_floor_which_bounds_a_huge_random_gradient(tmp_path):
    """--sync step, 2 x 2 on the in-memory swarm (public: auto = clip): honest losses follow the
    single-process reference; a replica pushing random gradients 1000x its norm is scaled down."""
    step = SyncConfig("step")
    honest, _, losses = _run(tmp_path / "h", step, None, None, steps=4)
    assert honest["contrib"] == {"policy": "clip", "clip": 5.0, "keep_ratio": 0.25}
    ref = train_local(small_spec(steps=4, micro_batches=2)).losses
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-4
    lie = {"kind": "random_pseudo_gradient", "seed": 2, "norm": 1000.0}
    floored, _, _ = _run(tmp_path / "c", step, "clip", lie, steps=4)
    wild, _, _ = _run(tmp_path / "w", step, "off", lie, steps=4)
    assert wild["val_loss"] > honest["val_loss"] + 0.5
    # bounded, not removed: with 2 replicas the liar keeps a random term of 5x the smaller norm
    assert floored["val_loss"] < honest["val_loss"] + 0.3 < wild["val_loss"]


def test_explicit_contribution_weighing_needs_rounds(tmp_path):
    s = Swarm(tmp_path, workers=2, hosts=1)
    params = {"spec": small_spec().to_dict(), "stages": 2, "offload": "on", "contrib_policy": "score"}
    # (clip is the floor of --sync step's gradients too; score judges rounds only)
    with pytest.raises(ConfigError, match="--contrib-policy score"):
        asyncio.run(s.driver.run_job(params, s.emit))


def test_the_cli_refuses_scoring_without_rounds():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "fusionnode", "train", "--contrib-policy", "score", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "--contrib-policy score judges round contributions" in res.stderr


def test_a_scored_round_reads_as_one_line():
    from fusionnode.messages import format_event

    ev = {"type": "event", "kind": "scored", "round": 2, "scores": [0.3, -0.01], "verdict": [1.0, 0.0]}
    assert format_event(ev) == "round 2: dropped replica(s) [1], loss gains [0.3, -0.01]"
    ev = {"type": "event", "kind": "scored", "round": 0, "verdict": [1.0, 1.0], "error": "deadline"}
    assert format_event(ev) == "round 0: every replica kept (not scored: deadline)"


@pytest.mark.parametrize("mode", ["diloco", "sparseloco"])
def test_a_verdict_dropping_every_replica_applies_nothing(mode):
    # every replica has a worker a round-end check caught: the round closes (the workers' pulls get
    # an update) but moves nothing, and the outer optimizer's state is as if the round never was
    cfg = SyncConfig(mode, inner_steps=2)
    comb, update, masters = _round(cfg, _deltas(2), 2.0, [0.0, 0.0])
    assert comb.last_weights == [0.0, 0.0] and comb.round == 1
    assert all(float(t.abs().sum()) == 0 for t in masters.values())  # used to be all kept
    moved = update_tensors(update, ["b", "w"])
    assert all(float(t.abs().sum()) == 0 for t in moved.values())
    # the next round's update is a fresh combiner's first one, bit for bit (diloco: no momentum taken)
    nxt = _deltas(2, seed=1)
    for r, d in enumerate(nxt):
        comb.add(1, r, 4.0, {n: encode_pseudograd(t, cfg.codec) for n, t in d.items()})
    comb.close(masters, [1.0, 1.0])
    _, _, fresh = _round(cfg, nxt, 2.0, [1.0, 1.0])
    assert all(torch.equal(masters[n], fresh[n]) for n in masters)
