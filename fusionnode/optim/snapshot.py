"""A parameter store's state kept in memory to go back to: a spot-checked job's optimizer hosts keep
the state at the start of its plan (the mark), and undo every step since when a check finds that a
worker lied in one of them (ParameterStore.apply with `mark`, ParameterStore.rollback)."""

from __future__ import annotations

from typing import Any

from fusionnode.optim.optimizers import FlatOptimizer


def keep_state(opt: FlatOptimizer, applied_step: int, into: dict[str, Any] | None) -> dict[str, Any]:
    """The optimizer's parameters and state now, copied into `into`'s buffers when it has them."""
    osd = opt.state_dict()
    tensors = {("params", n): p for n, p in opt.params.items()}
    tensors.update({(k, n): t for k, v in osd["state"].items() for n, t in v.items()})
    if into is not None and set(into["tensors"]) == set(tensors):
        for key, t in tensors.items():
            into["tensors"][key].copy_(t)
    else:
        into = {"tensors": {key: t.clone() for key, t in tensors.items()}}
    into["applied_step"] = applied_step
    into["steps"] = dict(osd["steps"])
    return into


def restore_state(opt: FlatOptimizer, kept: dict[str, Any]) -> None:
    """Puts `keep_state`'s copy back into the optimizer, in place."""
    state: dict[str, dict[str, Any]] = {}
    for (kind, n), t in kept["tensors"].items():
        if kind == "params":
            opt.params[n].copy_(t)
        else:
            state.setdefault(kind, {})[n] = t
    opt.load_state_dict({"steps": kept["steps"], "state": state})


__all__ = ["keep_state", "restore_state"]
