"""A stage's local optimizer state on the wire (`--offload off`): what a stage moved to another worker
takes with it, so the job goes on as if the stage had never moved (issue 18: ring jobs survive a dead
member, and their stages can be re-split).

With the optimizer on the workers, every replica of a stage holds the stage's parameters and its
optimizer state (the ring all-reduce keeps them bit-identical). `job.fetch` what="optim" sends the
driver one `opt_state` message per parameter; before `job.start` the driver sends a new stage the
same messages (`StageRef.optim` of them), which it loads into its fresh optimizer. Each message holds
the parameter's state tensors named `<name>|<kind>` (kind: exp_avg, exp_avg_sq for AdamW;
momentum_buffer for SGD) and `<name>|steps`, the update count, as a float32 [1] tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import ErrorCode, JobError, TensorKind

STEPS = "steps"


def _flat(sj: Any) -> Any:
    """The FlatOptimizer under the stage's LocalOptimizer (None when the hosts keep the state)."""
    return getattr(sj.opt, "opt", None)


def state_of(sj: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Name -> its message's tensors (`<name>|<kind>`, `<name>|steps`), in name order."""
    flat = _flat(sj)
    if flat is None:
        raise JobError(ErrorCode.BAD_REQUEST, "this stage keeps no optimizer state (its hosts do)")
    sd = flat.state_dict()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(sj.params):
        msg = {f"{name}|{kind}": sd["state"][kind][name] for kind in sorted(sd["state"])}
        msg[f"{name}|{STEPS}"] = torch.tensor([float(sd["steps"][name])])
        out[name] = msg
    return out


def expected(sj: Any) -> dict[str, dict[str, Any]]:
    """The tensors a stage takes (decode_checked's expectations)."""
    flat = _flat(sj)
    out: dict[str, dict[str, Any]] = {}
    for name, p in sj.params.items():
        for kind in flat.state:
            out[f"{name}|{kind}"] = {"shape": list(p.shape), "dtype": "float32"}
        out[f"{name}|{STEPS}"] = {"shape": [1], "dtype": "float32"}
    return out


async def send(worker: Any, sj: Any) -> int:
    """`job.fetch` what="optim": one message per parameter to the driver; returns the count."""
    msgs = state_of(sj)
    for idx, name in enumerate(msgs):
        meta = {"job": sj.job, "stage": sj.stage, "step": -1, "mb": idx}
        await worker.t.send(sj.driver, tensor_message(TensorKind.OPT_STATE, meta, msgs[name]))
    return len(msgs)


async def load(worker: Any, sj: Any, count: int) -> None:
    """Before `job.start` answers: the `count` state messages the driver sent, loaded into the
    stage's new optimizer (every parameter's, or the stage refuses)."""
    flat = _flat(sj)
    if flat is None or count != len(sj.params):
        raise JobError(
            ErrorCode.BAD_REQUEST,
            f"{count} optimizer-state messages for a stage with {len(sj.params)} parameters"
            + ("" if flat is not None else " and no local optimizer"),
        )
    want = expected(sj)
    got: dict[str, torch.Tensor] = {}
    for idx in range(count):
        msg, src = await worker.t.mailbox.get(
            (TensorKind.OPT_STATE, sj.job, -1, idx, sj.stage), worker.config.step_timeout_s, sender=sj.driver
        )
        got.update(decode_checked(msg, want, None, src))
    if set(got) != set(want):
        raise JobError(
            ErrorCode.BAD_TENSOR, f"optimizer state missing: {sorted(set(want) - set(got))[:4]}", sj.driver
        )
    state = {kind: {n: got[f"{n}|{kind}"] for n in sj.params} for kind in flat.state}
    steps = {n: int(got[f"{n}|{STEPS}"].item()) for n in sj.params}
    flat.load_state_dict({"steps": steps, "state": state})


def split(msgs: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The driver's side: fetched `<name>|<kind>` tensors -> name -> {that name's tensors}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in msgs.items():
        out.setdefault(key.rsplit("|", 1)[0], {})[key] = t
    return out
