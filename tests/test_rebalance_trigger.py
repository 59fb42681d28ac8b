"""The straggler trigger (issue 18): a 4x slow-down is acted on within 10 steps, for one pipeline
and for two; a clean 300-step run on noisy shared hardware (one-sided timing noise, several-step
slow spells, a peer that is slower from the start) makes no re-plan. Pure decision logic over
simulated stage timings (train/speeds.py, rebalance.check_job), the same calls the driver makes."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from fusionnode.train.rebalance import Layout, balance_shares, check_job, decide_job, stage_flops
from fusionnode.train.speeds import DEFAULT_WINDOW, RUN_HISTORY, SpeedBook, Trigger

FLOPS = [1.0] * 40
EVERY = 2  # the driver's default steps between checks with offload (driver.DEFAULT_REBALANCE_EVERY)


def simulate(
    layouts: list[Layout],
    shares: list[int],
    speeds: dict[str, float],
    *,
    steps: int,
    seed: int,
    slow: tuple[str, int, float] | None = None,
    trigger: Trigger | None = None,
) -> list[tuple[int, object]]:
    """Runs the driver's rebalance loop over simulated stage times: each step every stage's compute
    time is its work / its peer's speed x one-sided noise (a shared machine only ever delays), with
    a slow spell of 1.5-2x on a random peer for 3-7 steps now and then; `slow` = (peer, step,
    factor) slows a peer from that step on. The first step of a plan warms up (unmeasured); a check
    every EVERY measured steps. Returns (step, decision) of every act; the plan is not changed."""
    rng = random.Random(seed)
    book = SpeedBook(RUN_HISTORY, quantile=0.5, recent=DEFAULT_WINDOW)
    trigger = trigger or Trigger()
    micro = [4] * len(layouts)
    spell: dict[str, int] = {}
    factor: dict[str, float] = {}
    acts = []
    since = 0
    for step in range(steps):
        if rng.random() < 0.08:  # a slow spell on someone
            p = rng.choice(sorted(speeds))
            spell[p], factor[p] = rng.randint(3, 7), rng.uniform(1.4, 1.8)
        if step == 0:
            continue  # warm-up
        for lay, n in zip(layouts, shares, strict=True):
            for i, p in enumerate(lay.peers):
                work = stage_flops(FLOPS, lay.bounds[i], lay.bounds[i + 1]) * n
                t = work / speeds[p] * (1.0 + rng.expovariate(1 / 0.25))
                if spell.get(p, 0) > 0:
                    t *= factor[p]
                if slow is not None and p == slow[0] and step >= slow[1]:
                    t *= slow[2]
                book.record(p, work, t)
        for p in list(spell):
            spell[p] -= 1
        since += 1
        if since < EVERY:
            continue
        since = 0
        c = check_job(
            book,
            trigger,
            layouts,
            [[f * n for f in FLOPS] for n in shares],
            book.speeds(),
            micro,
            steps_left=1000,
            move_cost_s=0.0,
            shares=shares if len(layouts) > 1 else (),
        )
        if c.act:
            acts.append((step + 1, c.decision))
    return acts


ONE = [Layout(("a", "b", "c", "d"), (0, 10, 20, 30, 40))]
TWO = [Layout(("a", "b"), (0, 20, 40)), Layout(("c", "d"), (0, 20, 40))]
# "a" is the driver's own peer: it does the driver's work too, so it is slower from the start
SPEEDS = {"a": 0.55, "b": 1.0, "c": 1.0, "d": 1.0}


@pytest.mark.parametrize("layouts,shares", [(ONE, [16]), (TWO, [8, 8])], ids=["1x4", "2x2"])
def test_clean_300_step_runs_make_no_replan(layouts, shares):
    """10 clean runs of each layout (seeds 0-9): none re-plans. (This noise model is harsher than
    the testbed's; over 40 seeds of each layout 3 of 80 runs re-planned once.)"""
    replans = {seed: simulate(layouts, shares, SPEEDS, steps=300, seed=seed) for seed in range(10)}
    assert {s: [step for step, _ in a] for s, a in replans.items() if a} == {}


def test_without_the_slow_down_test_the_same_noise_would_replan():
    """The noise of the clean runs above is enough to move a trigger that only asks for a gain over
    the noise at consecutive checks (the drop test is what keeps them still)."""
    loose = Trigger(drop_sigmas=0.0, min_drop=0.0)
    acts = sum(
        len(simulate(lay, sh, SPEEDS, steps=300, seed=s, trigger=Trigger(drop_sigmas=0.0, min_drop=0.0)))
        for lay, sh in ((ONE, [16]), (TWO, [8, 8]))
        for s in range(3)
    )
    assert loose.drop_bar(0.25, 0.0) == 0.25 and acts > 0


@pytest.mark.parametrize("layouts,shares", [(ONE, [16]), (TWO, [8, 8])], ids=["1x4", "2x2"])
@pytest.mark.parametrize("seed", range(6))
def test_a_4x_straggler_is_acted_on_within_10_steps_and_gets_less_work(layouts, shares, seed):
    acts = simulate(layouts, shares, SPEEDS, steps=30, seed=seed, slow=("c", 8, 4.0))
    assert acts, "no re-plan after a 4x slow-down"
    step, d = acts[0]
    assert 8 < step <= 18, f"acted at step {step}"
    assert d.culprit == "c"

    def work(lays, shs):
        out = {}
        for lay, n in zip(lays, shs, strict=True):
            for i, p in enumerate(lay.peers):
                out[p] = out.get(p, 0.0) + stage_flops(FLOPS, lay.bounds[i], lay.bounds[i + 1]) * n
        return out

    after = work(d.layouts, d.shares or shares)
    assert after.get("c", 0.0) < work(layouts, shares)["c"]


def test_speed_book_medians_and_slowdown():
    book = SpeedBook(RUN_HISTORY, quantile=0.5, recent=4)
    for k in range(8):
        book.record("a", 100.0, 1.0 if k != 5 else 9.0)  # one step the machine stalled
        book.record("b", 100.0, 1.0 + 0.1 * (k % 2))
    assert book.speeds()["a"] == pytest.approx(100.0)  # the median ignores the stall
    assert book.slowdown("a") == pytest.approx(1.0)
    for _ in range(4):
        book.record("b", 100.0, 4.0)  # b slowed 4x
    assert book.slowdown("b") == pytest.approx(100 / 4 / (100 / 1.05), rel=0.05)
    assert SpeedBook(RUN_HISTORY, quantile=0.5, recent=4).slowdown("x") is None
    fresh = SpeedBook(RUN_HISTORY, quantile=0.5, recent=4)
    for _ in range(6):
        fresh.record("c", 1.0, 1.0)
    assert fresh.slowdown("c") is None  # fewer than `recent` samples before the window
    # the spread is read before the window: b's slow-down is not counted as spread
    assert book.spread(["a", "b"]) < 0.2


def test_trigger_needs_the_same_slowed_bottleneck_at_consecutive_checks():
    t = Trigger(persist=2)
    # a big gain, but the bottleneck is at 80% of its earlier speed: no slow-down, no streak
    assert t.check(True, 0.6, 0.25, 0.05, "a", 0.8, 0.1)[0] is False and t.streak == 0
    # not measured long enough to say
    assert t.check(True, 0.6, 0.25, 0.05, "a", None, 0.1)[0] is False and t.streak == 0
    # slowed to 30%: a streak of one; another peer next: a new streak
    assert t.check(True, 0.6, 0.25, 0.05, "a", 0.3, 0.1)[0] is False and t.streak == 1
    assert t.check(True, 0.6, 0.25, 0.05, "b", 0.3, 0.1)[0] is False and t.streak == 1
    act, why = t.check(True, 0.6, 0.25, 0.05, "b", 0.3, 0.1)
    assert act and "2 checks" in why and t.streak == 0
    # a precise measurement: 65% of its speed lost (MIN_DROP); a noisy one (standard error of the
    # log drop 0.7) asks for a deeper slow-down: to e^(-2 x 0.7) = 25% of its speed
    assert t.drop_bar(0.25, 0.05) == pytest.approx(0.65)
    assert t.drop_bar(0.25, 0.7) == pytest.approx(1 - math.exp(-1.4))
    assert t.check(True, 0.6, 0.25, 0.05, "a", 0.3, 0.7)[0] is False and t.streak == 0


def test_a_bottleneck_just_over_the_drop_bar_acts_at_three_checks():
    """The soft tier (issue 18): a 4x slow-down of one of 4 peers on 2 cores measured 0.36-0.41 (run b2
    of the s7t5 note: never moved); under SOFT_DROP (0.42) at SOFT_CHECKS (3) checks in a row it acts,
    under the drop bar (0.35) at 2 as before; a spell at 0.38 for 2 checks, or at 0.45, does not."""
    from fusionnode.train.speeds import SOFT_CHECKS, SOFT_DROP

    assert (SOFT_DROP, SOFT_CHECKS) == (0.42, 3)
    t = Trigger()
    for slowed in (0.39, 0.36):
        assert t.check(True, 0.66, 0.25, 0.06, "s", slowed, 0.1)[0] is False
    act, why = t.check(True, 0.69, 0.25, 0.06, "s", 0.38, 0.1)
    assert act and "3 checks" in why
    for slowed in (0.45, 0.45, 0.45, 0.45):  # over SOFT_DROP: never
        assert t.check(True, 0.66, 0.25, 0.06, "s", slowed, 0.1)[0] is False
    assert t.check(True, 0.66, 0.25, 0.06, "s", 0.38, 0.1)[0] is False
    assert t.check(True, 0.66, 0.25, 0.06, "s", 0.38, 0.1)[0] is False
    assert t.check(True, 0.1, 0.25, 0.06, "s", 0.38, 0.1)[0] is False  # the gain fell: streak gone
    # a noisy measurement (standard error 0.7: e^-1.4 = 0.25) is no soft slow-down at 0.38
    for _ in range(3):
        assert t.check(True, 0.66, 0.25, 0.06, "s", 0.38, 0.7)[0] is False
    # under the drop bar, 2 checks suffice, as before; soft_drop 0 turns the tier off
    assert t.check(True, 0.66, 0.25, 0.06, "s", 0.3, 0.1)[0] is False
    assert t.check(True, 0.66, 0.25, 0.06, "s", 0.3, 0.1)[0] is True
    off = Trigger(soft_drop=0.0)
    assert not any(off.check(True, 0.66, 0.25, 0.06, "s", 0.38, 0.1)[0] for _ in range(5))


def test_shares_move_unless_resplitting_is_clearly_better():
    speeds = {"a": 1.0, "b": 1.0, "c": 0.5, "d": 1.0}  # c at half speed: shares suffice
    d = decide_job(
        TWO, [[f * 8 for f in FLOPS]] * 2, speeds, [4, 4], steps_left=100, move_cost_s=0.0, shares=[8, 8]
    )
    assert d.adopt and d.layouts == tuple(TWO) and d.shares == (12, 4) and d.culprit == "c"
    # c at a tenth: a share move leaves it a micro-batch per step; dropping it is far better
    speeds["c"] = 0.1
    d = decide_job(
        TWO, [[f * 8 for f in FLOPS]] * 2, speeds, [4, 4], steps_left=100, move_cost_s=0.0, shares=[8, 8]
    )
    share_only = balance_shares([1.0, 10.0], [4, 4], 16)
    assert d.adopt and d.layouts != tuple(TWO) and not d.shares and share_only == [12, 4]
    assert "c" not in d.layouts[1].peers or d.layouts[1].bounds != TWO[1].bounds


# ---- the cheap move on real workers and hosts (in-memory network) ------------------------------


def _force_one_share_move(monkeypatch) -> list:
    """Makes the driver's first rebalance check move the batch shares to [12, 4] and no later one
    move anything; returns the list of the shares each check saw."""
    from fusionnode.train import rebalance
    from fusionnode.train.rebalance import Check, JobDecision

    real, calls = rebalance.check_job, []

    def forced(book, trigger, current, *args, **kw):
        c = real(book, trigger, current, *args, **kw)
        calls.append(kw["shares"])
        if len(calls) == 1:
            d = JobDecision(True, "forced by the test", 1.0, 0.5, tuple(current), (12, 4), None)
            return Check(d, True, "forced", 0.0, 0.0, None)
        return Check(c.decision, False, "the test moves once", 0.0, 0.0, None)

    monkeypatch.setattr(rebalance, "check_job", forced)
    return calls


def test_a_share_move_keeps_every_stage_and_the_loss_of_one_process(tmp_path, monkeypatch):
    """2 pipelines x 2 stages, offloaded to an optimizer host; the rebalance check at step 2 is made to
    move the batch shares [8, 8] -> [12, 4]: no stage is assigned again and no parameter is shipped
    (each stage is told its new share, `job.resize`, the host its contributors' sample counts), and
    the losses stay those of one process (the host weighs each pipeline's gradient by its share)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_components import Swarm, small_spec

    from fusionnode.train.local import train_local
    from fusionnode.wire.job import Rpc

    calls = _force_one_share_move(monkeypatch)
    spec = small_spec(steps=8, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    params = {"spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "on", "rebalance_every": 2}
    asyncio.run(s.driver.run_job(params, s.emit))
    replans = [e for e in s.events if e.get("kind") == "replan"]
    assert [e.get("moved") for e in replans] == ["shares"] and replans[0]["shares"] == [12, 4]
    assert calls[1] == [12, 4]  # the next check sees the moved shares
    for pid in s.workers:
        got = s.net.peers[pid].calls
        assert got.count(Rpc.JOB_ASSIGN) == 1 and got.count(Rpc.JOB_START) == 1, (pid, got)
        assert got.count(Rpc.JOB_RESIZE) == 1
    ref = train_local(spec).losses
    losses = [e["loss"] for e in s.steps()]
    assert len(losses) == spec.steps
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) < 1e-5, (losses, ref)


def test_a_refused_share_move_whose_revert_one_stage_misses_re_places_the_job(tmp_path, monkeypatch, caplog):
    """A share move that one stage refuses: the others are told their old share back; one that misses
    that revert would keep the new samples, so the job is re-placed (`adopt`: every stage released,
    new ones assigned), the miss is logged, and the losses stay those of one process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_components import Swarm, small_spec

    from fusionnode.train.local import train_local
    from fusionnode.wire.job import ErrorCode, JobError, Rpc

    _force_one_share_move(monkeypatch)
    spec = small_spec(steps=6, batch_size=16, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=1)
    refuser, misser = list(s.workers)[:2]
    seen = {refuser: 0, misser: 0}
    resize = s.net.peers[misser]._rpc[Rpc.JOB_RESIZE]

    async def refuse(args, sender):
        seen[refuser] += 1
        raise JobError(ErrorCode.NO_ROOM, "no room for the larger micro-batches")

    async def miss_the_revert(args, sender):
        seen[misser] += 1
        if seen[misser] == 2:
            raise JobError(ErrorCode.FAILED, "the revert was lost")
        return await resize(args, sender)

    s.net.peers[refuser]._rpc[Rpc.JOB_RESIZE] = refuse
    s.net.peers[misser]._rpc[Rpc.JOB_RESIZE] = miss_the_revert
    params = {"spec": spec.to_dict(), "stages": 2, "replicas": 2, "offload": "on", "rebalance_every": 2}
    with caplog.at_level("WARNING", logger="fusionnode.train.sharemove"):
        asyncio.run(s.driver.run_job(params, s.emit))
    assert seen == {refuser: 2, misser: 2}  # the move, then the revert
    missed = [r.getMessage() for r in caplog.records if "share move revert missed by" in r.getMessage()]
    assert len(missed) == 1 and repr(misser[:12]) in missed[0]
    replans = [e for e in s.events if e.get("kind") == "replan"]
    assert len(replans) == 1 and replans[0].get("moved") is None and replans[0]["shares"] == [12, 4]
    assigned = sum(s.net.peers[pid].calls.count(Rpc.JOB_ASSIGN) for pid in s.workers)
    assert assigned == 8  # 4 stages, then 4 new ones
    ref = train_local(spec).losses
    losses = [e["loss"] for e in s.steps()]
    assert len(losses) == spec.steps
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) < 1e-5, (losses, ref)


