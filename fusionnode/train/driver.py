"""The driver: the peer that started a job plans it, feeds it, and keeps its books.

It traces the model into an OP-DAG, splits it into contiguous stages over the
swarm's workers, proposes the assignment (each worker may refuse), ships each
worker its portable sub-DAG and parameters, then runs steps: micro-batches to
the first stage, targets to the last, reports back, gradients of shared (tied)
parameters summed, the global gradient norm clipped, the step committed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError, PeerError, PlanError
from fusionnode.runtime.transport import Transport
from fusionnode.runtime.worker import decode_checked, tensor_message

logger = logging.getLogger(__name__)

MAX_PROPOSALS = 4  # rounds of stage proposals before giving up
ACT_INFLIGHT_FACTOR = 3  # activation memory estimate: saved tensors ~ this many times the stage's outputs


def balanced_bounds(flops: list[float], n_stages: int) -> list[int]:
    """Contiguous split of nodes into n_stages ranges of about equal flops; every range non-empty."""
    n = len(flops)
    if n_stages < 1 or n_stages > n:
        raise PlanError(f"cannot split {n} operators into {n_stages} stages")
    total = sum(flops) or float(n)
    weights = flops if sum(flops) else [1.0] * n
    bounds, acc, k = [0], 0.0, 1
    for i, w in enumerate(weights):
        acc += w
        # cut after node i when the prefix reaches k/n_stages of the total, leaving room for later stages
        if (
            k < n_stages
            and acc >= total * k / n_stages
            and i + 1 >= bounds[-1] + 1
            and n - (i + 1) >= n_stages - k
        ):
            bounds.append(i + 1)
            k += 1
    while len(bounds) < n_stages:  # degenerate weights: fill with single nodes at the end
        bounds.append(n - (n_stages - len(bounds)))
    bounds.append(n)
    return bounds


def crossing_names(graph: Any, cut: int) -> list[str]:
    """Names of tensors produced before node `cut` and consumed at or after it."""
    last: dict[int, int] = {}
    for e in graph.edges:
        last[e.src] = max(last.get(e.src, -1), e.dst)
    return [graph.nodes[src].name for src in sorted(last) if src < cut <= last[src]]


def tensor_spec(graph: Any, name: str) -> dict[str, Any]:
    for node in graph.nodes:
        if node.name == name:
            return {"shape": list(node.out_shape), "dtype": node.out_dtype}
    raise PlanError(f"tensor {name!r} is not in the OP-DAG")


class Job:
    """Book-keeping of one running job on its driver."""

    def __init__(self, spec: Any, driver: str):
        self.spec = spec
        self.driver = driver
        self.stages: list[dict[str, Any]] = []
        self.step = 0
        self.loss: float | None = None
        self.tokens_per_s = 0.0
        self.plan_version = 0
        self.started = time.time()
        self.state = "planning"

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.spec.job_id,
            "model": self.spec.model,
            "state": self.state,
            "step": self.step,
            "steps": self.spec.steps,
            "loss": self.loss,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "plan_version": self.plan_version,
            "stages": [{k: s[k] for k in ("stage", "peer", "lo", "hi", "n_params")} for s in self.stages],
        }


class Driver:
    def __init__(self, transport: Transport, membership: Any, *, config: Any, state_dir: Path):
        self.t = transport
        self.membership = membership
        self.config = config
        self.state_dir = state_dir
        self.jobs: dict[str, Job] = {}

    def status(self) -> list[dict[str, Any]]:
        return [job.to_dict() for job in self.jobs.values()]

    # ---- planning ------------------------------------------------------------------------------
    async def _workers(self, wanted: list[str] | None) -> list[str]:
        peers = await self.membership.peers()
        ids = [
            p.peer_id
            for p in peers
            if "worker" in p.roles and getattr(p, "availability", "available") == "available"
        ]
        if wanted:
            missing = [w for w in wanted if w not in ids]
            if missing:
                raise ConfigError(f"requested peers are not available workers in the swarm: {missing}")
            ids = list(wanted)
        # the driver's own peer first (it feeds the first stage without a hop), then by id
        return sorted(ids, key=lambda pid: (pid != self.t.peer_id, pid))

    def _stage_args(
        self,
        job: Job,
        traced: Any,
        bounds: list[int],
        peers: list[str],
        canonical: dict[str, str],
        params: dict[str, torch.Tensor],
        sample: torch.Tensor,
    ) -> list[dict[str, Any]]:
        from fusionnode.graph.portable import describe_stage

        graph = traced.graph
        spec = job.spec
        n = len(bounds) - 1
        descs = [describe_stage(traced, bounds[i], bounds[i + 1]) for i in range(n)]
        stage_params = []
        for d in descs:
            stage_params.append(sorted({canonical.get(k, k) for k in d["params"]}))
        counts: dict[str, int] = {}
        for names in stage_params:
            for name in names:
                counts[name] = counts.get(name, 0) + 1
        shared = sorted(k for k, v in counts.items() if v > 1)
        args = []
        for i, d in enumerate(descs):
            lo, hi = bounds[i], bounds[i + 1]
            if i == 0:
                recv = {name: {"shape": [1, *sample.shape[1:]], "dtype": "int64"} for name in d["inputs"]}
            else:
                recv = {name: tensor_spec(graph, name) for name in crossing_names(graph, lo)}
            send = (
                {} if i == n - 1 else {name: tensor_spec(graph, name) for name in crossing_names(graph, hi)}
            )
            pspecs = {
                name: {"shape": list(params[name].shape), "dtype": "float32"} for name in stage_params[i]
            }
            pbytes = sum(params[name].numel() * 4 for name in stage_params[i])
            act_bytes = sum(node.out_bytes for node in graph.nodes[lo:hi]) * spec.micro_batch_size
            in_flight = min(n - i, spec.micro_batches)
            args.append(
                {
                    "job": spec.job_id,
                    "stage": i,
                    "num_stages": n,
                    "driver": self.t.peer_id,
                    "prev": peers[i - 1] if i > 0 else "",
                    "next": peers[i + 1] if i < n - 1 else "",
                    "description": d,
                    "param_specs": pspecs,
                    "recv_specs": recv,
                    "send_specs": send,
                    "shared_names": [s for s in shared if s in pspecs],
                    "spec": spec.to_dict(),
                    "need_bytes": int(pbytes * 4 + act_bytes * in_flight * ACT_INFLIGHT_FACTOR),
                    "lease_s": self.config.lease_s,
                    "lo": lo,
                    "hi": hi,
                }
            )
        return args

    # ---- the job -------------------------------------------------------------------------------
    async def run_job(self, params: dict[str, Any], emit: Any) -> dict[str, Any]:
        from fusionnode.graph.trace import trace_model
        from fusionnode.train.data import BatchSource
        from fusionnode.train.local import build_job_model
        from fusionnode.train.metrics import MetricsWriter
        from fusionnode.train.spec import JobSpec, resolve_seq_len

        spec = JobSpec.from_dict(params.get("spec") or {})
        if spec.job_id in self.jobs and self.jobs[spec.job_id].state == "running":
            raise ConfigError(f"job {spec.job_id} is already running on this driver")
        job = Job(spec, self.t.peer_id)
        self.jobs[spec.job_id] = job
        metrics = MetricsWriter(spec.metrics_out)
        try:
            model = await asyncio.to_thread(build_job_model, spec)
            seq_len = resolve_seq_len(spec)
            source = await asyncio.to_thread(BatchSource.from_spec, spec, seq_len)
            sample = torch.zeros(1, seq_len, dtype=torch.long)
            traced = await asyncio.to_thread(trace_model, model, sample, spec.model)
            canonical = _canonical_names(model)
            full = {name: p.detach() for name, p in model.named_parameters()}
            start_step = 0
            if params.get("resume") and spec.save_dir:
                start_step, full = self._load_resume(spec, source, full)
                metrics.event("recovered", reason="resumed from checkpoint", step=start_step)
            candidates = await self._workers(params.get("peers"))
            n_stages = int(params.get("stages") or len(candidates))
            n_stages = max(1, min(n_stages, len(candidates)))
            if not candidates:
                raise PlanError("no worker peers are available in the swarm")
            flops = [node.flops for node in traced.graph.nodes]
            stage_args: list[dict[str, Any]] = []
            for _attempt in range(MAX_PROPOSALS):
                n_stages = min(n_stages, len(candidates))
                if n_stages < 1:
                    raise PlanError("every worker refused the job's stages (see the events for the reasons)")
                bounds = balanced_bounds(flops, n_stages)
                peers = candidates[:n_stages]
                stage_args = self._stage_args(job, traced, bounds, peers, canonical, full, sample)
                refused = await self._propose(stage_args, peers, metrics, emit)
                if not refused:
                    break
                candidates = [c for c in candidates if c not in refused]
            else:
                raise PlanError("could not place the job's stages after several proposals")
            job.stages = [
                {
                    "stage": a["stage"],
                    "peer": peers[a["stage"]],
                    "lo": a["lo"],
                    "hi": a["hi"],
                    "n_params": len(a["param_specs"]),
                    "shared": a["shared_names"],
                }
                for a in stage_args
            ]
            job.plan_version = 1
            await emit(
                {"type": "plan", "plan_version": 1, "stages": job.stages, "num_nodes": traced.graph.num_nodes}
            )
            await self._ship_params(job, stage_args, full)
            job.state = "running"
            await self._train(job, stage_args, source, metrics, emit, start_step, params)
            final = await self._fetch(job, "params")
            result = await self._finish(job, model, final, source, metrics, emit)
            job.state = "done"
            return result
        except (asyncio.CancelledError, Exception) as exc:
            job.state = "failed" if not isinstance(exc, asyncio.CancelledError) else "cancelled"
            if isinstance(exc, FusionNodeError):
                metrics.event("failure", reason=str(exc), step=job.step)
            raise
        finally:
            metrics.close()
            await self._release(job)

    async def _propose(
        self, stage_args: list[dict[str, Any]], peers: list[str], metrics: Any, emit: Any
    ) -> list[str]:
        results = await asyncio.gather(
            *(self.t.call(peer, "job.assign", a) for peer, a in zip(peers, stage_args, strict=True)),
            return_exceptions=True,
        )
        refused = []
        for peer, res in zip(peers, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, (PeerError, FusionNodeError)):
                    raise res
                refused.append(peer)
                metrics.event("refused", peer=peer, reason=str(res))
                await emit({"type": "event", "kind": "refused", "peer": peer, "reason": str(res)})
        if refused:  # release what the others accepted; the next proposal reassigns
            await asyncio.gather(
                *(
                    self.t.call(p, "job.release", {"job": a["job"], "stage": a["stage"]})
                    for p, a in zip(peers, stage_args, strict=True)
                    if p not in refused
                ),
                return_exceptions=True,
            )
        return refused

    async def _ship_params(
        self, job: Job, stage_args: list[dict[str, Any]], full: dict[str, torch.Tensor]
    ) -> None:
        async def ship(a: dict[str, Any], peer: str) -> None:
            for idx, name in enumerate(sorted(a["param_specs"])):
                meta = {"job": job.spec.job_id, "stage": a["stage"], "step": -1, "mb": idx}
                await self.t.send(peer, tensor_message("params", meta, {name: full[name]}))
            await self.t.call(
                peer,
                "job.start",
                {"job": job.spec.job_id, "stage": a["stage"]},
                timeout=self.config.step_timeout_s,
            )

        await asyncio.gather(*(ship(a, s["peer"]) for a, s in zip(stage_args, job.stages, strict=True)))

    async def _train(
        self,
        job: Job,
        stage_args: list[dict[str, Any]],
        source: Any,
        metrics: Any,
        emit: Any,
        start_step: int,
        params: dict[str, Any],
    ) -> None:
        from fusionnode.train.spec import lr_at

        spec = job.spec
        jid = spec.job_id
        n = len(job.stages)
        first, last = job.stages[0]["peer"], job.stages[-1]["peer"]
        input_name = next(iter(stage_args[0]["recv_specs"]))
        seq_len = source.seq_len
        dump_grads = params.get("dump_grads")
        tokens_total, time_total = 0, 0.0
        for step in range(start_step, spec.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, spec)
            wire0 = self.t.bytes_sent.get(jid, 0)
            sends = []
            for mb, (x, y) in enumerate(source.microbatches(step, spec.micro_batches)):
                meta = {"job": jid, "step": step, "mb": mb}
                sends.append(
                    self.t.send(first, tensor_message("input", {**meta, "stage": 0}, {input_name: x}))
                )
                sends.append(
                    self.t.send(last, tensor_message("target", {**meta, "stage": n - 1}, {"target": y}))
                )
            await asyncio.gather(*sends)
            step_args = {
                "job": jid,
                "step": step,
                "micro_batches": spec.micro_batches,
                "mb_size": spec.micro_batch_size,
            }
            reports = await asyncio.gather(
                *(
                    self.t.call(
                        s["peer"],
                        "job.step",
                        {**step_args, "stage": s["stage"]},
                        timeout=self.config.step_timeout_s * 2,
                    )
                    for s in job.stages
                )
            )
            shared_sum = await self._sum_shared(job, stage_args, step)
            sq = sum(r["grad_sq"] for r in reports) + sum(
                float(g.double().pow(2).sum()) for g in shared_sum.values()
            )
            clip = 1.0
            if spec.grad_clip is not None:
                clip = min(1.0, spec.grad_clip / (math.sqrt(sq) + 1e-6))
            if dump_grads and step == start_step:
                await self._dump_grads(job, shared_sum, dump_grads)
            for a, s in zip(stage_args, job.stages, strict=True):
                mine = {k: shared_sum[k] for k in a["shared_names"]}
                if mine:
                    meta = {"job": jid, "step": step, "mb": -1, "stage": a["stage"]}
                    await self.t.send(s["peer"], tensor_message("shared_sum", meta, mine))
            await asyncio.gather(
                *(
                    self.t.call(
                        s["peer"],
                        "job.commit",
                        {"job": jid, "stage": s["stage"], "step": step, "lr": lr, "clip_coef": clip},
                        timeout=self.config.step_timeout_s,
                    )
                    for s in job.stages
                )
            )
            step_time = time.perf_counter() - t0
            losses = reports[-1]["losses"]
            loss = sum(losses) / len(losses)
            tokens = spec.batch_size * seq_len
            tokens_total += tokens
            time_total += step_time
            wire = sum(r["sent_bytes"] for r in reports) + self.t.bytes_sent.get(jid, 0) - wire0
            record = {
                "step": step,
                "loss": loss,
                "tokens": tokens,
                "step_time_s": step_time,
                "wire_bytes": wire,
                "plan_version": job.plan_version,
                "lr": lr,
                "grad_norm": math.sqrt(sq),
                "tokens_per_s": tokens / step_time,
                "stages": [
                    {
                        "stage": r["stage"],
                        "compute_s": round(r["compute_s"], 4),
                        "wait_s": round(r["wait_s"], 4),
                        "sent_bytes": r["sent_bytes"],
                    }
                    for r in reports
                ],
            }
            metrics.step(record)
            job.step, job.loss = step + 1, loss
            job.tokens_per_s = tokens_total / time_total
            await emit({"type": "step", **record, "steps": spec.steps})
            if (
                spec.save_dir
                and spec.save_every
                and (step + 1) % spec.save_every == 0
                and step + 1 < spec.steps
            ):
                await self._checkpoint(job, step + 1, source, await self._fetch(job, "params"))

    async def _sum_shared(
        self, job: Job, stage_args: list[dict[str, Any]], step: int
    ) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for a in stage_args:
            if not a["shared_names"]:
                continue
            msg, src = await self.t.mailbox.get(
                ("shared_grad", job.spec.job_id, step, -1, a["stage"]), self.config.step_timeout_s
            )
            got = decode_checked(msg, {k: a["param_specs"][k] for k in a["shared_names"]}, None, src)
            for name, g in got.items():
                total[name] = total[name] + g if name in total else g.clone()
        return total

    async def _fetch(self, job: Job, what: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}

        async def one(s: dict[str, Any]) -> None:
            res = await self.t.call(
                s["peer"],
                "job.fetch",
                {"job": job.spec.job_id, "stage": s["stage"], "what": what},
                timeout=self.config.step_timeout_s,
            )
            for idx in range(int(res["count"])):
                msg, src = await self.t.mailbox.get(
                    (f"fetch_{what}", job.spec.job_id, -1, idx, s["stage"]), self.config.step_timeout_s
                )
                for name, t in decode_checked(msg, None, None, src).items():
                    out.setdefault(name, t)

        await asyncio.gather(*(one(s) for s in job.stages))
        return out

    async def _dump_grads(self, job: Job, shared_sum: dict[str, torch.Tensor], path: str) -> None:
        from safetensors.torch import save_file

        grads = await self._fetch(job, "grads")
        grads.update(shared_sum)
        await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in grads.items()}, path)

    def _load_resume(
        self, spec: Any, source: Any, full: dict[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        from fusionnode.train.checkpoint import load_checkpoint

        ckpt = load_checkpoint(spec.save_dir)
        if ckpt is None:
            raise ConfigError(f"--resume: no complete checkpoint in {spec.save_dir}")
        step = source.check_state(ckpt.data_state)
        params = {name: ckpt.params[name].float() for name in full}
        return step, params

    async def _checkpoint(self, job: Job, step: int, source: Any, params: dict[str, torch.Tensor]) -> str:
        from fusionnode.train.checkpoint import save_checkpoint

        path = await asyncio.to_thread(
            save_checkpoint, job.spec.save_dir, step, params, {}, source.state(step), job.spec
        )
        return str(path)

    async def _finish(
        self, job: Job, model: Any, final: dict[str, torch.Tensor], source: Any, metrics: Any, emit: Any
    ) -> dict[str, Any]:
        from fusionnode.train.generate import generate
        from fusionnode.train.local import evaluate

        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(final[name])
        val_loss = await asyncio.to_thread(evaluate, model, source)
        sample = await asyncio.to_thread(generate, model, "def ", 120, 0.8, 40, job.spec.seed)
        checkpoint = None
        if job.spec.save_dir:
            checkpoint = await self._checkpoint(job, job.spec.steps, source, final)
        summary = metrics.summary.as_dict() if hasattr(metrics, "summary") else {}
        return {
            "job": job.spec.job_id,
            "steps": job.step,
            "loss": job.loss,
            "val_loss": val_loss,
            "tokens_per_s": job.tokens_per_s,
            "stages": job.stages,
            "checkpoint": checkpoint,
            "metrics_out": job.spec.metrics_out,
            "sample": sample,
            "summary": summary,
        }

    async def _release(self, job: Job) -> None:
        await asyncio.gather(
            *(
                self.t.call(
                    s["peer"], "job.release", {"job": job.spec.job_id, "stage": s["stage"]}, timeout=5
                )
                for s in job.stages
            ),
            return_exceptions=True,
        )


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every state-dict name of a parameter -> the name named_parameters() reports (tied weights share one)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
