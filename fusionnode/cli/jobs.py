"""The commands about training jobs: `train` (on the swarm, or --local) and `cancel`.

Also the job options `train` and `demo` share, the JobSpec built from them, and following a job's
events (plan, steps, failures, re-plans) to its result."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from fusionnode.cli.args import (
    command,
    compress_arg,
    control_path,
    float_above,
    float_at_least,
    fraction,
    int_at_least,
    run,
    state_dir_arg,
)
from fusionnode.errors import FusionNodeError
from fusionnode.messages import format_event, format_plan, next_steps
from fusionnode.sync import add_sync_args, sync_from_args
from fusionnode.term import Progress


def add_cancel_command(sub: Any) -> None:
    p = command(
        sub,
        "cancel",
        "cancel a job the local daemon drives (its stages are released)",
        "Cancel a training job that the local daemon drives: its `train` call ends with the job "
        "cancelled and its workers and optimizer hosts release the job's stages and shards.",
    )
    state_dir_arg(p)
    p.add_argument("job", help="the job id (as `fusionnode status` shows it)")


def add_train_command(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on the swarm (this peer drives), or --local in this process",
        description="Start a training job. The local daemon becomes the job's driver and uses "
        "the swarm's workers; --local runs the same job in this process, no swarm.",
    )
    state_dir_arg(p)
    add_train_job_args(p)
    p.add_argument(
        "--local",
        action="store_true",
        help="single process, no swarm: the reference trajectory (default: train on the swarm)",
    )
    p.add_argument(
        "--stages",
        type=int_at_least(1),
        default=None,
        help="pipeline stages; refused if the swarm has fewer workers (default: one per available worker)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=None,
        metavar="PEER_ID",
        help="use exactly these worker peer ids, in order (default: any available workers)",
    )
    p.add_argument(
        "--replicas",
        type=int_at_least(1),
        default=1,
        help="data-parallel pipelines; they synchronise through optimizer hosts, or with --offload off "
        "by ring all-reduce between the replicas of each stage (default %(default)s)",
    )
    p.add_argument(
        "--shares",
        default=None,
        help="samples of each step's batch per pipeline, e.g. 4,12 (sets --replicas; default: an even split)",
    )
    p.add_argument(
        "--offload",
        choices=["auto", "on", "off"],
        default="auto",
        help="optimizer state on optimizer hosts (on), on each worker (off), or on whenever a peer offers "
        "the optimizer role (auto, the default); offloaded jobs survive failed workers",
    )
    p.add_argument(
        "--planner",
        choices=["simple", "fusion", "even", "grid", "memory"],
        default=None,
        help="how to lay the job over the swarm: fusion (OP-Fence + asymmetric DP x PP over measured "
        "devices and links; the default), simple (one pipeline, balanced contiguous stages; the default "
        "when --stages, --replicas or --shares lay the job out), or a baseline "
        "(even: one pipeline, layers split evenly; grid: the best even grid of k pipelines under the "
        "planner's cost model; memory: layers in proportion to memory)",
    )
    p.add_argument(
        "--verify-policy",
        choices=("auto", "off", "sample", "all"),
        default="auto",
        help="spot-check the workers' work by recomputing a random share of micro-batches: auto = "
        "sample in a public swarm, off in a private one or a local one (the daemon listens on loopback "
        "only) (default %(default)s)",
    )
    p.add_argument(
        "--verify-rate",
        type=fraction,
        default=None,
        metavar="P",
        help="with --verify-policy sample: probability that a micro-batch of a stage is checked, and "
        "that a stage's step is checked whole, all its micro-batches and parameter gradients (default "
        "0 and 0.45 in a public swarm: verify/policy.py; 0.05 in a private or local one)",
    )
    p.add_argument(
        "--verifier",
        default=None,
        metavar="PEER_ID|local|process",
        help="where the checks' recomputes run: process = this daemon's idle-priority check process "
        "(the default), local = a thread of the daemon, or the id of a peer you run that serves checks "
        "(`join --serve-checks --serve-checks-for <this daemon's peer id>`, say on a core or machine the swarm does not use): its verdicts are "
        "trusted as your own (SECURITY.md); while it cannot be reached they run in the check process",
    )
    p.add_argument(
        "--contrib-policy",
        choices=("auto", "off", "clip", "score"),
        default="auto",
        help="weigh the data-parallel replicas' contributions on the optimizer hosts: clip = a replica's "
        "gradient or pseudo-gradient whose norm exceeds --contrib-clip x the median is scaled down; "
        "score (--sync diloco|sparseloco) = also the driver scores each round's contributions on a "
        "held-out batch and drops those that do not help; auto = score (rounds) or clip (--sync step) "
        "in a public swarm, off in a private or local one (default %(default)s)",
    )
    p.add_argument(
        "--contrib-clip",
        type=float_at_least(1.0),
        default=None,
        metavar="X",
        help="with --contrib-policy clip|score: the multiple of the median norm above which a "
        "replica's gradient or pseudo-gradient is scaled down (default 2 for rounds, 5 for --sync step)",
    )
    p.add_argument(
        "--rebalance-every",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="every N steps, re-plan if measured stage times promise a faster layout, by a gain that "
        "clears the measured timing noise, from the same bottleneck peer that slowed down, at two "
        "checks in a row (with --offload off a moved stage takes its optimizer state along; 0 = never; "
        "default: every 2 steps, never under the --sync round modes)",
    )
    p.add_argument(
        "--reshape",
        action="store_true",
        help="with --stages, --replicas, --shares or a baseline --planner: they lay out the first plan "
        "only; while a peer is a clear straggler, rebalancing may re-plan the job with the planner at "
        "the measured speeds, which may change the number of pipelines and stages (default: the "
        "shape given is kept; share moves and re-splits only)",
    )
    p.add_argument(
        "--rebalance-gain",
        type=float_at_least(0),
        default=0.25,
        help="predicted speed-up a re-plan must promise, counting the cost of moving (default %(default)s)",
    )
    p.add_argument(
        "--lease",
        type=float_above(0),
        default=None,
        metavar="SECONDS",
        help="how long a worker keeps its stage when this driver goes silent (default 60)",
    )
    p.add_argument(
        "--optimizer-hosts",
        type=int_at_least(1),
        default=1,
        help="optimizer hosts to shard the state over, with --offload (default %(default)s)",
    )
    add_sync_args(p)  # issue 19: --sync, --inner-steps, --outer-lr, ...
    p.add_argument("--dump-grads", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--json",
        action="store_true",
        help="print progress and the result as JSON lines (default: a progress line and a summary)",
    )


def add_train_job_args(p: argparse.ArgumentParser) -> None:
    from fusionnode.train import spec as S

    p.add_argument(
        "--model",
        default=None,
        help="bundled model (gpt2-tiny ... gpt2-xl, llama-tiny, qwen2-tiny, llama-1b, llama-7b, mistral-7b), "
        "a Hugging Face config.json or the directory holding one (llama, qwen2, mistral, gpt2), or "
        f"'package.module:factory' (default: the --init-from directory if given, else {S.DEFAULT_MODEL})",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of this local Hugging Face checkpoint (config.json + *.safetensors, "
        "sharded or not); nothing is downloaded (default: none, random initialisation from --seed)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a Hugging Face tokenizer.json (see `fusionnode tokenizer train`); its vocabulary must fit "
        "the model's (default: byte-level tokens, 256 ids)",
    )
    p.add_argument(
        "--text-field",
        default=S.DEFAULT_TEXT_FIELD,
        help="the field holding the text in .jsonl / .parquet --data files (default %(default)s)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="train LoRA adapters of rank R on --lora-targets with every other parameter frozen; only the "
        "adapters' gradients go to the optimizer hosts (default 0: no LoRA, train every parameter)",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        default=S.DEFAULT_LORA_ALPHA,
        help="LoRA scale numerator: the update is B @ A * alpha / rank (default %(default)s)",
    )
    p.add_argument(
        "--lora-targets",
        default=S.DEFAULT_LORA_TARGETS,
        help="comma-separated names of the linear layers to adapt, matched as module-name suffixes, e.g. "
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (Llama) or c_attn,c_proj,c_fc (GPT-2) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="a text file or directory of text files (default: the Python "
        "standard library's source, present on every machine)",
    )
    p.add_argument(
        "--steps",
        type=int_at_least(1),
        default=S.DEFAULT_STEPS,
        help="optimizer steps (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=S.DEFAULT_BATCH_SIZE,
        help="sequences per step (default %(default)s)",
    )
    p.add_argument(
        "--micro-batches",
        type=int_at_least(1),
        default=4,
        help="micro-batches per step in the pipeline (default %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        type=int_at_least(1),
        default=None,
        help="tokens per sequence (default: the model's context)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        help="seed of the model's initialisation and the data order (default %(default)s)",
    )
    p.add_argument(
        "--optimizer", choices=S.OPTIMIZERS, default="adamw", help="the optimizer (default %(default)s)"
    )
    p.add_argument(
        "--lr", type=float_above(0), default=S.DEFAULT_LR, help="peak learning rate (default %(default)s)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int_at_least(0),
        default=S.DEFAULT_WARMUP_STEPS,
        help="steps of linear learning-rate warm-up before the cosine decay (default %(default)s)",
    )
    p.add_argument(
        "--weight-decay",
        type=float_at_least(0),
        default=S.DEFAULT_WEIGHT_DECAY,
        help="decoupled weight decay on matrices (default %(default)s)",
    )
    p.add_argument(
        "--grad-clip",
        type=float_at_least(0),
        default=S.DEFAULT_GRAD_CLIP,
        help="clip the gradients' global norm to this; 0 = off (default %(default)s)",
    )
    p.add_argument(
        "--save",
        dest="save_dir",
        default=None,
        metavar="DIR",
        help="write checkpoints under DIR (default: none are written)",
    )
    p.add_argument(
        "--save-every",
        type=int_at_least(0),
        default=S.DEFAULT_SAVE_EVERY,
        help="steps between checkpoints; 0 = only at the end (default %(default)s)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last complete checkpoint in --save (default: start afresh)",
    )
    p.add_argument(
        "--metrics-out",
        default=None,
        help="write one JSON record per step (and events) to this file (default: none)",
    )
    p.add_argument(
        "--compress",
        type=compress_arg,
        default="auto",
        help="activations and their gradients between stages: none, fp16, topk:RATIO, adatopk (ratio "
        "chosen per link from its measured bandwidth, dense where the link keeps up, never below "
        "AdaTopK's keep-ratio floor), or auto (the default: adatopk, spot-checked jobs included: the "
        "checks judge what a stage sent within its link codec's error bound)",
    )


def spec_from_args(args: argparse.Namespace) -> Any:
    from fusionnode.train.spec import DEFAULT_MODEL, JobSpec

    init_from = os.path.abspath(args.init_from) if args.init_from else None
    model = args.model or init_from or DEFAULT_MODEL
    if os.path.exists(model):  # a Hugging Face config: pin the path so the daemon reads the same file
        model = os.path.abspath(model)
    return JobSpec(
        model=model,
        init_from=init_from,
        tokenizer=os.path.abspath(args.tokenizer) if args.tokenizer else None,
        text_field=args.text_field,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip or None,
        save_dir=os.path.abspath(args.save_dir) if args.save_dir else None,
        save_every=args.save_every,
        compress=args.compress,
        metrics_out=os.path.abspath(args.metrics_out) if args.metrics_out else None,
    )


def planner_of(args: argparse.Namespace) -> str:
    """`--planner`, or the default: the planner (fusion), measured never slower than simple on one
    machine (README, "Defaults"), unless --stages, --replicas or --shares lay the job out, which
    simple follows."""
    if args.planner:
        return args.planner
    if args.stages or args.replicas > 1 or args.shares:
        return "simple"
    return "fusion"


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    args.planner = planner_of(args)
    try:
        spec = spec_from_args(args)
    except FusionNodeError as exc:
        parser.error(str(exc))
    if args.resume and not spec.save_dir:
        parser.error("--resume needs --save DIR (where the checkpoints are)")
    try:
        from fusionnode.train.verifier_peer import check_verifier

        check_verifier(args.verifier)
        sync = sync_from_args(args)
    except FusionNodeError as exc:
        parser.error(str(exc))
    if args.contrib_policy == "score" and not sync.rounds:
        parser.error(
            "--contrib-policy score judges round contributions: use --sync diloco|sparseloco (or clip)"
        )
    if args.local and (sync.rounds or args.replicas > 1 or args.shares):
        shares = _parse_shares(args.shares, parser)
        if (
            args.round_steps
        ):  # --round-close time: a swarm run's schedule, replayed (train/free_rounds_local.py)
            from fusionnode.train.free_rounds_local import check_schedule, load_restarts, load_schedule

            try:
                schedule = load_schedule(args.round_steps)
                args.round_restarts = load_restarts(args.round_steps)  # after a recovery: new plans
                args.round_steps = schedule
                check_schedule(spec, sync, len(shares) if shares else args.replicas, args.round_steps)
            except FusionNodeError as exc:
                parser.error(str(exc))
        return _train_local_replicas(spec, sync, args, shares)
    if args.local:
        return _train_local(spec, args)

    params = {
        "spec": spec.to_dict(),
        "resume": args.resume,
        "stages": args.stages,
        "peers": args.peers,
        "replicas": args.replicas,
        "offload": args.offload,
        "optimizer_hosts": args.optimizer_hosts,
        "planner": args.planner,
        "rebalance_every": args.rebalance_every,
        "rebalance_gain": args.rebalance_gain,
        "reshape": args.reshape,
        "lease_s": args.lease,
        "shares": _parse_shares(args.shares, parser),
        "sync": sync.to_dict(),
        "dump_grads": os.path.abspath(args.dump_grads) if args.dump_grads else None,
        "verify_policy": args.verify_policy,
        "verify_rate": args.verify_rate,
        "verifier": args.verifier,
        "contrib_policy": args.contrib_policy,
        "contrib_clip": args.contrib_clip,
    }
    progress = Progress(spec.steps)

    async def go() -> dict[str, Any]:
        return await follow_job(control_path(args), params, progress, as_json=args.json)

    try:
        result = run(go())
    finally:
        progress.close()
    if args.json:
        print(json.dumps({"result": result}))
    else:
        print_train_summary(result)
    return 0


def _parse_shares(text: str | None, parser: argparse.ArgumentParser) -> list[int] | None:
    if not text:
        return None
    try:
        shares = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--shares {text!r}: expected comma-separated integers such as 4,12")
    if min(shares) < 1:
        parser.error("--shares: every share must be at least 1")
    return shares


async def follow_job(
    control_path: Path, params: dict[str, Any], progress: Progress, *, as_json: bool = False
) -> dict[str, Any]:
    """Runs a training job through the daemon at `control_path` (it drives), showing the plan, the
    progress and any failure or re-plan as they happen; returns the job's result."""
    from fusionnode import control

    async for obj in control.call_stream(control_path, "train", params, timeout=None):
        if "event" not in obj:
            return obj["result"]
        ev = obj["event"]
        if as_json:
            print(json.dumps(ev), flush=True)
        elif ev.get("type") == "step":
            progress.update(ev)
        elif ev.get("type") == "plan":
            progress.print("\n".join(format_plan(ev)))
        else:
            progress.print(f"  {format_event(ev)}")
    raise FusionNodeError("the driver closed the job without a result")


