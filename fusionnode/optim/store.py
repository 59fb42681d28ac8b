"""Parameter store of an optimizer host: fp32 masters, gradient contributions, one update per step.

Contributions. Each step, every parameter name expects gradients from a planned set of
contributors (ExpectedContributions). A contributor key names one (replica, stage) — or any
other unit that pushes — and maps to its `Contributor(replica, samples)`: the data-parallel
replica it belongs to and the sample count the plan gave that replica. A tied weight (GPT-2's
wte) gets contributions from two stages of the same replica; both count.

Aggregation. A contributor pushes its *mean* gradient over the samples its replica processed
(the gradient of the replica's mean loss), with that sample count `n` (1 <= n <= planned; a
claim above the plan is rejected, so a replica's weight is bounded by the plan, never by what a
peer claims). Contributors of one replica must report the same `n`. The replica's gradient is the
sum of its contributors' gradients (partial gradients of a tied weight add up); the step's
gradient for a name is the sample-weighted mean over replicas:

    g(name) = sum_r n_r * (sum_{c in r} g_c) / sum_r n_r

which equals the mean gradient over all the samples of the step. When a step is forced (its
deadline passed), only what arrived is used; a replica whose contributions to a name are
incomplete (one stage of a tied weight missing) is dropped for that name (counted in
`dropped_partial`), since a partial gradient would be biased. A name that received no complete
replica is not updated that step, and its optimizer step count does not advance.

Memory: a replica with one contributor for a name is folded at once into one fp32 running
weighted mean per (step, name); a replica with several keeps one extra partial sum until it
completes (a step's contributions so far: optim/pending.py).

Idempotency. A push is keyed by (step, contributor, name): a retry of an accepted push is
answered `duplicate=True` and not counted again (the first accepted payload wins). Rejected
pushes record nothing, so a corrected retry can still be accepted.

Steps are numbered from 1; `applied_step` is 0 before the first update. Pushes are accepted for
steps applied_step+1 .. applied_step+max_pending_steps. Steps are applied in order, each once.

Thread-safety. Every public method may be called from any thread. Bookkeeping and gradient
accumulation run under a short lock (`push` does at most one add of the pushed tensor under it);
`apply` runs the optimizer math under a separate apply lock, so pushes for the next step proceed
while a step is being applied (pushes for the step being applied are stale). `get_params` and
`state_dict` wait for a running apply. An asyncio servicer may call `push` directly and should
call `apply`, `maybe_apply_due`, `get_params` and `state_dict` through `asyncio.to_thread` when
the shard is large.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from fusionnode.errors import ConfigError, FusionNodeError
from fusionnode.optim.contributions import Contributor, ExpectedContributions
from fusionnode.optim.optimizers import FlatOptimizer, OptimizerConfig
from fusionnode.optim.pending import PendingStep
from fusionnode.optim.snapshot import keep_state, restore_state

logger = logging.getLogger(__name__)

DEFAULT_STEP_DEADLINE_S = 60.0  # seconds from a step's first accepted push until it may be forced
DEFAULT_MAX_PENDING_STEPS = 2  # pushes accepted for applied_step+1 .. applied_step+this
RESULT_HISTORY = 64  # ApplyResults kept for idempotent re-apply answers
DEFAULT_GRAD_DTYPES = frozenset({torch.float32})

COUNTER_NAMES = (
    "pushes",  # accepted pushes
    "duplicates",
    "rejected_shape",
    "rejected_dtype",
    "rejected_nonfinite",
    "rejected_stale",
    "rejected_future",
    "rejected_unknown",  # contributor not expected for that name
    "rejected_unknown_name",
    "rejected_samples",  # samples < 1 or above the plan
    "rejected_samples_mismatch",  # contributors of one replica disagree on samples
    "applied",
    "forced",
    "empty_steps",  # forced steps that had no contribution at all
    "dropped_partial",  # (name, replica) pairs left out of a forced step as incomplete
    "rolled_back",  # applied steps undone (a spot-check caught a worker lying in them)
)


class StepOrderError(FusionNodeError, ValueError):
    """apply() for a step that is not the next one."""


class StepNotReadyError(FusionNodeError, LookupError):
    """get_params(min_step=...) before that step was applied."""


class UnknownParameterError(FusionNodeError, KeyError):
    """A parameter name this store does not hold."""


@dataclass(frozen=True)
class PushResult:
    accepted: bool  # counted now (False for duplicates and rejects)
    duplicate: bool = False
    reason: str | None = None  # counter name of the rejection, None when accepted or duplicate
    name_complete: bool = False  # all expected contributions for (step, name) have arrived
    step_complete: bool = False  # ... for every name of this store


@dataclass(frozen=True)
class ApplyResult:
    step: int
    applied: bool  # the update of `step` has been applied (now or earlier)
    forced: bool = False
    lr: float = 0.0
    updated: tuple[str, ...] = ()  # names that received an update
    missing: tuple[str, ...] = ()  # contributor keys with at least one missing contribution
    replica_samples: Mapping[str, int] = field(default_factory=dict)  # replicas used -> samples
    grad_norm: float = math.nan  # pre-clip norm over this store's grads (when clipping locally)
    detail: str = ""


class ParameterStore:
    """fp32 masters and optimizer state of one shard; see the module docstring for the semantics."""

    def __init__(
        self,
        job_id: str,
        params: Mapping[str, Tensor],
        opt: OptimizerConfig,
        expected: ExpectedContributions,
        *,
        clock: Callable[[], float] = time.monotonic,
        step_deadline_s: float = DEFAULT_STEP_DEADLINE_S,
        max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS,
        lr_for_step: Callable[[int], float] | None = None,
        grad_dtypes: frozenset[torch.dtype] = DEFAULT_GRAD_DTYPES,
        clip: float | None = None,
    ) -> None:
        missing = set(params) - set(expected.by_name)
        extra = set(expected.by_name) - set(params)
        if missing or extra:
            raise ConfigError(
                f"expected contributions do not cover the params: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
            )
        if step_deadline_s <= 0 or max_pending_steps < 1:
            raise ConfigError("step_deadline_s must be > 0 and max_pending_steps >= 1")
        self.job_id = job_id
        self.opt_config = opt
        self.expected = expected
        self._clock = clock
        self.step_deadline_s = step_deadline_s
        self.max_pending_steps = max_pending_steps
        self._lr_for_step = lr_for_step or (lambda _step: opt.lr)
        self._grad_dtypes = frozenset(grad_dtypes)
        self.clip = clip  # --contrib-policy: the replicas' norm floor (optim/robust.py), None: off
        self._replica_size: dict[tuple[str, str], int] = {}  # (name, replica) -> contributors
        for name, contribs in expected.by_name.items():
            for c in contribs.values():
                self._replica_size[(name, c.replica)] = self._replica_size.get((name, c.replica), 0) + 1
        masters = {n: p.detach().to(torch.float32, copy=True).contiguous() for n, p in params.items()}
        self._opt = FlatOptimizer(masters, opt)
        self._lock = threading.Lock()  # bookkeeping and accumulation
        self._apply_lock = threading.Lock()  # optimizer math, params reads
        self._applied_step = 0
        self._applying: int | None = None
        self._pending: dict[int, PendingStep] = {}
        self._results: OrderedDict[int, ApplyResult] = OrderedDict()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._previous: dict[str, Any] | None = None  # kept states (snapshot.py): `keep` and
        self._marked: dict[str, Any] | None = None  # `mark` of apply(), for rollback()

    # ----------------------------------------------------------------- properties
    @property
    def applied_step(self) -> int:
        with self._lock:
            return self._applied_step

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._opt.params)

    # ----------------------------------------------------------------------- push
    def _reject(self, reason: str) -> PushResult:
        self._counters[reason] += 1
        logger.debug("push rejected: %s", reason)
        return PushResult(accepted=False, reason=reason)

    def push(
        self, step: int, contributor: str, name: str, grad: Tensor, samples: int, *, owned: bool = False
    ) -> PushResult:
        """Record one gradient contribution (see the module docstring); never raises on bad input.

        `owned=True` lets the store keep `grad` itself as an accumulator (saves a copy; for a
        tensor freshly decoded from the wire that nobody else holds). Otherwise `grad` is never
        modified.
        """
        master = self._opt.params.get(name)
        with self._lock:
            if master is None:
                return self._reject("rejected_unknown_name")
            planned = self.expected.by_name[name].get(contributor)
            if planned is None:
                return self._reject("rejected_unknown")
            done = self._applied_step if self._applying is None else self._applying
            if step <= done:
                return self._reject("rejected_stale")
            if step > self._applied_step + self.max_pending_steps:
                return self._reject("rejected_future")
            pend = self._pending.get(step)
            if pend is not None and (contributor, name) in pend.seen:
                self._counters["duplicates"] += 1
                return PushResult(
                    accepted=False,
                    duplicate=True,
                    name_complete=pend.remaining[name] == 0,
                    step_complete=pend.complete(),
                )
            if not isinstance(grad, Tensor) or grad.layout != torch.strided:
                return self._reject("rejected_dtype")
            if grad.dtype not in self._grad_dtypes:
                return self._reject("rejected_dtype")
            if tuple(grad.shape) != tuple(master.shape):
                return self._reject("rejected_shape")
            if (
                not isinstance(samples, int)
                or isinstance(samples, bool)
                or not 1 <= samples <= planned.samples
            ):
                return self._reject("rejected_samples")
            rkey = (name, planned.replica)
            if pend is not None and pend.samples.get(rkey, samples) != samples:
                return self._reject("rejected_samples_mismatch")
            g = grad.detach().to(device=master.device, dtype=torch.float32)
            if g.numel() and not _all_finite(g):
                return self._reject("rejected_nonfinite")
            if pend is None:
                pend = self._pending[step] = PendingStep(self._clock(), self.expected, self.clip)
            owned = owned or g.data_ptr() != grad.data_ptr()  # .to() above made a private copy
            self._accumulate(pend, name, contributor, planned, g, samples, owned=owned)
            self._counters["pushes"] += 1
            return PushResult(
                accepted=True, name_complete=pend.remaining[name] == 0, step_complete=pend.complete()
            )

    def _accumulate(
        self,
        pend: PendingStep,
        name: str,
        contributor: str,
        planned: Contributor,
        g: Tensor,
        n: int,
        *,
        owned: bool,
    ) -> None:
        pend.seen.add((contributor, name))
        pend.remaining[name] -= 1
        if pend.remaining[name] == 0:
            pend.names_left -= 1
        rkey = (name, planned.replica)
        pend.samples[rkey] = n
        in_replica = self._replica_size[rkey]
        if in_replica == 1:
            pend.fold(name, planned.replica, g, n, owned=owned)
            return
        part = pend.partial.get(rkey)
        if part is None:
            part = pend.partial[rkey] = [g if owned else g.clone(), n, 0]
        else:
            part[0].add_(g)
        part[2] += 1
        if part[2] == in_replica:
            del pend.partial[rkey]
            pend.fold(name, planned.replica, part[0], n, owned=True)

    # ---------------------------------------------------------------------- apply
    def ready(self, step: int) -> bool:
        """Whether every expected contribution for `step` has arrived (True for applied steps)."""
        with self._lock:
            if step <= self._applied_step:
                return True
            pend = self._pending.get(step)
            return pend is not None and pend.complete()

    def missing(self, step: int) -> dict[str, tuple[str, ...]]:
        """{name: contributor keys not yet received} for a pending step."""
        with self._lock:
            pend = self._pending.get(step)
            seen = pend.seen if pend is not None else set()
            out = {}
            for name, contribs in self.expected.by_name.items():
                left = tuple(sorted(c for c in contribs if (c, name) not in seen))
                if left:
                    out[name] = left
            return out

    def pending_grad_sq_norm(self, step: int) -> float:
        """Squared L2 norm of the aggregated gradient of `step` so far (complete replicas only).

        For a global-norm clip across shards: sum this over hosts, then pass
        `clip_coefficient(total, max_norm)` as `clip_coef` to every host's apply().
        """
        with self._lock:
            pend = self._pending.get(step)
            if pend is None:
                return 0.0
            return FlatOptimizer.grad_sq_norm(pend.grads())

    def apply(
        self,
        step: int,
        lr: float | None = None,
        *,
        force: bool = False,
        clip_coef: float | None = None,
        keep: bool = False,
        mark: bool = False,
    ) -> ApplyResult:
        """Apply `step` once: when all contributions arrived, or with what arrived when `force`.

        Returns applied=False (and the missing contributors) when not ready and not forced.
        Re-applying an applied step returns the earlier result. A forced step with no
        contribution at all advances `applied_step` without updating anything.
        Raises StepOrderError for a step beyond applied_step + 1. `keep`|`mark`: see `rollback`.
        """
        with self._apply_lock:
            with self._lock:
                if step <= self._applied_step:
                    earlier = self._results.get(step)
                    if earlier is not None:
                        return earlier
                    return ApplyResult(
                        step=step, applied=True, detail="applied earlier; result no longer kept"
                    )
                if step != self._applied_step + 1:
                    raise StepOrderError(f"cannot apply step {step}: next step is {self._applied_step + 1}")
                pend = self._pending.get(step)
                complete = pend is not None and pend.complete()
                if not complete and not force:
                    missing = self._missing_keys(pend)
                    return ApplyResult(
                        step=step,
                        applied=False,
                        missing=missing,
                        detail=f"waiting for {len(missing)} contributor(s)",
                    )
                self._pending.pop(step, None)
                self._applying = step
            kept = keep_state(self._opt, self._applied_step, self._previous) if keep else None
            self._previous = kept
            if mark:
                self._marked = keep_state(self._opt, self._applied_step, self._marked)
            try:
                result = self._apply_pending(
                    step, pend, lr, force=force and not complete, clip_coef=clip_coef
                )
            finally:
                with self._lock:
                    self._applying = None
            with self._lock:
                self._applied_step = step
                self._results[step] = result
                while len(self._results) > RESULT_HISTORY:
                    self._results.popitem(last=False)
                self._counters["applied"] += 1
                if result.forced:
                    self._counters["forced"] += 1
                if not result.updated:
                    self._counters["empty_steps"] += 1
                self._counters["dropped_partial"] += len(pend.partial) if pend is not None else 0
            return result

    def _missing_keys(self, pend: PendingStep | None) -> tuple[str, ...]:
        seen = pend.seen if pend is not None else set()
        keys = {
            c for name, contribs in self.expected.by_name.items() for c in contribs if (c, name) not in seen
        }
        return tuple(sorted(keys))

    def _apply_pending(
        self, step: int, pend: PendingStep | None, lr: float | None, *, force: bool, clip_coef: float | None
    ) -> ApplyResult:
        lr = self._lr_for_step(step) if lr is None else float(lr)
        if pend is None:
            logger.warning("step %d forced with no contribution at all: nothing updated", step)
            return ApplyResult(step=step, applied=True, forced=True, lr=lr, missing=self._missing_keys(None))
        grads = pend.grads()
        if pend.partial:
            logger.warning(
                "step %d: dropped %d incomplete (name, replica) contributions", step, len(pend.partial)
            )
        with torch.no_grad():
            norm = self._opt.step(grads, lr, clip_coef=clip_coef)
        replica_samples: dict[str, int] = {}
        for reps in pend.replicas.values():
            replica_samples.update(reps)
        if force:
            logger.info("step %d forced: %d/%d names updated", step, len(grads), len(self._opt.params))
        return ApplyResult(
            step=step,
            applied=True,
            forced=force,
            lr=lr,
            updated=tuple(sorted(grads)),
            missing=self._missing_keys(pend),
            replica_samples=MappingProxyType(replica_samples),
            grad_norm=norm,
        )

    def next_deadline(self) -> float | None:
        """Clock time at which the next step may be forced (None: nothing pending)."""
        with self._lock:
            pend = self._pending.get(self._applied_step + 1)
            if pend is not None:
                return pend.first_push + self.step_deadline_s
            later = [p.first_push for p in self._pending.values()]
            return min(later) + self.step_deadline_s if later else None

    def maybe_apply_due(self, now: float | None = None) -> list[int]:
        """Apply, in order, every next step that is complete or past its deadline; returns them.

        A step's deadline is `step_deadline_s` after its first accepted push. A next step that
        received nothing is applied empty only when a later step is already past its deadline
        (the job has moved on without it).
        """
        now = self._clock() if now is None else now
        done: list[int] = []
        while True:
            with self._lock:
                step = self._applied_step + 1
                pend = self._pending.get(step)
                if pend is not None:
                    complete = pend.complete()
                    due = now - pend.first_push >= self.step_deadline_s
                else:
                    complete = False
                    due = any(now - p.first_push >= self.step_deadline_s for p in self._pending.values())
            if not (complete or due):
                return done
            result = self.apply(step, force=not complete)
            if not result.applied:
                return done
            done.append(step)

    # -------------------------------------------------------------------- re-plans
    def replan(self, expected: ExpectedContributions) -> list[int]:
        """Adopt a new plan's contributors: every pending (not applied) step's contributions are
        dropped, so a step replayed under the new plan is applied once, with exactly the new
        contributors' gradients. Returns the steps whose contributions were dropped."""
        missing = set(self._opt.params) - set(expected.by_name)
        extra = set(expected.by_name) - set(self._opt.params)
        if missing or extra:
            raise ConfigError(
                f"expected contributions do not cover the params: missing {sorted(missing)[:5]}, "
                f"extra {sorted(extra)[:5]}"
            )
        sizes: dict[tuple[str, str], int] = {}
        for name, contribs in expected.by_name.items():
            for c in contribs.values():
                sizes[(name, c.replica)] = sizes.get((name, c.replica), 0) + 1
        with self._apply_lock, self._lock:
            dropped = sorted(self._pending)
            self._pending.clear()
            self.expected = expected
            self._replica_size = sizes
        if dropped:
            logger.info("re-plan: dropped the pending contributions of steps %s", dropped)
        return dropped

    def rollback(self, step: int) -> bool:
        """Back to the state after `step` kept by `apply(step + 1, keep|mark)` (`keep`: until the next
        step; `mark`: until the next mark), pending pushes dropped; whether a step was undone.
        StepOrderError when the store cannot go back to `step`."""
        with self._apply_lock:
            with self._lock:
                applied = self._applied_step
                self._pending.clear()
            prev = self._previous if applied == step + 1 else None
            kept = [k for k in (prev, self._marked) if k is not None and k["applied_step"] == step]
            if applied == step:
                return False
            if not kept:
                raise StepOrderError(f"cannot roll back to step {step} (applied {applied}): not kept")
            restore_state(self._opt, kept[0])
            self._previous = None
            with self._lock:
                self._applied_step = step
                self._counters["rolled_back"] += applied - step
            return True

    def update_masters(self, fn: Callable[[dict[str, Tensor]], Any], applied_step: int | None = None) -> Any:
        """Runs `fn` on the fp32 masters (updated in place) under the apply lock: the outer step of a
        --sync round (issue 19). With `applied_step`, the store counts the steps the round covered as
        applied (the round ledger a re-plan or a checkpoint reads). Returns what `fn` returns."""
        with self._apply_lock:
            if applied_step is not None and applied_step <= self.applied_step:
                raise StepOrderError(
                    f"a round ending at step {applied_step} is applied already (at {self.applied_step})"
                )
            out = fn(self._opt.params)
            if applied_step is not None:
                with self._lock:
                    self._applied_step = int(applied_step)
            return out

    # ----------------------------------------------------------------- parameters
    def get_params(
        self,
        names: Iterable[str] | None = None,
        min_step: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[int, dict[str, Tensor]]:
        """(applied_step, {name: copy of the current value}) cast to `dtype` (default fp32).

        Raises StepNotReadyError when min_step has not been applied yet, UnknownParameterError
        for a name this store does not hold.
        """
        with self._apply_lock:
            step = self.applied_step
            if min_step is not None and step < min_step:
                raise StepNotReadyError(f"step {min_step} not applied yet (applied: {step})")
            wanted = list(self._opt.params) if names is None else list(names)
            unknown = [n for n in wanted if n not in self._opt.params]
            if unknown:
                raise UnknownParameterError(f"unknown parameters: {unknown[:5]}")
            dt = torch.float32 if dtype is None else dtype
            return step, {n: self._opt.params[n].to(dt, copy=True) for n in wanted}

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """A consistent copy: job_id, applied_step, fp32 params, optimizer steps and state.

        Pending (not yet applied) contributions are not included: after a restore, contributors
        re-push for the next step.
        """
        with self._apply_lock:
            osd = self._opt.state_dict()
            return {
                "job_id": self.job_id,
                "applied_step": self.applied_step,
                "optimizer_config": self.opt_config.to_json(),
                "params": {n: p.clone() for n, p in self._opt.params.items()},
                "steps": dict(osd["steps"]),
                "state": {k: {n: t.clone() for n, t in v.items()} for k, v in osd["state"].items()},
            }

    def start_at(self, step: int) -> None:
        """A fresh store that continues a job after `step` (parameters from the driver's checkpoint,
        new optimizer state): the next step it applies is step + 1."""
        with self._lock:
            if self._applied_step != 0 or self._pending or step < 0:
                raise StepOrderError(f"cannot start at step {step}: the store has applied or pending steps")
            self._applied_step = int(step)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore a state_dict() of the same job and shard; drops pending contributions."""
        if sd["job_id"] != self.job_id:
            raise ConfigError(f"state of job {sd['job_id']!r} cannot load into job {self.job_id!r}")
        if OptimizerConfig.from_json(sd["optimizer_config"]) != self.opt_config:
            raise ConfigError("checkpoint optimizer config differs from this store's")
        params = sd["params"]
        if set(params) != set(self._opt.params):
            raise ConfigError("checkpoint parameter names differ from this store's")
        for n, p in self._opt.params.items():
            if tuple(params[n].shape) != tuple(p.shape):
                raise ConfigError(
                    f"checkpoint shape of {n!r} is {tuple(params[n].shape)}, expected {tuple(p.shape)}"
                )
        with self._apply_lock:
            self._opt.load_state_dict({"steps": sd["steps"], "state": sd["state"]})
            for n, p in self._opt.params.items():
                p.copy_(params[n])
            with self._lock:
                self._applied_step = int(sd["applied_step"])
                self._pending.clear()
                self._results.clear()


def _all_finite(t: Tensor) -> bool:
    """No NaN or +-Inf in `t` (non-empty): one min/max pass, no tensor-sized temporary."""
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))
