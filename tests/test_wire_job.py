"""The job protocol's typed messages (wire/job.py): every message type round-trips through a real
frame, a missing, unknown, mistyped or out-of-bounds field is refused with a clear bad_request, and
error codes with the peer to blame survive the trip from a handler to its caller."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
import torch

from fusionnode.errors import DeadlineError, PeerError
from fusionnode.wire import Call, Reply, checked, decode_message, encode_message
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, Failure, JobError, Rpc, TensorKind

PEER = "12D3KooWQmPeerIdOfSomeWorker000000000000000000"
SECRET = "s" * 32
SPECS = {"w": {"shape": [2, 3], "dtype": "float32"}}
EXPECTED = {"w": {"r0/s0": {"replica": 0, "samples": 4, "peer": PEER}}}
OFFLOAD = {"hosts": {"w": PEER}, "host_index": {"w": 0}, "contributor": "r0/s0", "samples": 4}
RING = {
    "id": 3,
    "members": [PEER, PEER + "2"],
    "member_stages": [1, 3],
    "weights": [0.5, 0.5],
    "names": ["w"],
}

# values a field must have to pass its message's own checks (by field name)
OVERRIDES: dict[str, Any] = {
    "param_specs": SPECS,
    "recv_specs": SPECS,
    "send_specs": SPECS,
    "expected": EXPECTED,
    "offload": OFFLOAD,
    "allreduce": [RING],
    "members": RING["members"],
    "member_stages": RING["member_stages"],
    "weights": RING["weights"],
    "secret": SECRET,
    "what": "grads",
    "lease_s": 30.0,
    "num_stages": 4,
    "pos": 2,
    "bw_next": 1e9,
    "bw_prev": 2e9,
    "micro_batches": 4,
    "mbs": [1],  # below micro_batches (verify.check checks it)
    "mb_size": 2,
    "first": 3,
    "contrib": {"clip": 2.0, "score": True},
}


def _sample(tp: Any, name: str) -> Any:
    if name in OVERRIDES:
        return OVERRIDES[name]
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)), name)
    if origin is list:
        return [_sample(typing.get_args(tp)[0], name)]
    if origin is dict:
        return {"k": _sample(typing.get_args(tp)[1], name)}
    return {str: "x", int: 7, float: 0.25, bool: True}.get(tp, {"any": [1, "two"]})


def full(cls: type) -> Any:
    """An instance of `cls` with every field set (not left to its default)."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], f.name) for f in dataclasses.fields(cls)})


