"""The in-process reference of R data-parallel replicas under a sync mode (`train --local --replicas R --sync`).

`--sync step`: the replicas' gradients are combined every step, which is exactly the
single-process trajectory (`local.train_step`); it runs that and counts the bytes the swarm's replicas
would exchange with the optimizer hosts (each replica's float32 gradients up, the parameters down).

`--sync diloco|sparseloco`: replica r holds its own copy of the model and its own inner optimizer
(`make_optimizer`, AdamW by default). Step t gives replica r its contiguous share of step t's batch
(`BatchSource.shard_batches`), split into at most `micro_batches` equal micro-batches; the replica
clips its own gradients and steps at `lr_at(t)`. Every H steps (and after the last) the round
closes through `optim.rounds`: the encoded pseudo-gradients, weighted by the tokens each replica
processed, give the outer step; every replica restarts from the new θ, keeping its inner state.
With `sync.overlap` the round's outer step reaches the replicas late, as on the workers
(runtime/rounds.py): at round r's close replica i sends Δ = θ_start,i − θ_i and goes on from its θ_i
(θ_end,i); after D = `sync.delay` inner steps of the next round (D = H: at its close, before its Δ)
θ_i ← θ_global(r) + (θ_i − θ_end,i) and θ_start,i ← θ_global(r); after the last round, and after a
round the job is checkpointed at, and after each round of the warm-up (`--sync-warmup W`: the
first W steps in rounds of `warmup_inner_steps`; `SyncConfig.settles_at_close`), every replica
takes θ_global at once; a redone round (`restart_rounds`) starts every replica from θ_global, as the swarm's new stages do.

Bytes are counted as the swarm sends them: each encoded tensor's msgpack form (descriptor and
payload), up from every replica and down to every replica; frame headers are not counted.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusionnode.errors import ConfigError
from fusionnode.optim.optimizers import FlatOptimizer, clip_coefficient
from fusionnode.optim.outer import make_outer
from fusionnode.optim.rounds import ReplicaSync, RoundCombiner, pseudo_gradient
from fusionnode.sync import SyncConfig
from fusionnode.train.data import BatchSource, loss_scale, step_seed
from fusionnode.train.local import (
    EVAL_BATCHES,
    DivergenceError,
    build_job_model,
    evaluate,
    lm_loss,
    make_optimizer,
    set_lr,
    train_step,
)
from fusionnode.train.metrics import MetricsWriter
from fusionnode.train.spec import JobSpec, lr_at, resolve_seq_len
from fusionnode.wire.tensors import encode_tensor, pack_encoded


@dataclass(frozen=True)
class ReplicasResult:
    """What a replicated reference run produced; `records[i]` is step i's record."""

    spec: JobSpec
    sync: SyncConfig
    replicas: int
    losses: tuple[float, ...]
    val_loss: float
    params: dict[str, torch.Tensor]
    records: tuple[dict[str, Any], ...]
    bytes_up: int  # cumulative, replicas -> hosts
    bytes_down: int  # cumulative, hosts -> replicas
    rounds: int


def resolve_shares(spec: JobSpec, replicas: int, shares: Sequence[int] | None) -> list[int]:
    """Samples per replica of each step's batch: `shares`, or an even split. ConfigError naming the option."""
    if shares is None:
        if replicas < 1:
            raise ConfigError(f"--replicas {replicas}: must be >= 1")
        if spec.batch_size % replicas:
            raise ConfigError(f"--replicas {replicas}: batch size {spec.batch_size} does not split evenly")
        return [spec.batch_size // replicas] * replicas
    shares = [int(s) for s in shares]
    if min(shares, default=0) < 1:
        raise ConfigError(f"--shares {shares}: every share must be at least 1")
    if sum(shares) != spec.batch_size:
        raise ConfigError(f"--shares {shares}: must sum to the batch size {spec.batch_size}")
    return shares


def _divisor_at_most(n: int, m: int) -> int:
    return next(k for k in range(min(m, n), 0, -1) if n % k == 0)


def step_bytes_per_replica(model: nn.Module) -> tuple[int, int]:
    """(up, down) bytes one replica exchanges per step under --sync step: every trainable tensor as
    raw float32, gradients up and parameters down."""
    total = sum(
        len(pack_encoded(encode_tensor(p.detach().float(), "raw")))
        for _, p in model.named_parameters()
        if p.requires_grad
    )
    return total, total


def _replica_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    m: int,
    step: int,
    spec: JobSpec,
) -> float:
    """One inner step of one replica on its share `batch`; returns its mean micro-batch loss."""
    set_lr(opt, lr_at(step, spec))
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(step_seed(spec.seed, step, "dropout"))
    inputs, targets = batch
    share = inputs.size(0)
    losses = []
    for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True):
        loss = lm_loss(model(x), y)
        (loss * loss_scale(x.size(0), share)).backward()
        losses.append(loss.item())
    if spec.grad_clip is not None:  # the workers' clip (train/free_rounds.py `_compute`, runtime/fused.py)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        coef = clip_coefficient(FlatOptimizer.grad_sq_norm(grads), spec.grad_clip)
        if coef != 1.0:
            for g in grads.values():
                g.mul_(coef)
    opt.step()
    return sum(losses) / len(losses)


