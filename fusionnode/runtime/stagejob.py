"""One stage of one job held by a worker: its assignment, lease, module, optimizer, link
compressors and the state of the step in progress (runtime/worker.py serves the RPCs around it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from fusionnode.compress.link import LinkCompressor, LinkOptions
from fusionnode.runtime.rounds import StageRounds
from fusionnode.sync import SyncConfig
from fusionnode.wire import job as jp


def mb_rows(tensors: dict[str, torch.Tensor]) -> int:
    """Samples in a micro-batch: the leading dimension of its tensors (0 if it has none)."""
    return min((int(t.shape[0]) for t in tensors.values() if t.dim() > 0), default=0)


class StageJob:
    """One accepted stage of one job on this worker."""

    def __init__(self, a: jp.StageAssignment, need_bytes: int, lease_s: float):
        self.job: str = a.job
        self.stage: int = a.stage  # global id of this stage among all pipelines of the job
        self.pos: int = a.position  # position in its pipeline
        self.num_stages: int = a.num_stages  # stages in its pipeline
        self.prev_stage: int = a.stage - 1 if a.prev_stage is None else a.prev_stage
        self.next_stage: int = a.stage + 1 if a.next_stage is None else a.next_stage
        self.replica: int = a.replica
        self.driver: str = a.driver
        self.prev: str = a.prev
        self.next: str = a.next
        self.description: dict[str, Any] = a.description
        self.param_specs: dict[str, dict[str, Any]] = a.param_specs
        self.recv_specs: dict[str, dict[str, Any]] = a.recv_specs
        self.send_specs: dict[str, dict[str, Any]] = a.send_specs
        self.send_names: list[str] = list(self.send_specs)
        self.shared_names: set[str] = set(a.shared_names)
        self.args_frozen: list[str] = list(a.frozen)  # parameters a LoRA job does not train
        self.spec: dict[str, Any] = a.spec
        opts = LinkOptions.from_wire(a.link_options)  # no dither: an older driver's counter (link.py)
        compress = str(self.spec.get("compress") or "none")
        key = (self.job, self.stage)  # keys the q8/q4 dither the checker recomputes (compress/dither.py)
        self.fwd = LinkCompressor(compress, opts, bandwidth_bps=a.bw_next, dither_key=key)  # activations on
        self.bwd = LinkCompressor(compress, opts, bandwidth_bps=a.bw_prev, dither_key=key)  # gradients back
        self.need_bytes: int = need_bytes
        self.flops_per_sample: float = a.flops_per_sample  # forward, for --debug pacing
        # offload: where the parameters live and this stage's contributor key at their hosts
        self.offload: jp.Offload | None = a.offload_plan
        # --sync diloco|sparseloco (issue 19): a local inner optimizer, pseudo-gradients every round
        self.sync = SyncConfig.from_dict(a.sync)
        # offload off with several pipelines: the rings that average gradients with the other replicas
        self.rings: list[jp.AllReduceRing] = a.rings
        self.rounds: StageRounds | None = None
        self.pull_task: asyncio.Future | None = None
        self.step_task: asyncio.Future | None = None
        self.starting: asyncio.Future | None = None  # job.start's build, once (a re-asked start awaits it)
        self.start_ref: tuple[int, int] = (0, 0)  # (feedback, optim) of that job.start
        self.step_task_step = -1  # the step step_task runs (or ran last)
        self.last_report: tuple[int, dict[str, Any]] | None = None  # (step, report) of the last finished step
        self.push_tasks: list[asyncio.Future] = []
        self.grad_counts: dict[str, int] = {}
        self.lease_s = lease_s
        self.lease_until = time.monotonic() + lease_s
        self.module: Any = None
        self.opt: torch.optim.Optimizer | None = None
        self.params: dict[str, torch.nn.Parameter] = {}
        self.busy = asyncio.Lock()
        self.ledger: Any = None  # verify.Ledger of the last step run with verification on
        self.ledgers: dict[int, Any] = {}  # step -> its Ledger, the last KEPT_LEDGERS steps (audits)
        self.last_step = -1
        self.step_now = -1
        self.micro_batches_now = 0
        # the sub-DAG runs on the GPU when there is one (bf16 autocast where supported); the wire
        # carries float32 either way, so peers on different devices interoperate
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.autocast = self.device.type == "cuda" and torch.cuda.is_bf16_supported()

    def renew(self) -> None:
        self.lease_until = time.monotonic() + self.lease_s

    @property
    def is_last(self) -> bool:
        return self.pos == self.num_stages - 1

    @property
    def is_first(self) -> bool:
        return self.pos == 0


def make_optimizer(params: dict[str, torch.nn.Parameter], spec_dict: dict[str, Any]) -> Any:
    """The stage's local optimizer: the optimizer hosts' code and math, on this stage's parameters."""
    from fusionnode.optim.optimizers import job_optimizer_config, make_local_optimizer

    shapes = {name: {"shape": list(p.shape)} for name, p in params.items()}
    return make_local_optimizer(params, job_optimizer_config(spec_dict, shapes))