def test_a_worker_resizes_only_a_held_offloaded_stage_that_fits(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_components import Swarm

    from fusionnode.wire import job as jp
    from fusionnode.wire.job import ErrorCode, JobError, Rpc

    s = Swarm(tmp_path, workers=2)
    w, drv = s.ids
    t = s.net.peers[drv]
    desc = {
        "format": "fusionnode.subdag",
        "version": 1,
        "inputs": [],
        "outputs": [],
        "params": {},
        "buffers": {},
    }
    off = jp.Offload(hosts={}, host_index={}, contributor="r0s0", samples=8).to_wire()
    a = jp.StageAssignment(
        job="j",
        stage=0,
        num_stages=1,
        driver=drv,
        description=desc,
        param_specs={},
        spec={},
        peer=w,
        offload=off,
    )

    async def main():
        async def code_of(req) -> str:
            with pytest.raises(JobError) as e:
                await jp.call(t, w, Rpc.JOB_RESIZE, req)
            return e.value.code

        resize = jp.ResizeRequest(job="j", stage=0, samples=12, need_bytes=1 << 20)
        assert await code_of(resize) == ErrorCode.NOT_HELD
        assert (await jp.call(t, w, Rpc.JOB_ASSIGN, a)).accepted
        assert await code_of(resize.replace(need_bytes=1 << 40)) == ErrorCode.NO_ROOM
        sj = s.workers[w].jobs[("j", 0)]
        assert sj.offload.samples == 8  # a refused resize changes nothing
        assert (await jp.call(t, w, Rpc.JOB_RESIZE, resize)).accepted
        assert sj.offload.samples == 12 and sj.need_bytes == 1 << 20
        assert (await jp.call(t, w, Rpc.JOB_ASSIGN, a.replace(stage=1, offload=None))).accepted
        assert await code_of(resize.replace(stage=1)) == ErrorCode.BAD_REQUEST
        with pytest.raises(JobError):
            jp.ResizeRequest(job="j", stage=0, samples=0, need_bytes=0)

    asyncio.run(main())
