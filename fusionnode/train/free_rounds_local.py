"""The in-process reference of rounds closed by time (`train --local --round-close time --round-steps`).

Under ``--round-close time`` (train/free_rounds.py) each replica runs its own inner steps at its own
pace, and round q closes when the fastest replica has done H of them (fewer in the job's last round):
the others finish the step they are in and send their pseudo-gradients too. Which replica did how
many steps in which round depends on the machines, so the swarm records it (each round's record
lists every replica's `steps`) and this reference replays a given schedule: `round_steps[q][r]`,
the inner steps replica r did in round q.

Replica r's k-th inner step of round q is the job's step s = q·H + k (as if rounds closed by step
count): its data is replica r's share of step s's batch (`BatchSource.shard_batches`), its learning
rate `lr_at(s)`, its dropout seed step s's. Its pseudo-gradient weighs the tokens fed to it in the
round (its share x the sequence length x its steps). Everything else is `train/replicas.py`'s: the
outer step of `optim.rounds`, and with `sync.overlap` the round's update applied after the D-th inner
step of the next round, or at the replica's next close if it does fewer (each replica on its own, as
each stage does on the workers: `runtime/rounds.py`); the job's last round is installed at once.

Faults (train/free_recovery.py): a replica that lost its round has 0 steps in it and no part in its
outer step; the rounds the swarm ran on a new plan (`restart`: new inner optimizers, every replica
from θ; `fresh_outer`: hosts restored with new outer state) come from its metrics file too
(`load_restarts`), and a round redone there is replayed as its last run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import ConfigError
from fusionnode.optim.rounds import RoundCombiner, pseudo_gradient
from fusionnode.sync import SyncConfig
from fusionnode.train.local import DivergenceError, evaluate
from fusionnode.train.spec import JobSpec


def round_count(spec: JobSpec, sync: SyncConfig) -> int:
    """Rounds of a job of `spec.steps` steps of the fastest replica: ceil(steps / H)."""
    return -(-spec.steps // sync.inner_steps)


def round_limit(spec: JobSpec, sync: SyncConfig, q: int) -> int:
    """Inner steps of the fastest replica in round q: H, or what is left of the job in its last."""
    return min(sync.inner_steps, spec.steps - q * sync.inner_steps)


def check_schedule(spec: JobSpec, sync: SyncConfig, replicas: int, schedule: Any) -> list[list[int]]:
    """`schedule` as a list of per-round lists of step counts; ConfigError naming --round-steps when
    it does not fit the job: one round per ceil(steps / H), one count per replica, each in
    [0, the round's limit] (0: the replica lost its round, a worker died), not all 0, and some
    replica at the limit (the one that closed the round) unless one lost its round (it may have
    been the one at the limit)."""
    rounds = round_count(spec, sync)
    if not isinstance(schedule, list) or len(schedule) != rounds:
        n = len(schedule) if isinstance(schedule, list) else type(schedule).__name__
        raise ConfigError(f"--round-steps: {n} rounds given; the job has {rounds} (steps {spec.steps}, H)")
    out = []
    for q, counts in enumerate(schedule):
        limit = round_limit(spec, sync, q)
        if (
            not isinstance(counts, list)
            or len(counts) != replicas
            or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= limit for c in counts)
            or not any(counts)
        ):
            raise ConfigError(
                f"--round-steps: round {q} needs {replicas} step counts in [0, {limit}], not all 0 "
                f"(0: a replica that lost its round), got {counts!r:.80}"
            )
        if max(counts) != limit and 0 not in counts:
            raise ConfigError(f"--round-steps: round {q}: no replica did the round's {limit} steps")
        out.append([int(c) for c in counts])
    return out


def load_schedule(path: str) -> list[list[int]]:
    """The per-round step counts of `path`: a JSON list of lists, or a metrics file (JSON lines) of a
    swarm run under --round-close time (each round's record: `replicas[i].steps`). ConfigError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--round-steps {path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, list):
        return doc
    rounds = [[rep.get("steps") for rep in rec["replicas"]] for rec in _round_records(path, text)]
    if not rounds:
        raise ConfigError(f"--round-steps {path}: no round records (a run under --round-close time)")
    return rounds


def _round_records(path: str, text: str) -> list[dict[str, Any]]:
    """A metrics file's round records, the last run of each round (a round redone after a recovery
    is recorded again), in round order."""
    by_round: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(text.splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"--round-steps {path}: neither a JSON list nor a metrics file") from None
        if isinstance(rec, dict) and rec.get("type") == "step" and isinstance(rec.get("replicas"), list):
            q = rec.get("round_closed")
            by_round[q if isinstance(q, int) else -1 - i] = rec
    return [by_round[q] for q in sorted(by_round, key=lambda q: (q < 0, q if q >= 0 else -q))]


def load_restarts(path: str) -> dict[str, Any]:
    """The rounds of a swarm run's metrics file that ran on a new plan, as `train_local_replicas`
    takes them: `restart_rounds` (new inner optimizers, every replica from θ), `fresh_outer_rounds`
    (the hosts restored with new outer state), `fresh_feedback_rounds` (sparseloco: new error
    feedback), `fresh_feedback_names` (round -> replica -> the names whose error feedback started
    new, the others' kept: a checkpoint that held part of it). None for a JSON list of counts."""
    text = Path(path).read_text()
    try:
        if isinstance(json.loads(text), list):
            return {}
    except json.JSONDecodeError:
        pass
    recs = _round_records(path, text)
    out: dict[str, Any] = {"restart_rounds": [], "fresh_outer_rounds": [], "fresh_feedback_rounds": []}
    for rec in recs:
        q = rec.get("round_closed")
        if not isinstance(q, int) or not rec.get("restart"):
            continue
        out["restart_rounds"].append(q)
        if rec.get("fresh_outer"):
            out["fresh_outer_rounds"].append(q)
        fresh = rec.get("fresh_feedback")
        if isinstance(fresh, dict) and fresh:
            names = {int(r): [str(n) for n in ns] for r, ns in fresh.items()}
            out.setdefault("fresh_feedback_names", {})[q] = names
        elif fresh:
            out["fresh_feedback_rounds"].append(q)
    return out


def replay_rounds(
    spec: JobSpec,
    sync: SyncConfig,
    shares: list[int],
    seq_len: int,
    schedule: list[list[int]],
    emit: Callable[[dict[str, Any]], None],
    eval_batches: int,
    on_round: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    restarts: tuple[frozenset[int], ...] = (frozenset(), frozenset(), frozenset()),
    fresh_names: Mapping[int, Mapping[int, Collection[str]]] | None = None,
) -> tuple[list[float], float, dict[str, torch.Tensor], RoundCombiner]:
    """Rounds closed by time, replaying `schedule`; emits one record per round (its last step of the
    fastest replica, the token-weighted loss, each replica's steps, tokens and loss). `restarts`:
    the rounds that start with new inner optimizers (every replica from θ), new outer state, new
    error feedback (`train_local_replicas`); `fresh_names`: round -> replica -> the names whose error
    feedback starts new at that round (the others' kept). Returns (the rounds' losses, the
    validation loss, θ, the combiner)."""
    from fusionnode.optim.outer import make_outer
    from fusionnode.optim.rounds import ReplicaSync
    from fusionnode.train.local import make_optimizer
    from fusionnode.train.replicas import _replica_step, _round_replicas, install_theta, settle_replica

    replicas = len(shares)
    schedule = check_schedule(spec, sync, replicas, schedule)
    h = sync.inner_steps
    source, models, opts, theta, senders, host, ms, starts, ends = _round_replicas(
        spec, sync, shares, seq_len
    )
    pending = [False] * replicas
    losses: list[float] = []

    def settle(r: int) -> None:  # θ_r ← θ_global + (θ_r − θ_end,r), θ_start,r ← θ_global
        settle_replica(models[r], theta, starts[r], ends[r])
        pending[r] = False

    for q, counts in enumerate(schedule):
        t0 = time.perf_counter()
        last = q == len(schedule) - 1
        if q in restarts[0]:  # the swarm's new stages: θ, new inner optimizers (no update due)
            opts = [make_optimizer(mdl, spec) for mdl in models]
            install_theta(models, theta)
            starts = [{n: t.clone() for n, t in theta.items()} for _ in range(replicas)]
            pending = [False] * replicas
        if q in restarts[1]:
            host.outer = make_outer(sync)
        if q in restarts[2]:
            senders = [ReplicaSync(sync) for _ in range(replicas)]
        for r, names in (fresh_names or {}).get(q, {}).items():
            fb = senders[r].feedback if 0 <= r < replicas else None
            for name in names if fb is not None else ():
                fb.acc.pop(name, None)  # a new accumulator, as a stage given none of this name
        reps = []
        for r in range(replicas):
            if not counts[r]:  # it lost its round: no part in the outer step (a new plan follows)
                reps.append({"replica": r, "steps": 0, "tokens": 0, "loss": None, "lost": True})
                continue
            rlosses = []
            for k in range(counts[r]):
                step = q * h + k
                batch = source.shard_batches(step, shares)[r]
                rlosses.append(_replica_step(models[r], opts[r], batch, ms[r], step, spec))
                if k < counts[r] - 1 and pending[r] and sync.applies_delayed(step):
                    settle(r)
            if pending[r]:  # a replica that did fewer than D steps: at its close
                settle(r)
            end = {n: p for n, p in models[r].named_parameters() if p.requires_grad}
            if sync.overlap:
                ends[r] = {n: p.detach().float().clone() for n, p in end.items()}
            delta = pseudo_gradient(starts[r] if sync.overlap else theta, end)
            tokens = shares[r] * seq_len * counts[r]
            host.add(q, r, tokens, senders[r].encode(delta))
            reps.append(
                {"replica": r, "steps": counts[r], "tokens": tokens, "loss": sum(rlosses) / len(rlosses)}
            )
        before = host.received_bytes + host.sent_bytes
        theta = {n: t.clone() for n, t in theta.items()} if sync.overlap else theta
        host.close(theta, verdict=[1.0 if c else 0.0 for c in counts] if 0 in counts else None)
        if not sync.overlap or last:
            install_theta(models, theta)
        else:
            pending = [True] * replicas
        tokens = sum(x["tokens"] for x in reps)
        loss = sum(x["loss"] * x["tokens"] for x in reps if x["tokens"]) / tokens
        if not math.isfinite(loss):
            raise DivergenceError(f"round {q}: loss is {loss}; lower --lr or --outer-lr")
        losses.append(loss)
        emit(
            {
                "step": q * h + round_limit(spec, sync, q) - 1,
                "loss": loss,
                "tokens": tokens,
                "round": q,
                "round_closed": q,
                "replicas": reps,
                "step_time_s": time.perf_counter() - t0,
                "wire_bytes": host.received_bytes + host.sent_bytes - before,
                "optimizer_hosts": [
                    {"host": 0, "received_bytes": host.received_bytes, "sent_bytes": host.sent_bytes}
                ],
            }
        )
        if on_round is not None:
            on_round(q, {n: t.clone() for n, t in theta.items()})
    return losses, evaluate(models[0], source, eval_batches), dict(theta), host


def token_verdict(counts: Sequence[int]) -> list[float]:
    """The driver's verdict of a round closed by time (`opt.round_verdict`): each replica's inner steps
    over the round's most. A host weighs a replica by the plan's samples per step x this, so its weight
    is the tokens the driver fed it, up to a factor common to the round (never what a worker claims)."""
    top = max(counts)
    if top < 1 or min(counts) < 0:
        raise ValueError(f"step counts {list(counts)}: a round needs a replica with steps")
    return [c / top for c in counts]
