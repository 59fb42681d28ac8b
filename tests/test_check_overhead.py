"""What cuts the spot-checks' overhead (issue 20) without changing what they judge: a driver's pull
from its own optimizer host reads the store in place, and the check process gets its parameters in
shared-memory buffers that are reused once each check ended (train/checks.py `SharedBuffers`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from memnet import MemNet

from fusionnode.errors import FusionNodeError
from fusionnode.optim.client import OptimizerClient
from fusionnode.optim.host import OptimizerHostService
from fusionnode.train.checks import CheckProcess, SharedBuffers
from fusionnode.train.spec import JobSpec
from fusionnode.verify.audit import pack_tensors, unpack_tensors
from fusionnode.wire.checked import tensor_message

JOB = "j-local-pull"
DRIVER = "QmDriverxxxxxxxxxxxxxxxxxxxx"  # also the job's optimizer host (one daemon)
SPECS = {"w": {"shape": [2, 3], "dtype": "float32"}, "b": {"shape": [3], "dtype": "float32"}}


def test_a_driver_pulls_from_its_own_host_in_place_with_the_values_a_pull_message_carries(tmp_path):
    async def main():
        net = MemNet()
        t = net.join(DRIVER)
        svc = OptimizerHostService(t, state_dir=tmp_path / "host", step_deadline_s=5.0)
        spec = JobSpec(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=None, job_id=JOB)
        expected = {n: {"r0/s0": {"replica": 0, "samples": 1, "peer": DRIVER}} for n in SPECS}
        init = {"job": JOB, "driver": DRIVER, "host_index": 0, "spec": spec.to_dict()}
        await t.call(DRIVER, "opt.init", {**init, "param_specs": SPECS, "expected": expected})
        start = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
        for idx, name in enumerate(start):  # one message each, numbered as the host takes them
            meta = {"job": JOB, "stage": 0, "step": -1, "mb": idx}
            await t.send(DRIVER, tensor_message("opt_params", meta, {name: start[name]}))
        await t.call(DRIVER, "opt.load", {"job": JOB})
        push = {"job": JOB, "step": 1, "mb": -1, "stage": 0, "contributor": "r0/s0", "samples": 1}
        await t.send(DRIVER, tensor_message("push", push, {"w": torch.full((2, 3), 2.0), "b": torch.ones(3)}))
        await t.call(DRIVER, "opt.apply", {"job": JOB, "step": 1, "lr": 0.1})

        client = OptimizerClient(t, 5.0)
        by_message = await client.pull(JOB, [DRIVER], None, SPECS)  # opt.pull, one message per tensor
        pulls = t.calls.count("opt.pull")
        client.local = svc
        in_place = await client.pull(JOB, [DRIVER], None, SPECS)
        assert t.calls.count("opt.pull") == pulls  # no call, no message to itself
        assert set(in_place) == set(by_message) == set(SPECS)
        for name in SPECS:
            assert torch.equal(in_place[name], by_message[name]) and in_place[name].dtype == torch.float32
        assert torch.allclose(in_place["w"], start["w"] - 0.2)  # the applied step's values
        in_place["w"].zero_()  # a copy: the store keeps its values
        assert torch.equal(svc.shards[JOB].store.get_params(["w"])[1]["w"], by_message["w"])
        with pytest.raises(FusionNodeError, match="does not hold"):
            await client.pull(JOB, [DRIVER], None, {"nope": {"shape": [1], "dtype": "float32"}})
        with pytest.raises(FusionNodeError, match="held as"):
            await client.pull(JOB, [DRIVER], None, {"b": {"shape": [4], "dtype": "float32"}})

    asyncio.run(main())


def test_shared_buffers_are_lent_once_at_a_time_and_reused_after():
    pool = SharedBuffers()
    a = pool.take(100)
    b = pool.take(50)  # `a` is lent: another buffer
    assert a.is_shared() and b.is_shared() and a.numel() >= 100 and b.numel() >= 50
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    pool.give(b)
    pool.give(a[:80])  # a view of it gives it back
    again = pool.take(90)  # the one that fits of the two free (of other sizes: found by position)
    assert again.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert pool.take(40).untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    bigger = pool.take(1000)  # none free that fits: a new one
    assert bigger.numel() >= 1000 and bigger.untyped_storage().data_ptr() not in {
        a.untyped_storage().data_ptr(),
        b.untyped_storage().data_ptr(),
    }
    pool.give(torch.zeros(4, dtype=torch.uint8))  # not lent by it: ignored
    assert len(pool.free) == 0


def test_tensors_packed_into_a_lent_buffer_unpack_to_the_same_values():
    pool = SharedBuffers()
    tensors = {
        "w": torch.randn(3, 5),
        "i": torch.arange(7),
        "e": torch.zeros(0, 2),
        "t": torch.randn(6, 4).t(),
    }
    buf, index = packed = pack_tensors(tensors, pool.take)
    assert buf.is_shared()
    back = unpack_tensors(packed)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    assert back["w"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert [i[0] for i in index] == list(tensors)


def test_the_check_process_gives_each_buffer_back_when_its_check_ended():
    """Two checks at once get two buffers; once both ended, both are free and the next takes one."""
    from fusionnode.train import checks

    proc = CheckProcess("job-buffers")
    packs = [proc.pack({"x": torch.full((1000,), float(i))}) for i in range(2)]
    assert packs[0][0].untyped_storage().data_ptr() != packs[1][0].untyped_storage().data_ptr()
    lent = len(checks._BUFFERS.lent)
    assert lent >= 2

    async def go():
        # not a well-formed audit: the check process answers why (the buffer comes back all the same)
        return await asyncio.gather(*(proc(None, p) for p in packs), return_exceptions=True)

    asyncio.run(go())
    assert len(checks._BUFFERS.lent) == lent - 2
    reused = proc.pack({"x": torch.ones(1000)})
    assert reused[0].untyped_storage().data_ptr() in {p[0].untyped_storage().data_ptr() for p in packs}
    checks._BUFFERS.give(reused[0])