def train_local_replicas(
    spec: JobSpec,
    sync: SyncConfig,
    *,
    replicas: int = 1,
    shares: Sequence[int] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    eval_every: int = 0,
    eval_batches: int = EVAL_BATCHES,
    restart_rounds: Collection[int] = (),
    fresh_outer_rounds: Collection[int] = (),
    fresh_feedback_rounds: Collection[int] = (),
    fresh_feedback_names: Mapping[int, Mapping[int, Collection[str]]] | None = None,
    on_round: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    round_steps: list[list[int]] | None = None,
) -> ReplicasResult:
    """Train `spec` as `replicas` data-parallel replicas synchronised by `sync`, in this process.

    `restart_rounds` (diloco/sparseloco): rounds that start with new inner optimizers on every
    replica, as after the swarm redid a round on a new plan (a worker died, a host was replaced, the
    job resumed); `fresh_feedback_rounds`: rounds that start with new SparseLoCo error feedback (a
    redone round: the dead stage's accumulators are gone); `fresh_feedback_names` (rounds closed by
    time): round -> replica -> the names whose feedback starts new there, the others kept (a
    checkpoint that held part of it); `fresh_outer_rounds`: rounds that start
    with a new outer optimizer state, as after the optimizer hosts restarted from the driver's
    checkpoint. The reference those runs follow.
    `on_round(round, θ)` sees the shared parameters after each round (a copy).

    With `eval_every` > 0, the validation loss of the shared parameters is added to the record of
    every step whose number + 1 is a multiple of it (under diloco/sparseloco, a step that closes a
    round: make it a multiple of H).
    """
    shares = resolve_shares(spec, replicas, shares)
    replicas = len(shares)
    seq_len = resolve_seq_len(spec)
    records: list[dict[str, Any]] = []
    with MetricsWriter(spec.metrics_out) as metrics:
        metrics.event(
            "start", job_id=spec.job_id, step=0, spec=spec.to_dict(), sync=sync.to_dict(), shares=shares
        )

        def emit(rec: dict[str, Any]) -> None:
            records.append(rec)
            metrics.step({"plan_version": 0, **rec})
            if progress is not None:
                progress(rec)

        if sync.round_close == "time":
            from fusionnode.train.free_rounds_local import replay_rounds

            if round_steps is None:
                raise ConfigError("--round-close time: the reference replays a schedule; give --round-steps")
            losses, val, theta, host = replay_rounds(
                spec, sync, shares, seq_len, round_steps, emit, eval_batches, on_round,
                (frozenset(restart_rounds), frozenset(fresh_outer_rounds), frozenset(fresh_feedback_rounds)),
                fresh_feedback_names,
            )  # fmt: skip
            res = ReplicasResult(
                spec, sync, replicas, tuple(losses), val, theta, tuple(records),
                host.received_bytes, host.sent_bytes, host.round,
            )  # fmt: skip
        elif fresh_feedback_names:
            raise ConfigError(
                "error feedback kept for part of a replica is replayed under --round-close time only"
            )
        elif sync.rounds:
            res = _round_modes(
                spec,
                sync,
                shares,
                seq_len,
                emit,
                records,
                eval_every,
                eval_batches,
                (frozenset(restart_rounds), frozenset(fresh_outer_rounds), frozenset(fresh_feedback_rounds)),
                on_round,
            )
        else:
            res = _step_mode(spec, sync, replicas, seq_len, emit, records, eval_every, eval_batches)
        metrics.event("eval", step=spec.steps, val_loss=res.val_loss)
        metrics.event("end", step=spec.steps, **metrics.summary.as_dict())
    return res


