"""The round-end check of SparseLoCo's error feedback (verify/feedback.py, issue 20): each step's
report commits to the stage's accumulators, the round-end fetch shows them before and after the
round's fold, and the driver recomputes the message ctopk2(β e_prev + Δ) and e_next = e − c.

Honest sparseloco workers pass every round end (in-memory swarm, every check drawn); a worker whose
message does not come from its feedback, one that drops what its feedback held, and one that shows
an honest accumulator but keeps another are each caught. Before this check, sparseloco's round ends
were not checked at all (`round_end_checks` returned None), so each liar test fails without it."""

from __future__ import annotations

import asyncio

import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.compress.pseudograd import ErrorFeedbackAccumulator
from fusionnode.sync import SyncConfig
from fusionnode.verify import feedback

SPARSE = SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256)


def _acc_round(seed: int):
    """One replica's two rounds of error feedback on two tensors: (Δ of round 2, e_prev, e_next, c)."""
    g = torch.Generator().manual_seed(seed)
    fb = ErrorFeedbackAccumulator(SPARSE.ef_decay, SPARSE.chunk, SPARSE.k_per_chunk)
    shapes = {"w": (24, 40), "b": (40,)}
    for n, sh in shapes.items():
        fb.compress(n, torch.randn(sh, generator=g))
    prev = {n: t.clone() for n, t in fb.acc.items()}
    delta = {n: torch.randn(sh, generator=g) for n, sh in shapes.items()}
    sent = {n: fb.compress(n, delta[n])[1] for n in sorted(shapes)}
    return delta, prev, dict(fb.acc), sent


def test_the_recompute_accepts_honest_feedback_and_refuses_each_lie():
    delta, prev, nxt, sent = _acc_round(1)
    names = sorted(delta)
    assert feedback.feedback_mismatch(SPARSE, names, delta, prev, nxt, sent) == ("", 0.0)
    # the first round: no accumulator before it
    fb = ErrorFeedbackAccumulator(SPARSE.ef_decay, SPARSE.chunk, SPARSE.k_per_chunk)
    first = {n: fb.compress(n, delta[n])[1] for n in names}
    assert feedback.feedback_mismatch(SPARSE, names, delta, {}, dict(fb.acc), first)[0] == ""
    # a message that is not the feedback's top-k: scaled by 1%, or Δ sent without the feedback
    scaled = {n: 1.01 * t for n, t in sent.items()}
    assert "not the chunked top-k" in feedback.feedback_mismatch(SPARSE, names, delta, prev, nxt, scaled)[0]
    assert "not the chunked top-k" in feedback.feedback_mismatch(SPARSE, names, delta, {}, nxt, sent)[0]
    # the message honest, the feedback kept dropped (a liar that forgets what it owes)
    zero = {n: torch.zeros_like(t) for n, t in nxt.items()}
    assert "kept is not" in feedback.feedback_mismatch(SPARSE, names, delta, prev, zero, sent)[0]
    # nothing shown
    assert feedback.feedback_mismatch(SPARSE, names, delta, prev, {}, sent)[0]


def _run(tmp_path, tamper=None, steps: int = 6):
    """A 2 x 2 sparseloco job with scoring and every check on; `tamper(worker, sj)` is applied to one
    worker of replica 1 once its stage holds its round state."""
    spec = small_spec(steps=steps, micro_batches=2, batch_size=8)
    s = Swarm(tmp_path, workers=4, hosts=2)
    params = round_job(spec, SPARSE, contrib_policy="score", verify_policy="all", replicas=2)
    chosen: list[str] = []

    async def main():
        job = asyncio.ensure_future(s.driver.run_job(params, s.emit))
        while tamper is not None and not job.done():
            await asyncio.sleep(0.005)
            held = {pid: (w, sj) for pid, w in s.workers.items() for sj in w.jobs.values()}
            ready = [(pid, w, sj) for pid, (w, sj) in held.items() if sj.rounds is not None]
            if len(ready) == 4:
                pid, w, sj = next((p, w, sj) for p, w, sj in ready if sj.replica == 1 and sj.pos == 1)
                tamper(w, sj)
                chosen.append(pid)
                break
        try:
            return await job
        except Exception as exc:  # the job may end short of workers: the events are what counts
            return exc

    result = asyncio.run(main())
    return result, s.events, chosen


def _caught(events):
    return [e for e in events if e.get("kind") == "caught"]


def test_honest_sparseloco_workers_pass_every_round_end_check(tmp_path):
    result, events, _ = _run(tmp_path)
    assert not [e for e in events if e.get("kind") in ("caught", "failure")]
    v = result["verify"]
    # transitions: steps 0, 2, 4 x 4 stages, + 3 round ends x 4 stages (sparseloco's now checked)
    assert v["transitions"] == 12 + 12 and v["transitions_caught"] == 0, v
    assert v["round_end_max_rel_err"] <= 1e-6, v  # CPU: the worker's own float32 code, replayed


def test_a_worker_dropping_its_feedback_is_caught_at_the_round_end(tmp_path):
    def tamper(worker, sj):
        fb = sj.rounds.sender.feedback
        real = fb.compress

        def compress(name, delta):
            enc, sent = real(name, delta)
            fb.acc[name].zero_()  # sends honestly, then forgets what it still owes
            return enc, sent

        fb.compress = compress

    _result, events, chosen = _run(tmp_path, tamper)
    caught = _caught(events)
    assert [e["peer"] for e in caught][:1] == chosen, caught
    assert "error feedback it kept is not" in caught[0]["reason"], caught[0]["reason"]
    scored = [e for e in events if e.get("kind") == "scored"]
    assert scored[0]["verdict"][1] == 0.0, scored[0]  # its replica's round not applied


def test_a_worker_keeping_another_feedback_than_it_showed_is_caught_next_round(tmp_path):
    from fusionnode.wire import job as jp
    from fusionnode.wire.job import Rpc

    def tamper(worker, sj):
        real = worker.rpc_fetch

        async def fetch(req, sender):
            reply = await real(req, sender)
            if req.what == "inner" and getattr(sj.rounds, "ef_prev", None) is not None:
                for t in sj.rounds.sender.feedback.acc.values():  # shown honest, then changed
                    t.mul_(2.0)
            return reply

        jp.serve(worker.t, Rpc.JOB_FETCH, fetch)

    _result, events, chosen = _run(tmp_path, tamper)
    caught = _caught(events)
    assert [e["peer"] for e in caught][:1] == chosen, caught
    assert "error feedback other than the one it showed" in caught[0]["reason"], caught[0]["reason"]
    assert caught[0]["step"] == 2, caught[0]  # the first report of round 1
