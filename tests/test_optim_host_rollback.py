"""An optimizer host's rollback (opt.rollback to the mark) and its shard checkpoints, on the in-memory
network (tests/memnet.py): no daemons."""

from __future__ import annotations

import asyncio
import statistics

import pytest
import torch
from memnet import MemNet

from fusionnode.optim.checkpoint import shard_steps
from fusionnode.optim.host import OptimizerHostService
from fusionnode.security.guard import GuardConfig
from fusionnode.train.spec import JobSpec
from fusionnode.wire.checked import tensor_message

JOB = "j-roll"
DRIVER = "QmDriverxxxxxxxxxxxxxxxxxxxx"
HOST = "QmHostxxxxxxxxxxxxxxxxxxxxxx"


def test_a_rollback_drops_the_shard_checkpoints_of_the_undone_steps(tmp_path):
    """The hosts checkpoint a step when they apply it, before its spot-checks are judged; a rollback
    to the mark undoes those steps, so their checkpoints go too: a host restored from one (a host
    death before the replay reaches that step, or a --resume) would bring the liar's steps back."""

    async def main():
        net = MemNet()
        driver, h = net.join(DRIVER), net.join(HOST)
        svc = OptimizerHostService(
            h, state_dir=tmp_path / "host", step_deadline_s=5.0, guard=GuardConfig(min_history=2)
        )
        spec = JobSpec(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=None, job_id=JOB)
        await driver.call(
            HOST,
            "opt.init",
            {
                "job": JOB,
                "driver": DRIVER,
                "host_index": 0,
                "spec": spec.to_dict(),
                "param_specs": {"w": {"shape": [3], "dtype": "float32"}},
                "expected": {"w": {"r0/s0": {"replica": 0, "samples": 1, "peer": DRIVER}}},
                "save_every": 2,
            },
        )
        meta = {"job": JOB, "stage": 0, "step": -1, "mb": 0}
        await driver.send(HOST, tensor_message("opt_params", meta, {"w": torch.zeros(3)}))
        await driver.call(HOST, "opt.load", {"job": JOB})
        store = svc.shards[JOB].store
        marked = None
        for step in range(1, 7):
            push = {"job": JOB, "step": step, "mb": -1, "stage": 0, "contributor": "r0/s0", "samples": 1}
            await driver.send(HOST, tensor_message("push", push, {"w": torch.full((3,), float(step))}))
            assert store.ready(step)
            await driver.call(HOST, "opt.apply", {"job": JOB, "step": step, "lr": 0.1, "mark": step == 3})
            if step == 2:
                marked = store.get_params(["w"])[1]["w"].clone()
        owner_root = svc.shards[JOB].save_dir
        assert shard_steps(owner_root, JOB, "h0") == [2, 4, 6]
        reply = await driver.call(HOST, "opt.rollback", {"job": JOB, "step": 2})
        assert reply["undone"] and reply["applied_step"] == 2
        assert torch.equal(store.get_params(["w"])[1]["w"], marked)
        # the checkpoints of steps 4 and 6 held undone steps: gone; step 2's (the mark's) stays
        assert shard_steps(owner_root, JOB, "h0") == [2]
        # the norm bound forgot the undone steps' pushes (their replay records them again): the
        # median is that of steps 1 and 2 only, as in a run that never went past step 2
        norms = [float(torch.linalg.vector_norm(torch.full((3,), float(s)))) for s in (1, 2)]
        want = svc.norms.config.norm_factor * statistics.median(norms)
        assert svc.norms.bound((JOB, "w")) == pytest.approx(want, rel=1e-6)  # not steps 1..6's median

    asyncio.run(main())