def print_train_summary(result: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    print(
        f"job {result['job']}: {result['steps']} steps, loss {s.get('first_loss', float('nan')):.4f} -> "
        f"{result['loss']:.4f} (validation {result['val_loss']:.4f}), {result['tokens_per_s']:.0f} tokens/s"
    )
    if result.get("checkpoint"):
        print(f"checkpoint: {result['checkpoint']}")
        print(next_steps(result["checkpoint"]))
    if result.get("metrics_out"):
        print(f"metrics:    {result['metrics_out']}")
    print("sample:\n" + result.get("sample", ""))


def _train_local(spec: Any, args: argparse.Namespace) -> int:
    import torch

    from fusionnode.train.local import train_local

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    progress = Progress(spec.steps)

    def show(rec: dict[str, Any]) -> None:
        tokens_per_s = rec.get("tokens", 0) / max(rec.get("step_time_s", 0.0), 1e-9)
        progress.update({"wire_bytes": 0, "tokens_per_s": tokens_per_s, **rec})

    res = train_local(spec, progress=show, resume=args.resume)
    print(
        f"local: {len(res.losses)} steps, loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f} "
        f"(validation {res.val_loss:.4f}), {res.tokens_per_s:.0f} tokens/s"
    )
    if res.checkpoint:
        print(f"checkpoint: {res.checkpoint}")
        print(next_steps(res.checkpoint))
    return 0


def _train_local_replicas(spec: Any, sync: Any, args: argparse.Namespace, shares: list[int] | None) -> int:
    """`train --local` with several replicas or a round sync mode: the in-process reference."""
    import torch

    from fusionnode.train.replicas import train_local_replicas

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    progress = Progress(spec.steps)

    def show(rec: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps({"type": "step", **rec}), flush=True)
            return
        tokens_per_s = rec.get("tokens", 0) / max(rec.get("step_time_s", 0.0), 1e-9)
        progress.update({"tokens_per_s": tokens_per_s, **rec})

    try:
        res = train_local_replicas(
            spec,
            sync,
            replicas=args.replicas,
            shares=shares,
            progress=show,
            round_steps=args.round_steps,
            **getattr(args, "round_restarts", None) or {},
        )
    finally:
        progress.close()
    print(
        f"local x{res.replicas} --sync {sync.mode} (H={sync.inner_steps}): {len(res.losses)} steps, "
        f"{res.rounds} rounds, loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f} (validation "
        f"{res.val_loss:.4f}), sync bytes {res.bytes_up:,} up, {res.bytes_down:,} down"
    )
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from fusionnode import control

    res = run(control.call(control_path(args), "cancel", {"job": args.job}, timeout=None))
    print(f"job {res['job']}: {res['state']}")
    return 0
