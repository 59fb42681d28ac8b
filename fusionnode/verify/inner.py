"""Spot-checks under `--sync diloco|sparseloco` (issue 20): the stages' inner steps.

Within a round each worker trains its stage with its own inner optimizer (AdamW), so the
parameters a step computed with are the worker's, not the optimizer hosts'. Three commitments in
each step's report (made before the worker learns anything of the step's checks) bind them:

- ``params``: the stage's parameters the step computes with (as in `--offload off`),
- ``opt``: its inner optimizer's state at the step's start (`inner_opt_state`: AdamW's moments, its step
  counts, fp32 masters of other-precision parameters),
- ``grads``: the parameter gradients the step accumulated (before the tied-weight sum and the clip
  the driver sends with the commit).

A checked stage's parameters are fetched from its worker, per stage (each replica's differ: `scoped`,
`stage_params`), and must match ``params`` before the recompute uses them; a gradient check's shown
gradients must match ``grads``. The **transition check** verifies an inner step itself: step t of
a stage is drawn (train/inner_checks.py: at twice the gradient-check rate, by the driver's secret) only
once step t+1's report has committed the parameters and state that step t produced. Then the
worker shows what it kept of step t (`snapshot`, taken at the commit: parameters, state, raw
gradients) and its current parameters and state, each against its commitment; the driver applies
the same inner update (`expected_step`: the job's optimizer code on CPU, with the lr, clip and
tied-weight sums it sent) and compares (`compare_step`, relative to the update's size; the tolerance
is `TRANSITION_REL_TOL`). The worker keeps one snapshot, the last committed step's.

Not covered by the transition check: the last inner step of a round (its result becomes the round's
pseudo-gradient and is replaced by the round's outcome, so step t+1 does not show it), and under
`--sync-overlap` the steps whose commit re-bases the parameters on the previous round's result. Those
are bounded by the contribution score and the norm floor (verify/contrib.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fusionnode.verify.commitment import digest_tensors

SCOPE = "\x00stage{}\x00"  # prefix of a stage's own copy of a parameter among the fetched values
# the inner step's result against the driver's recompute, relative to the update's norm: on CPU both
# run the same float32 code, so they agree to rounding (~1e-7 measured: 0 in the tests); a worker on
# CUDA runs the same foreach kernels there, whose sqrt/div may differ by an ulp: 1e-3 (not measured)
TRANSITION_REL_TOL = {"cpu": 1e-4, "cuda": 1e-3}
PREV, NOW = "prev/", "now/"  # the inner fetch's two halves: step t's snapshot, the worker's state now


def scoped(stage: int, name: str) -> str:
    """The key of stage `stage`'s own value of parameter `name` (round modes: each replica's differ)."""
    return SCOPE.format(int(stage)) + name


def stage_params(params: Mapping[str, torch.Tensor], a: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Stage `a`'s parameters among `params`: its own copy where one was fetched (`scoped`), else the
    job's value (the hosts', or a frozen parameter)."""
    stage = a["stage"]
    return {
        n: params[scoped(stage, n)] if scoped(stage, n) in params else params[n] for n in a["param_specs"]
    }


# ---- the worker's side ---------------------------------------------------------------------------


def inner_opt_state(opt: Any) -> dict[str, torch.Tensor]:
    """A stage's inner optimizer state (an optim.optimizers.LocalOptimizer) as named tensors (views):
    ``<kind>/<name>`` per state kind, ``steps/<name>`` (int64), ``master/<name>`` (fp32 masters of
    parameters of another dtype)."""
    flat = opt.opt
    out: dict[str, torch.Tensor] = {}
    for kind, tensors in flat.state.items():
        out.update({f"{kind}/{n}": t for n, t in tensors.items()})
    out.update({f"steps/{n}": torch.tensor([s], dtype=torch.int64) for n, s in flat.steps.items()})
    out.update({f"master/{n}": flat.params[n] for n in getattr(opt, "_cast_back", ())})
    return out