def _round_replicas(
    spec: JobSpec, sync: SyncConfig, shares: list[int], seq_len: int
) -> tuple[
    BatchSource,
    list[nn.Module],
    list[torch.optim.Optimizer],
    dict[str, torch.Tensor],
    list[ReplicaSync],
    RoundCombiner,
    list[int],
    list[dict[str, torch.Tensor]],
    list[dict[str, torch.Tensor]],
]:
    """The round modes' replicas, as `_round_modes` and `free_rounds_local` start them: the data
    source, R copies of the job's model (in train mode) with their inner optimizers, θ (float32),
    each replica's sender, the host's combiner, each replica's micro-batch count, and for
    --sync-overlap each replica's θ_start (θ) and θ_end (empty)."""
    replicas = len(shares)
    base = build_job_model(spec)
    source = BatchSource.from_spec(spec, seq_len)
    models = [copy.deepcopy(base) for _ in range(replicas)]
    for mdl in models:
        mdl.train()
    opts = [make_optimizer(mdl, spec) for mdl in models]
    theta = {n: p.detach().clone().float() for n, p in base.named_parameters() if p.requires_grad}
    senders = [ReplicaSync(sync) for _ in range(replicas)]
    host = RoundCombiner(sync, replicas)
    ms = [_divisor_at_most(s, spec.micro_batches) for s in shares]
    starts = [dict(theta) for _ in range(replicas)]
    ends: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
    return source, models, opts, theta, senders, host, ms, starts, ends


