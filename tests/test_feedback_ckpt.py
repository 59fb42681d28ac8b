"""SparseLoCo's error feedback in a time-closed job's checkpoints, stage by stage
(train/feedback_ckpt.py): one stage that cannot answer `job.fetch what=feedback round=q` leaves the
other stages' accumulators in the checkpoint; the resumed job starts new ones for that stage's names
only, says which in a notice and in its first round's record, and follows the replay that keeps the
others (`train --local --round-steps FILE` reads that record)."""

from __future__ import annotations

import json

import torch
from test_components import Swarm, round_job, small_spec
from test_time_close_faults import SPARSE_TOL, _follows, _replay, _stopped_after_round_2_and_resumed, _timed

from fusionnode.sync import SyncConfig
from fusionnode.train.checkpoint import checkpoint_feedback, list_checkpoints, read_checkpoint
from fusionnode.train.free_rounds_local import load_restarts
from fusionnode.wire import job as jp
from fusionnode.wire.job import Rpc

torch.set_num_threads(1)
REFUSED = 3  # the stage id whose feedback fetches of a round are refused


class _Kept(list):
    """The swarm's events; what `clear` removes is kept in `seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def clear(self) -> None:
        self.seen.extend(self)
        super().clear()


def _refuse_round_feedback(s: Swarm, stage: int) -> list[dict]:
    """Every worker answers `job.fetch what=feedback round=q` of `stage` with not_held (as a stage of a
    replica that lost round q does); returns the refused requests."""
    refused: list[dict] = []
    for pid in s.workers:
        t = s.net.peers[pid]
        fetch = t._rpc[Rpc.JOB_FETCH]

        async def refusing(args: dict, sender: str, fetch=fetch):
            if (
                args.get("what") == "feedback"
                and args.get("round") is not None
                and args.get("stage") == stage
            ):
                refused.append(args)
                raise jp.JobError(jp.ErrorCode.NOT_HELD, f"no error feedback of round {args['round']}")
            return await fetch(args, sender)

        t._rpc[Rpc.JOB_FETCH] = refusing
    return refused


def test_a_stage_that_cannot_answer_leaves_the_other_stages_feedback_in_the_checkpoint(tmp_path):
    sync = _timed(SyncConfig("sparseloco", inner_steps=3, topk_density=1 / 16, chunk=256))
    spec = small_spec(steps=15, micro_batches=2, save_dir=str(tmp_path / "ck"), save_every=6)
    s = Swarm(tmp_path, workers=4, hosts=2)
    refused = _refuse_round_feedback(s, REFUSED)
    s.events = _Kept()  # the first run's events stay readable after the resume clears them
    params = round_job(spec, sync, rebalance_every=0)

    first, rounds, k = _stopped_after_round_2_and_resumed(s, spec, params)
    assert refused and k == 2
    # the step-6 checkpoint (the one resumed) holds every replica's feedback but the refused stage's
    fb = checkpoint_feedback(read_checkpoint(dict(list_checkpoints(spec.save_dir))[6]))
    assert sorted(fb) == [0, 1], sorted(fb)
    full, part = sorted(fb, key=lambda r: -len(fb[r]))
    assert fb[part] and set(fb[part]) < set(fb[full])
    missing = sorted(set(fb[full]) - set(fb[part]))
    notices = [
        e for e in s.events.seen + s.events if e.get("what") in ("checkpoint_feedback", "resume_feedback")
    ]
    assert [(e["what"], e.get("step")) for e in notices] == [
        ("checkpoint_feedback", 6),  # the first run's, of round 1
        ("resume_feedback", None),
        ("checkpoint_feedback", 12),  # the resumed run's, of round 3
    ], notices
    assert all(f"stage {REFUSED}" in e["reason"] for e in notices), notices
    assert all(f"stage {st}" not in e["reason"] for e in notices for st in range(4) if st != REFUSED)
    assert not [e for e in s.events if e.get("kind") == "resume" and "feedback" in e.get("reason", "")]
    # the resumed round's record names what started new; the replay of that follows the run
    assert rounds[0]["fresh_feedback"] == {str(part): missing}
    kept = first[:k] + rounds
    partial = {k: {part: missing}}
    _follows(kept, _replay(spec, sync, kept, restart_rounds={k}, fresh_feedback_names=partial), SPARSE_TOL)
    # new accumulators everywhere (what the checkpoint gave before) are another trajectory
    fresh = _replay(spec, sync, kept, restart_rounds={k}, fresh_feedback_rounds={k})
    dev = [abs(a - r["loss"]) for a, r in zip(fresh.losses[k:], rounds, strict=True)]
    assert max(dev) > SPARSE_TOL, dev
    # `train --local --round-steps FILE` reads the same from the metrics file
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in first + rounds))
    assert load_restarts(str(path)) == {
        "restart_rounds": [k],
        "fresh_outer_rounds": [],
        "fresh_feedback_rounds": [],
        "fresh_feedback_names": partial,
    }
