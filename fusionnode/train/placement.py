"""Placement: a job's layout over the swarm's workers, turned into stage assignments that are proposed,
shipped and released.

`train/layout.py`'s `layout` lays pipelines over workers (balanced by FLOPs, or at given bounds;
`Placement.planned_layout` asks the planner instead); `Placement.assignments` turns the pipelines
into the typed `job.assign` messages (wire/job.py); `Placement.place` is the one proposal loop: lay
out, propose, and on refusals lay out again without the peers that refused. `ship` sends an accepted
stage its parameters, `fetch` reads them back, `release_calls` drops them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from fusionnode.errors import ConfigError, FusionNodeError, PlanError
from fusionnode.optim.client import OptimizerClient
from fusionnode.optim.rounds import contributing_names
from fusionnode.runtime.allreduce import allreduce_rings
from fusionnode.security.limits import MAILBOX_SLACK_BYTES
from fusionnode.sync import SyncConfig, state_copies
from fusionnode.train import feedback_ckpt
from fusionnode.train.layout import activation_bytes, crossing_names, divisor_at_most, tensor_spec
from fusionnode.train.rebalance import PeerBook
from fusionnode.train.state import Job, Pipeline
from fusionnode.train.swarm_cluster import cluster_from_records, symmetric_links
from fusionnode.verify import compat
from fusionnode.wire import job as jp
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import Rpc, StageAssignment, TensorKind

logger = logging.getLogger(__name__)

MAX_PROPOSALS = 4  # rounds of stage proposals before giving up
STAGE_ID_STRIDE = 1000  # stage ids of plan version v start at (v - 1) * this: no reuse across re-plans
PING_TIMEOUT_S = 5.0  # seconds a peer has to answer a liveness probe
PLANNERS = ("simple", "fusion", "even", "grid", "memory")


def expected(job: Job, stage_args: list[StageAssignment]) -> dict[str, dict[str, dict[str, Any]]]:
    from fusionnode.optim.contributions import contributor_key

    expected: dict[str, dict[str, dict[str, Any]]] = {}
    for a in stage_args:
        for name in a.param_specs:
            if name in job.frozen:
                continue
            expected.setdefault(name, {})[contributor_key(a.replica, a.stage)] = {
                "replica": a.replica,
                "samples": job.pipelines[a.replica].samples,
                "peer": a.peer,
            }
    return expected


class Placement:
    """The driver's placement of its jobs' stages on the swarm's workers."""

    def __init__(
        self,
        transport: Any,
        membership: Any,
        step_timeout_s: float,
        hosts: OptimizerClient,
        book: PeerBook | None = None,
    ):
        self.t = transport
        self.membership = membership
        self.step_timeout_s = step_timeout_s
        self.hosts = hosts
        self.book = book if book is not None else PeerBook()  # the driver's: speeds and bans across jobs
        self.left_out: dict[str, str] = {}  # peers a checked job could not use, why (verify/compat.py)

    async def place(
        self,
        workers: list[str],
        lay: Callable[[list[str]], Awaitable[None]],
        assign: Callable[[], Awaitable[list[StageAssignment]]],
        metrics: Any,
        emit: Any,
    ) -> tuple[list[StageAssignment], list[str]]:
        """The stage-proposal loop: `lay` the job out over `workers` (it sets the job's pipelines),
        `assign` its stages, propose them; the peers that refuse are left out of the next round
        (`lay` raises PlanError when too few are left).
        Returns the accepted assignments and the workers still in the running."""
        for _attempt in range(MAX_PROPOSALS):
            await lay(workers)
            stage_args = await assign()
            refused = await self.propose(stage_args, metrics, emit)
            if not refused:
                return stage_args, workers
            workers = [w for w in workers if w not in refused]
        raise PlanError("could not place the job's stages after several proposals")

    async def candidates(
        self, wanted: list[str] | None, role: str, needs: dict[str, str] | None = None
    ) -> list[str]:
        """The `role`'s peers for a job: `wanted` (checked to be in the swarm), else the live ones
        this driver has not banned; with `needs` (a job with checks on: verify/compat.py) only those
        that advertise them (a named peer that lacks them refuses the job), asked once per plan."""
        with compat.one_ask_per_plan():  # the liveness ping asks them; the screen then asks nobody
            ids = await self._candidates(wanted, role, ask=bool(needs))
            ids, left_out = await compat.screen(self.t, ids, needs or {}, role, named=bool(wanted))
        self.left_out.update(left_out)
        return ids

    async def _candidates(self, wanted: list[str] | None, role: str, ask: bool = False) -> list[str]:
        peers = await self.membership.peers()
        ids = [
            p.peer_id
            for p in peers
            if role in p.roles and getattr(p, "availability", "available") == "available"
        ]
        if wanted:
            missing = [w for w in wanted if w not in ids]
            if missing:
                raise ConfigError(f"requested peers are not available {role}s in the swarm: {missing}")
            return list(wanted)
        # a peer this driver banned (it failed a step of any of its jobs) gets no new work until the
        # ban ends; a record outlives its peer by up to its TTL: keep those that answer a ping
        ids = self.book.bans.allowed(ids, time.monotonic())
        dead, _leaving = await self.probe(ids, ask)
        ids = [p for p in ids if p not in dead]
        # the driver's own peer first (it feeds the first stage without a hop), then by id
        return sorted(ids, key=lambda pid: (pid != self.t.peer_id, pid))

    async def probe(self, peers: list[str], ask: bool = False) -> tuple[list[str], list[str]]:
        """(peers that did not answer a ping in PING_TIMEOUT_S, peers that answered they are leaving).
        `ask`: the pings also ask the plan's check capabilities (verify/compat.py `ping`)."""
        res = await asyncio.gather(
            *(compat.ping(self.t, p, ask, PING_TIMEOUT_S) for p in peers), return_exceptions=True
        )
        dead = [p for p, r in zip(peers, res, strict=True) if isinstance(r, BaseException)]
        leaving = [p for p, r in zip(peers, res, strict=True) if isinstance(r, jp.PingReply) and r.draining]
        return dead, leaving

    async def pick_hosts(
        self, params: dict[str, Any], workers: list[str], needs: dict[str, str] | None = None
    ) -> list[str]:
        """The job's optimizer hosts: --optimizer-hosts of the optimizer peers, those apart from the workers first."""
        hosts = await self.candidates(
            params.get("optimizer_peers"), "optimizer", compat.host_needs(needs or {})
        )
        if not hosts:
            raise PlanError(
                "--offload on needs at least one peer with the optimizer role (fusionnode join "
                "--role optimizer)"
            )
        # prefer hosts that are not also the job's workers (LuWu: CPU/RAM-rich peers apart from the GPUs);
        # among equals the driver's own peer first (no hop for its pulls), except for a job that keeps
        # checkpoints: it can be resumed from another peer, so its optimizer state stays off the
        # driver's peer, where it would die with the driver
        resumable = bool(params.get("spec", {}).get("save_dir"))
        hosts.sort(key=lambda h: (h in workers, (h == self.t.peer_id) == resumable, h))
        k = int(params.get("optimizer_hosts") or 1)
        return hosts[: max(1, k)]

    async def planned_layout(
        self,
        strategy: str,
        spec: Any,
        graph: Any,
        workers: list[str],
        params: dict[str, Any],
        offload: bool,
        seq_len: int,
        dp_sync: str | None = None,
        needs: dict[str, str] | None = None,
    ) -> tuple[list[Pipeline], list[str], dict[str, Any]]:
        """Pipelines from the planner (OP-Fence + asymmetric DP x PP) or one of its baselines.
        `dp_sync` "auto" (with `offload`): the planner prices optimizer hosts against a ring all-reduce
        among the replicas and the plan says which (prediction["dp_sync"]; no hosts for a ring)."""
        from fusionnode.plan.baselines import even_plan, memory_plan
        from fusionnode.plan.cluster import load_cluster_dict
        from fusionnode.plan.grid import grid_plan
        from fusionnode.plan.planner import plan as make_plan
        from fusionnode.plan.syncprice import SyncPrice

        host_needs = compat.host_needs(needs or {})  # a job with checks on: hosts that can check
        hosts = (
            await self.candidates(params.get("optimizer_peers"), "optimizer", host_needs) if offload else []
        )
        doc = params.get("cluster") or cluster_from_records(
            await self.membership.peers(), workers, hosts, self.book.speeds.speeds()
        )
        known = {d["id"] for d in doc.get("devices", [])}
        missing = [w for w in workers if w not in known]
        if missing:
            raise ConfigError(f"the cluster given for planning does not describe workers {missing[:3]}")
        cluster = load_cluster_dict(doc, "swarm")
        kwargs = {
            "micro_batches": spec.micro_batches,
            "seq_len": seq_len,
            "offload": offload,
            "compress": spec.compress == "adatopk",  # the plan may count on AdaTopK only when it runs
        }
        # the planner prices a round mode's sync once per H steps (sync_from_args lets only it and
        # simple run one); the baselines price it every step
        sync = SyncConfig.from_dict(params.get("sync"))
        price, chosen = SyncPrice.from_dict(sync.price()), None
        if strategy == "fusion" and dp_sync is not None:
            kwargs["dp_sync"] = dp_sync
        fn = {"fusion": make_plan, "even": even_plan, "grid": grid_plan, "memory": memory_plan}[strategy]
        if strategy == "fusion":  # with a --sync-budget, H is chosen here, once (plan/choose_h.py)
            from fusionnode.plan.choose_h import plan_for_sync
            from fusionnode.plan.simulator import simulate

            p, price, fixed, choice = await asyncio.to_thread(
                plan_for_sync,
                sync,
                lambda pr: make_plan(graph, cluster, spec.batch_size, **kwargs, sync=pr),
                lambda pl, pr: simulate(graph, cluster, pl, None, pr),
            )
            params["sync"] = fixed.to_dict()  # the job's H from now on (re-plans keep it)
            chosen = choice.to_dict() if choice is not None else None
        else:
            p = await asyncio.to_thread(fn, graph, cluster, spec.batch_size, **kwargs)
        offload = p.dp_sync == "hosts"
        pipelines, first = [], 0
        for r, pp in enumerate(p.pipelines):
            peers = [st.devices[0] for st in pp.stages]
            bounds = [pp.stages[0].lo, *(st.hi for st in pp.stages)]
            m = divisor_at_most(pp.batch_share, pp.micro_batches)
            pipelines.append(Pipeline(r, peers, bounds, pp.batch_share, m, first))
            first += len(peers)
        plan_hosts = [h.device for h in p.optimizer_hosts] if offload else []
        if offload and not plan_hosts:
            plan_hosts = await self.pick_hosts(params, workers, needs)
        pred = p.prediction
        simulated = pred.simulated_step_time_s if pred else None
        if pred and simulated is None:  # the event simulation of the same plan, for the record
            from fusionnode.plan.simulator import simulate

            try:
                simulated = (await asyncio.to_thread(simulate, graph, cluster, p, None, price)).step_time_s
            except Exception as exc:  # a second opinion only: never fail the job over it
                logger.warning("simulating the plan failed: %s", exc)
        prediction = {
            "strategy": p.strategy,
            "step_time_s": pred.step_time_s if pred else None,
            "tokens_per_s": pred.tokens_per_s if pred else None,
            "simulated_step_time_s": simulated,
            "sync": {**price.to_dict(), **({"chosen": chosen} if chosen else {})},
            "dp_sync": p.dp_sync,
        }
        return pipelines, plan_hosts, prediction

    async def measured_links(self) -> dict[tuple[str, str], float]:
        """(from peer, to peer) -> bandwidth in bits/s, as the peers' link probes measured it."""
        return {k: bps for k, (bps, _rtt) in symmetric_links(await self.membership.peers()).items()}

    def assignments(
        self,
        job: Job,
        traced: Any,
        canonical: dict[str, str],
        params: dict[str, torch.Tensor],
        sample: torch.Tensor,
        host_of: dict[str, str] | None,
        host_index: dict[str, int],
        links: dict[tuple[str, str], float] | None = None,
        link_options: dict[str, Any] | None = None,
    ) -> list[StageAssignment]:
        from fusionnode.graph.portable import describe_stage
        from fusionnode.optim.contributions import contributor_key

        graph = traced.graph
        spec = job.spec
        args: list[StageAssignment] = []
        descs_of, params_of, shared_of = [], [], []
        for pipe in job.pipelines:
            n = len(pipe.peers)
            descs = [describe_stage(traced, pipe.bounds[i], pipe.bounds[i + 1]) for i in range(n)]
            stage_params = [sorted({canonical.get(k, k) for k in d["params"]}) for d in descs]
            counts: dict[str, int] = {}
            for names in stage_params:
                for name in names:
                    counts[name] = counts.get(name, 0) + 1
            descs_of.append(descs)
            params_of.append(stage_params)
            shared_of.append({k for k, v in counts.items() if v > 1})
        rings: dict[int, list[dict[str, Any]]] = {}
        if not host_of and len(job.pipelines) > 1 and not job.sync.rounds:
            # offload off: names several stages of a pipeline hold (tied weights) go through the driver in
            # every replica; the others are averaged by ring all-reduce among the stages holding them
            job_shared = set().union(*shared_of)
            shared_of = [job_shared] * len(job.pipelines)
            rings = allreduce_rings(job.pipelines, params_of, job_shared | set(job.frozen))
        for pipe, descs, stage_params, shared in zip(
            job.pipelines, descs_of, params_of, shared_of, strict=True
        ):
            n = len(pipe.peers)
            for i, d in enumerate(descs):
                lo, hi = pipe.bounds[i], pipe.bounds[i + 1]
                gid = pipe.first_stage + i
                if i == 0:
                    recv = {name: {"shape": [1, *sample.shape[1:]], "dtype": "int64"} for name in d["inputs"]}
                else:
                    recv = {name: tensor_spec(graph, name) for name in crossing_names(graph, lo)}
                send = (
                    {}
                    if i == n - 1
                    else {name: tensor_spec(graph, name) for name in crossing_names(graph, hi)}
                )
                pspecs = {
                    name: {"shape": list(params[name].shape), "dtype": "float32"} for name in stage_params[i]
                }
                pbytes = sum(params[name].numel() * 4 for name in stage_params[i])
                # params + grads (+ 2 optimizer states when local; + θ_start, EF in a sync round mode)
                state_factor = state_copies(job.sync.to_dict(), bool(host_of))
                offload = None
                if host_of:
                    offload = jp.Offload(
                        hosts={name: host_of[name] for name in pspecs if name in host_of},
                        host_index={name: host_index[name] for name in pspecs if name in host_index},
                        contributor=contributor_key(pipe.replica, gid),
                        samples=pipe.samples,
                    ).to_wire()
                a = StageAssignment(
                    job=spec.job_id,
                    stage=gid,
                    pos=i,
                    num_stages=n,
                    replica=pipe.replica,
                    prev_stage=gid - 1,
                    next_stage=gid + 1,
                    driver=self.t.peer_id,
                    prev=pipe.peers[i - 1] if i > 0 else "",
                    next=pipe.peers[i + 1] if i < n - 1 else "",
                    description=d,
                    param_specs=pspecs,
                    recv_specs=recv,
                    send_specs=send,
                    shared_names=sorted(shared & set(pspecs) - set(job.frozen)),
                    frozen=sorted(set(pspecs) & set(job.frozen)),
                    spec=spec.to_dict(),
                    need_bytes=int(pbytes * state_factor + activation_bytes(graph, pipe, i)),
                    lease_s=job.lease_s,
                    lo=lo,
                    hi=hi,
                    flops_per_sample=float(sum(node.flops for node in graph.nodes[lo:hi])),
                    peer=pipe.peers[i],
                    link_options=link_options or {},
                    bw_next=(links or {}).get((pipe.peers[i], pipe.peers[i + 1])) if i < n - 1 else None,
                    bw_prev=(links or {}).get((pipe.peers[i], pipe.peers[i - 1])) if i > 0 else None,
                    offload=offload,
                    sync=job.sync.to_dict() if job.sync.rounds else None,  # issue 19
                    allreduce=rings.get(gid),
                )
                args.append(a)
        return args

    def accept(self, job: Job, stage_args: list[StageAssignment]) -> None:
        """This driver takes data messages of the job (fetched parameters, shared gradients) only from
        the job's stages and hosts, at most the model's bytes (and slack) from each."""
        peers = {a.peer for a in stage_args} | set(job.hosts)
        self.t.mailbox.accept(job.spec.job_id, "driver", peers, job.model_bytes + MAILBOX_SLACK_BYTES)

    async def propose(self, stage_args: list[StageAssignment], metrics: Any, emit: Any) -> list[str]:
        results = await asyncio.gather(
            # a re-sent assignment replaces the one held (rpc_assign): a stream reset asks once more,
            # it does not count as a refusal
            *(jp.call(self.t, a.peer, Rpc.JOB_ASSIGN, a, idempotent=True) for a in stage_args),
            return_exceptions=True,
        )
        refused = []
        for a, res in zip(stage_args, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, FusionNodeError):
                    raise res
                refused.append(a.peer)
                metrics.event("refused", peer=a.peer, reason=str(res))
                await emit({"type": "event", "kind": "refused", "peer": a.peer, "reason": str(res)})
        if refused:  # release what the others accepted; the next proposal reassigns
            await asyncio.gather(
                *(
                    jp.call(self.t, a.peer, Rpc.JOB_RELEASE, jp.ReleaseRequest(job=a.job, stage=a.stage))
                    for a in stage_args
                    if a.peer not in refused
                ),
                return_exceptions=True,
            )
        return refused

    async def ship(
        self,
        job: Job,
        stage_args: list[StageAssignment],
        full: dict[str, torch.Tensor],
        feedback: dict[int, dict[str, torch.Tensor]] | None = None,
        optim: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Sends each stage its parameters and starts it; `feedback` (a resumed --sync sparseloco job):
        per replica, the error feedback of each name, sent to the stage that sends that name; `optim`
        (offload off, a stage moved with its state): name -> its optimizer-state tensors
        (runtime/optstate.py)."""
        senders = contributing_names(stage_args) if feedback else {}

        async def ship(a: StageAssignment) -> None:
            for idx, name in enumerate(sorted(a.param_specs)):
                meta = {"job": job.spec.job_id, "stage": a.stage, "step": -1, "mb": idx}
                await self.t.send(a.peer, tensor_message(TensorKind.PARAMS, meta, {name: full[name]}))
            mine = (feedback or {}).get(a.replica, {})
            names = [n for n in senders.get(a.stage, []) if n in mine]
            for idx, name in enumerate(names):
                meta = {"job": job.spec.job_id, "stage": a.stage, "step": -1, "mb": idx}
                await self.t.send(a.peer, tensor_message(TensorKind.FEEDBACK, meta, {name: mine[name]}))
            states = [optim[n] for n in sorted(a.param_specs) if n not in a.frozen] if optim else []
            for idx, state in enumerate(states):
                meta = {"job": job.spec.job_id, "stage": a.stage, "step": -1, "mb": idx}
                await self.t.send(a.peer, tensor_message(TensorKind.OPT_STATE, meta, state))
            req = jp.StageRef(job=job.spec.job_id, stage=a.stage, feedback=len(names), optim=len(states))
            # a worker builds a stage once per assignment and answers a second start as the first:
            # a stream reset asks once more (an older worker waits for the parameters again: deadline)
            await jp.call(self.t, a.peer, Rpc.JOB_START, req, timeout=self.step_timeout_s, idempotent=True)

        await asyncio.gather(*(ship(a) for a in stage_args))
        job.feedback_shipped = bool(feedback)
        job.feedback_fresh = feedback_ckpt.fresh_names(stage_args, feedback) if feedback else {}

    async def fetch(self, job: Job, stage_args: list[StageAssignment], what: str) -> dict[str, torch.Tensor]:
        """Parameters (or gradients) of replica 0, by name; a name held by several stages is summed for
        gradients (tied weights) and taken once for parameters (the copies are equal)."""
        out: dict[str, torch.Tensor] = {}

        async def one(a: StageAssignment) -> dict[str, torch.Tensor]:
            req = jp.FetchRequest(job=job.spec.job_id, stage=a.stage, what=what)
            res = await jp.call(self.t, a.peer, Rpc.JOB_FETCH, req, timeout=self.step_timeout_s)
            got: dict[str, torch.Tensor] = {}
            for idx in range(res.count):
                msg, src = await self.t.mailbox.get(
                    (jp.FETCH_KIND[what], job.spec.job_id, -1, idx, a.stage),
                    self.step_timeout_s,
                    sender=a.peer,
                )
                got.update(decode_checked(msg, a.param_specs, None, src))
            return got

        parts = await asyncio.gather(*(one(a) for a in stage_args if a.replica == 0))
        for part in parts:
            for name, t in part.items():
                if name in out and what == "grads":
                    out[name] = out[name] + t
                else:
                    out.setdefault(name, t)
        return out

    def release_calls(self, job: Job, abort: bool, timeout: float = 5.0) -> list[Any]:
        """The calls that drop the job's stages (`abort`: cancel a step in progress first)."""
        return [
            jp.call(
                self.t,
                s["peer"],
                Rpc.JOB_RELEASE,
                jp.ReleaseRequest(job=job.spec.job_id, stage=s["stage"], abort=abort),
                timeout=timeout,
            )
            for s in job.stages
        ]

    async def current_params(
        self,
        job: Job,
        stage_args: list[StageAssignment],
        host_of: dict[str, str] | None,
        all_names: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The current parameters: from the optimizer hosts with offload (every name of `all_names`,
        or those the stages hold), else from replica 0's stages; frozen ones are the driver's copy."""
        if not job.offload:
            return {**job.frozen, **await self.fetch(job, stage_args, "params")}
        specs = {n: s for a in stage_args for n, s in a.param_specs.items()}
        if all_names is not None:
            specs = {n: {"shape": list(t.shape), "dtype": "float32"} for n, t in all_names.items()}
        for name in job.frozen:  # frozen (LoRA base) tensors never go to the hosts: the driver's copy
            specs.pop(name, None)
        return {**job.frozen, **await self.hosts.pull(job.spec.job_id, job.hosts, host_of, specs)}

    async def start_hosts(
        self,
        job: Job,
        stage_args: list[StageAssignment],
        full: dict[str, torch.Tensor],
        host_of: dict[str, str],
        *,
        resume: bool,
        start_step: int | None,
    ) -> list[int]:
        """Gives each of the job's optimizer hosts its shard, the contributors the stages make
        (optim/client.py `init`); returns the hosts' applied steps."""
        applied, job.fresh_optimizer = await self.hosts.init(
            job.spec.job_id,
            job.secret,
            job.spec.to_dict(),
            job.spec.save_every or 0,
            job.hosts,
            full,
            host_of,
            expected(job, stage_args),
            resume=resume,
            start_step=start_step,
            sync=job.sync.to_dict(),
            replicas=len(job.pipelines),
            contrib=job.contrib.host_config() if job.contrib is not None else None,
        )
        return applied