def settle_replica(
    model: nn.Module,
    theta: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    end: dict[str, torch.Tensor],
) -> None:
    """--sync-overlap's late update of one replica: θ_r ← θ_global + (θ_r − θ_end,r) and
    θ_start,r ← θ_global (`start` is updated in place)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in theta:
                p.copy_(theta[n] + (p.detach().float() - end[n]))
                start[n] = theta[n].clone()


def install_theta(models: Sequence[nn.Module], theta: dict[str, torch.Tensor]) -> None:
    """Every replica takes θ_global (the parameters in `theta`; the others are left as they are)."""
    with torch.no_grad():
        for mdl in models:
            for n, p in mdl.named_parameters():
                if n in theta:
                    p.copy_(theta[n])


def _round_modes(
    spec: JobSpec,
    sync: SyncConfig,
    shares: list[int],
    seq_len: int,
    emit: Callable[[dict[str, Any]], None],
    records: list[dict[str, Any]],
    eval_every: int,
    eval_batches: int,
    restarts: tuple[frozenset[int], ...] = (frozenset(), frozenset(), frozenset()),
    on_round: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
) -> ReplicasResult:
    """diloco / sparseloco: R model copies, each with its own inner optimizer, synced by rounds."""
    replicas = len(shares)
    source, models, opts, theta, senders, host, ms, starts, ends = _round_replicas(
        spec, sync, shares, seq_len
    )
    tokens_in_round = [0] * replicas
    losses: list[float] = []
    pending = False  # --sync-overlap: whether the last round's update is due

    def settle() -> None:  # θ_i ← θ_global + (θ_i − θ_end,i), θ_start,i ← θ_global
        for r in range(replicas):
            settle_replica(models[r], theta, starts[r], ends[r])

    for step in range(spec.steps):
        t0 = time.perf_counter()
        at = sync.round_index(step) if sync.is_boundary(step) else None
        if at in restarts[0]:
            opts = [make_optimizer(mdl, spec) for mdl in models]
            if pending:  # --sync-overlap: the redone round's new stages start from the hosts' θ
                with torch.no_grad():
                    for r in range(replicas):
                        for n, p in models[r].named_parameters():
                            if n in theta:
                                p.copy_(theta[n])
                        starts[r] = {n: t.clone() for n, t in theta.items()}
                pending = False
        if at in restarts[1]:
            host.outer = make_outer(sync)
        if at in restarts[2]:
            senders = [ReplicaSync(sync) for _ in range(replicas)]
        batches = source.shard_batches(step, shares)
        rlosses = []
        for r in range(replicas):
            rlosses.append(_replica_step(models[r], opts[r], batches[r], ms[r], step, spec))
            tokens_in_round[r] += shares[r] * seq_len
        loss = sum(rl * s for rl, s in zip(rlosses, shares, strict=True)) / spec.batch_size
        if not math.isfinite(loss):
            raise DivergenceError(f"step {step}: loss is {loss}; lower --lr or --outer-lr")
        wire = 0
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "tokens": spec.batch_size * seq_len,
            "round": host.round,
        }
        closes = sync.round_closes(step, spec.steps)
        if pending and (closes or sync.applies_delayed(step)):
            settle()  # the previous round's update, D inner steps late
            pending = False
        if closes:
            for r in range(replicas):
                end = {n: p for n, p in models[r].named_parameters() if p.requires_grad}
                if sync.overlap:
                    ends[r] = {n: p.detach().float().clone() for n, p in end.items()}
                delta = pseudo_gradient(starts[r] if sync.overlap else theta, end)
                host.add(host.round, r, tokens_in_round[r], senders[r].encode(delta))
            before = host.received_bytes + host.sent_bytes
            theta = {n: t.clone() for n, t in theta.items()} if sync.overlap else theta
            host.close(theta)  # the outer step, applied to theta (what every replica applies)
            wire = host.received_bytes + host.sent_bytes - before
            settles = sync.settles_at_close(step, spec.steps, spec.save_every if spec.save_dir else 0)
            pending = sync.overlap and not settles
            if not sync.overlap or settles:
                install_theta(models, theta)
                if sync.overlap:  # the next round's Δ is taken from θ_global
                    starts = [dict(theta) for _ in range(replicas)]
            tokens_in_round = [0] * replicas
            rec["round_closed"] = host.round - 1
            if on_round is not None:
                on_round(host.round - 1, {n: t.clone() for n, t in theta.items()})
        rec.update(
            step_time_s=time.perf_counter() - t0,
            wire_bytes=wire,
            optimizer_hosts=[
                {"host": 0, "received_bytes": host.received_bytes, "sent_bytes": host.sent_bytes}
            ],
        )
        if eval_every and (step + 1) % eval_every == 0:
            rec["val_loss"] = evaluate(models[0], source, eval_batches)
        losses.append(loss)
        emit(rec)
    val = evaluate(models[0], source, eval_batches)
    return ReplicasResult(
        spec,
        sync,
        replicas,
        tuple(losses),
        val,
        dict(theta),
        tuple(records),
        host.received_bytes,
        host.sent_bytes,
        host.round,
    )


def _step_mode(
    spec: JobSpec,
    sync: SyncConfig,
    replicas: int,
    seq_len: int,
    emit: Callable[[dict[str, Any]], None],
    records: list[dict[str, Any]],
    eval_every: int,
    eval_batches: int,
) -> ReplicasResult:
    """The single-process reference step by step (`local.train_step`), with the bytes counted."""
    model = build_job_model(spec)
    source = BatchSource.from_spec(spec, seq_len)
    model.train()
    opt = make_optimizer(model, spec)
    up, down = step_bytes_per_replica(model)
    received = sent = 0
    losses: list[float] = []
    for step in range(spec.steps):
        t0 = time.perf_counter()
        out = train_step(model, opt, source, step, spec)
        if not math.isfinite(out["loss"]):
            raise DivergenceError(f"step {step}: loss is {out['loss']}; lower --lr or set --grad-clip")
        received += up * replicas
        sent += down * replicas
        rec: dict[str, Any] = {
            "step": step,
            "loss": out["loss"],
            "tokens": spec.batch_size * seq_len,
            "round": step,
            "step_time_s": time.perf_counter() - t0,
            "wire_bytes": (up + down) * replicas,
            "optimizer_hosts": [{"host": 0, "received_bytes": received, "sent_bytes": sent}],
        }
        if eval_every and (step + 1) % eval_every == 0:
            rec["val_loss"] = evaluate(model, source, eval_batches)
        losses.append(out["loss"])
        emit(rec)
    val = evaluate(model, source, eval_batches)
    params = {n: p.detach().clone().float() for n, p in model.named_parameters() if p.requires_grad}
    return ReplicasResult(
        spec, sync, replicas, tuple(losses), val, params, tuple(records), received, sent, spec.steps
    )