def stage_values(sj: Any) -> dict[str, torch.Tensor]:
    """The parameters a stage's ``params`` commitment covers (views)."""
    named = sj.module.named_stage_parameters()
    return {n: named[n] for n in sj.param_specs}


def own_grads(sj: Any) -> dict[str, torch.Tensor]:
    """The gradients the step accumulated, as a gradient check is shown them (runtime/audit.py): zeros
    for a parameter without one (which the inner optimizer skips, and so does `expected_step`)."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in sj.params.items()}


def commit_step_start(sj: Any) -> dict[str, str]:
    """The ``opt`` commitment of a step's start (``params`` is the ledger's own)."""
    return {"opt": digest_tensors(inner_opt_state(sj.opt))}


def commit_step_end(sj: Any, ledger: Any = None) -> dict[str, str]:
    """The ``grads`` commitment, once the step's backward passes are done; a copy of them kept in
    `ledger` (what a gradient check audited while the next step runs is shown: runtime/audit.py)."""
    grads = {n: g.detach().clone() for n, g in own_grads(sj).items()}
    if ledger is not None:
        ledger.own_grads = grads
    return {"grads": digest_tensors(grads)}


def snapshot(sj: Any, step: int) -> None:
    """At step `step`'s commit, before its inner update: what a transition check of it is shown
    (copies, kept as `sj.inner_snap` until the next commit replaces them)."""
    with torch.no_grad():
        kept = {PREV + "param/" + n: t.detach().clone() for n, t in stage_values(sj).items()}
        kept.update({PREV + "opt/" + n: t.detach().clone() for n, t in inner_opt_state(sj.opt).items()})
        led = getattr(sj, "ledger", None)
        grads = led.own_grads if led is not None and led.own_grads else own_grads(sj)  # the committed copy
        kept.update({PREV + "grad/" + n: t.detach().clone() for n, t in grads.items()})
    sj.inner_snap = (step, kept)


def step(sj: Any, lr: float, liar: Any = None) -> None:
    """The stage's inner optimizer step from its parameters' ``.grad`` (the debug liar of kind
    ``update``, tests and `bench verify` only, scales the update it applies: verify/liar.py)."""
    if liar is None or liar.kind != "update":
        sj.opt.step(lr)
        return
    before = {n: p.detach().clone() for n, p in sj.params.items()}
    sj.opt.step(lr)
    liar.scale_update(sj.params, before)


def inner_fetch(sj: Any) -> dict[str, torch.Tensor]:
    """`job.fetch` what="inner": the kept snapshot (``prev/``), the current parameters and state
    (``now/``) and the snapshot's step (``at``)."""
    snap = getattr(sj, "inner_snap", None)
    if snap is None or sj.opt is None:
        return {}
    step, kept = snap
    out = dict(kept)
    out.update({NOW + "param/" + n: t.detach() for n, t in stage_values(sj).items()})
    out.update({NOW + "opt/" + n: t.detach() for n, t in inner_opt_state(sj.opt).items()})
    out["at"] = torch.tensor([step], dtype=torch.int64)
    return out


# ---- the driver's side ---------------------------------------------------------------------------