def minimal(cls: type) -> Any:
    """An instance with only the required fields set."""
    hints = typing.get_type_hints(cls)
    req = [
        f
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    return cls(**{f.name: _sample(hints[f.name], f.name) for f in req})


def through_wire(payload: dict[str, Any], as_reply: bool = False) -> dict[str, Any]:
    """The map as the other side reads it: inside a real Call / Reply frame."""
    msg = Reply(True, payload) if as_reply else Call("m", payload)
    back = decode_message(encode_message(msg, checksum=True))
    return back.result if as_reply else back.args


def test_the_table_names_every_rpc_once_with_its_types():
    assert set(jp.RPCS) == Rpc.ALL - {Rpc.DATA_OPEN}  # data.open is the transport's, not a job RPC
    for name, spec in jp.RPCS.items():
        assert spec.name == name and issubclass(spec.request, jp.JobMessage)
        assert issubclass(spec.reply, jp.JobMessage) and spec.caller
        assert set(spec.errors) <= ErrorCode.ALL
    assert len(jp.MESSAGE_TYPES) >= 30
    # a lost job.step reply is recalled with the same request under job.step_result (Transport.call)
    assert jp.RPCS[Rpc.JOB_STEP_RESULT].request is jp.RPCS[Rpc.JOB_STEP].request
    assert jp.RPCS[Rpc.JOB_STEP_RESULT].reply is jp.RPCS[Rpc.JOB_STEP].reply


@pytest.mark.parametrize("cls", jp.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_type_round_trips_through_a_frame(cls):
    for msg in (full(cls), minimal(cls)):
        for as_reply in (False, True):
            assert cls.from_wire(through_wire(msg.to_wire(), as_reply)) == msg
        assert dataclasses.is_dataclass(msg) and msg.__dataclass_params__.frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, dataclasses.fields(msg)[0].name, None)


@pytest.mark.parametrize("cls", jp.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_unknown_missing_and_mistyped_fields_are_refused(cls):
    wire = full(cls).to_wire()
    with pytest.raises(JobError, match=rf"{cls.__name__}: unknown field\(s\) \['renamed'\]") as e:
        cls.from_wire({**wire, "renamed": 1})
    assert e.value.code == ErrorCode.BAD_REQUEST
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            with pytest.raises(JobError, match=rf"{cls.__name__}: missing field '{f.name}'"):
                cls.from_wire({k: v for k, v in wire.items() if k != f.name})
        with pytest.raises(JobError, match=f"{cls.__name__}.{f.name}"):
            cls.from_wire({**wire, f.name: object() if f.name == "description" else b"\x00"})
    with pytest.raises(JobError, match="must be a map"):
        cls.from_wire([wire])


def test_types_are_exact_bool_is_no_int_and_ints_are_floats():
    ok = jp.StepRequest.from_wire({"job": "j", "stage": 1, "step": 2, "micro_batches": 1, "mb_size": 1})
    assert ok.target_time_s is None
    with pytest.raises(JobError, match=r"StepRequest\.step must be an integer"):
        jp.StepRequest.from_wire({**ok.to_wire(), "step": True})
    with pytest.raises(JobError, match=r"StepRequest\.stage must be an integer"):
        jp.StepRequest.from_wire({**ok.to_wire(), "stage": 1.0})
    assert jp.StepRequest.from_wire({**ok.to_wire(), "target_time_s": 2}).target_time_s == 2.0
    with pytest.raises(JobError, match=r"OptPull\.names\[1\] must be str"):
        jp.OptPull.from_wire({"job": "j", "names": ["a", 3]})


def test_bounds_are_checked_by_the_messages():
    a = minimal(jp.StageAssignment)
    for change, why in (
        ({"need_bytes": -1}, "non-negative"),
        ({"lease_s": 1e12}, "lease_s"),
        ({"lease_s": float("nan")}, "lease_s"),
        ({"num_stages": 0}, "position"),
        ({"pos": 4, "num_stages": 4}, "position"),
        ({"bw_next": float("inf")}, "bandwidth"),
        ({"offload": {"hosts": {}}}, "Offload: missing field"),
    ):
        with pytest.raises(JobError, match=why):
            jp.StageAssignment.from_wire({**a.to_wire(), **change})
    for cls, change, why in (
        (jp.OptInit, {"secret": "short"}, "16 to 256"),
        (jp.OptInit, {"expected": {"w": {"k": {"replica": 0, "samples": 1}}}}, "needs peer"),
        (jp.OptReplan, {"expected": {"w": {"k": {"peer": PEER, "samples": 1}}}}, "needs a replica"),
        (jp.FetchRequest, {"what": "optimizer"}, "what must be one of"),
        (jp.StepRequest, {"micro_batches": 0}, ">= 1"),
        (jp.OptPull, {"first": -1}, "first must be"),
    ):
        with pytest.raises(JobError, match=why):
            cls.from_wire({**full(cls).to_wire(), **change})


def test_error_codes_and_blame_cross_a_reply():
    exc = JobError(ErrorCode.BAD_TENSOR, f"peer {PEER[:12]}… sent non-finite values", PEER)
    reply = decode_message(encode_message(Reply(False, jp.error_result(exc), f"JobError: {exc}")))
    got = jp.remote_error(f"peer X refused 'job.step': {reply.error}", reply.result)
    assert isinstance(got, PeerError) and (got.code, got.blame) == (ErrorCode.BAD_TENSOR, PEER)
    assert Failure.of(got) == Failure(ErrorCode.BAD_TENSOR, str(got), PEER)
    # an unknown code from a newer or hostile peer is "failed"; an over-long blame is dropped
    assert jp.remote_error("t", {"code": "launch_missiles", "blame": "x" * 500}).code == ErrorCode.FAILED
    assert jp.remote_error("t", {"code": ErrorCode.LEAVING, "blame": "x" * 500}).blame == ""
    assert jp.error_result(DeadlineError("late")) == {"code": ErrorCode.DEADLINE}
    assert jp.error_result(ValueError("x")) == {}
    assert Failure.of(DeadlineError("late")).code == ErrorCode.DEADLINE
    assert Failure.of(OSError("reset")).code == ErrorCode.FAILED
    with pytest.raises(ValueError, match="unknown error code"):
        JobError("nope", "x")


def test_tensor_helpers_check_kind_names_shapes_and_values():
    with pytest.raises(ValueError, match="unknown tensor kind 'activation'"):
        checked.tensor_message("activation", {}, {"x": torch.ones(1)})
    msg = checked.tensor_message(
        TensorKind.ACT, {"job": "j"}, {"h": torch.ones(2, 3), "ids": torch.arange(2)}, "fp16"
    )
    back = decode_message(encode_message(msg))
    specs = {"h": {"shape": [1, 3], "dtype": "float32"}, "ids": {"shape": [1], "dtype": "int64"}}
    out = checked.decode_checked(back, specs, 2, PEER)
    assert out["h"].shape == (2, 3) and out["ids"].tolist() == [0, 1]
    assert back.tensors["h"].codec == "fp16" and back.tensors["ids"].codec == "raw"
    for bad, why in (
        ({"h": torch.ones(3, 3), "ids": torch.arange(3)}, "sent 'h' as float32"),
        ({"x": torch.ones(2, 3)}, "unexpected tensor 'x'"),
        ({"h": torch.full((2, 3), float("nan")), "ids": torch.arange(2)}, "non-finite"),
    ):
        with pytest.raises(JobError, match=why) as e:
            checked.decode_checked(checked.tensor_message(TensorKind.ACT, {}, bad), specs, 2, PEER)
        assert (e.value.code, e.value.blame) == (ErrorCode.BAD_TENSOR, PEER)


def test_spec_lists_every_rpc_with_its_message_types_and_every_kind_and_code():
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[1] / "protocol" / "SPEC.md").read_text()
    job = spec[spec.index("## 13. The job protocol") :]
    for name, s in jp.RPCS.items():
        row = next(line for line in job.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"{s.request.__name__}:" in row and f"{s.reply.__name__}:" in row
        for f in dataclasses.fields(s.request):
            assert f"`{f.name}`" in row, (name, f.name)
    for kind in TensorKind.ALL:
        assert f"`{kind}`" in job
    table = spec[spec.index("### 13.2 Data messages") :]
    rows = {
        cell.strip("` ")
        for line in table.splitlines()
        if line.startswith("| `")
        for cell in line.split("|")[1].split(",")
    }
    for kind in TensorKind.ALL:  # a row of the data-kind table each
        assert kind in rows, kind
    for code in ErrorCode.ALL:
        assert f"| `{code}` |" in job