def split_fetch(got: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`inner_fetch`'s tensors by part: prev/param, prev/opt, prev/grad, now/param, now/opt."""
    out: dict[str, dict[str, torch.Tensor]] = {
        k: {} for k in ("prev/param", "prev/opt", "prev/grad", "now/param", "now/opt")
    }
    for key, t in got.items():
        for part, tensors in out.items():
            if key.startswith(part + "/"):
                tensors[key[len(part) + 1 :]] = t
                break
    return out


def expected_step(
    params: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    shared: Mapping[str, torch.Tensor],
    clip: float,
    lr: float,
    make_opt: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters and state after the inner step the worker should have applied at its commit
    (runtime/worker.py: the tied-weight sums replace its own gradients of those names, every gradient
    is scaled by `clip`, then `LocalOptimizer.step(lr)`), on copies. `make_opt(masters)`: the job's
    inner optimizer over them (optim.optimizers.FlatOptimizer with the job's config)."""

    stepped = [n for n in params if f"steps/{n}" in state]  # a frozen parameter has no inner state
    if not stepped:  # a stage with no trained parameter (the fusion planner may plan one): no step
        return dict(params), {}
    masters = {n: state.get(f"master/{n}", params[n]).detach().float().clone() for n in stepped}
    opt = make_opt(masters)
    kinds = {k.split("/", 1)[0] for k in state if k.split("/", 1)[0] not in ("steps", "master")}
    opt.load_state_dict(
        {
            "steps": {n: int(state[f"steps/{n}"].reshape(-1)[0]) for n in masters},
            "state": {kind: {n: state[f"{kind}/{n}"] for n in masters} for kind in kinds},
        }
    )
    applied: dict[str, torch.Tensor] = {}
    for n in stepped:
        g = shared[n] if n in shared else grads.get(n)
        if g is None or not bool(g.any()):  # no gradient this step: the worker's optimizer skips it
            continue
        g = g.to(params[n].dtype).clone()
        if clip != 1.0:
            g.mul_(clip)
        applied[n] = g.float()
    opt.step(applied, lr)
    out_params = {n: p for n, p in params.items()}  # frozen: unchanged
    out_params.update({n: opt.params[n].to(params[n].dtype) for n in stepped})
    out_state = {f"{kind}/{n}": t for kind, ts in opt.state.items() for n, t in ts.items()}
    out_state.update({f"steps/{n}": torch.tensor([s], dtype=torch.int64) for n, s in opt.steps.items()})
    out_state.update({f"master/{n}": opt.params[n] for n in params if f"master/{n}" in state})
    return out_params, out_state


def _rel(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    return float((got.double() - want.double()).norm()) / max(scale, 1e-30)


def update_error(
    before: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]
) -> tuple[float, float]:
    """(‖got − want‖, ‖want − before‖) over the parameters: an inner step's error and its size."""
    update = math.sqrt(sum(float((want[n].double() - before[n].double()).pow(2).sum()) for n in want))
    err = math.sqrt(sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want))
    return err, update


def compare_step(
    before: Mapping[str, torch.Tensor],
    want: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
    got: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
    rel_tol: float,
) -> str:
    """'' when the parameters and state a worker shows after an inner step are the recomputed ones
    within `rel_tol` (parameters: the error relative to the norm of the update, so a wrong step is
    seen however small the step; state: relative to the state's norm; step counts exactly); else
    the first difference."""
    (want_p, want_s), (got_p, got_s) = want, got
    if set(got_p) != set(want_p) or set(got_s) != set(want_s):
        return "showed other parameters or optimizer state than its stage holds"
    err, update = update_error(before, want_p, got_p)
    if err > rel_tol * update + 1e-12:
        return f"its inner step's parameters differ from the recomputed step (relative error {err / max(update, 1e-30):.3g} of the update, tolerance {rel_tol:g})"
    for key in sorted(want_s):
        w, g = want_s[key], got_s[key]
        if key.startswith("steps/"):
            if not torch.equal(g, w):
                return f"its inner optimizer's step count of {key[6:]!r} is {int(g.reshape(-1)[0])}, not {int(w.reshape(-1)[0])}"
            continue
        if g.shape != w.shape or _rel(g, w, float(w.double().norm())) > rel_tol:
            return f"its inner optimizer state {key!r} differs from the recomputed step"
    return ""


__all__ = [
    "NOW",
    "PREV",
    "TRANSITION_REL_TOL",
    "commit_step_end",
    "commit_step_start",
    "compare_step",
    "expected_step",
    "inner_fetch",
    "inner_opt_state",
    "own_grads",
    "scoped",
    "snapshot",
    "split_fetch",
    "stage_params",
    "stage_values",
    "step",
    "update_error",
]
