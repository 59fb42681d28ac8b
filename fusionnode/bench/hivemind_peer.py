"""One hivemind peer of `fusionnode bench testbed`'s comparison: hivemind's collaborative training
as its users run it, on FusionNode's job (model, data, seed, schedule, tokens per step).

    python -m fusionnode.bench.hivemind_peer --mode avg|local --index I --peers N --listen MADDR ...

What it runs: ``hivemind.optim.optimizer.Optimizer`` over a ``hivemind.dht.DHT`` in one of its two
modes:
- ``avg``: its default, synchronous mode: peers accumulate gradients until the swarm has processed
  ``target_batch_size`` samples (FusionNode's batch size per step), average them in an all-reduce and
  step the optimizer on the average (and, by its default ``average_state_every=1``, also average
  the parameters in the background every epoch);
- ``local``: ``use_local_updates=True``: every peer steps its own optimizer on its own gradients
  each local step, and the parameters are averaged every target batch (hivemind's local SGD).

The same job as FusionNode's: gpt2-tiny built by `build_job_model` (same seed, so every peer starts
from FusionNode's initial weights), the default corpus (`load_corpus`), AdamW with FusionNode's
betas, weight decay groups and gradient clipping, the learning rate of `lr_at` per epoch (hivemind
calls the scheduler once per target batch). In epoch e, each peer's first local step trains on its
share of FusionNode's batch of step e (the shares make up that batch), so the swarm's loss per
epoch is measured on the samples FusionNode's step e trains on; the further local steps a peer
takes while a round assembles draw windows of their own (seed derived from the job's seed and the
peer's index), `ceil(batch_size / peers)` samples each.

Pacing: the workers' own hook (runtime/hooks.py `PacingHook`, which FusionNode's testbed drives
through `debug_pace`): a forward of n samples takes at least n x the model's forward FLOPs per
sample / the emulated speed, and a backward twice that; the real computation runs, then the peer
sleeps out the rest.

Network: the DHT (and the averagers, which share its p2pd) start with FusionNode's `OptionsDHT` and
``LOCAL_ONLY``: no NAT port mapping, no AutoNAT, no relay service; they listen and announce only the
addresses given (loopback or the testbed's namespace addresses).

Protocol with the caller (bench/testbed.py, or `run_local_swarm` below): the peer writes
``<out>/peer<I>.addr.json`` (its peer id and addresses) once its DHT and optimizer are up, waits
for ``--go-file`` (which holds the common start time, Unix seconds), trains until its epoch reaches
``--steps``, and writes ``<out>/peer<I>.jsonl`` (one line per local step) and
``<out>/peer<I>.params.pt`` (its final parameters).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("avg", "local")
# hivemind's own guidance (hivemind.optim.optimizer.Optimizer's docstring, 1.1.12):
#   matchmaking_time=15.0  # 3-5s for small local runs, 10-15s for training over the internet or with many peers
#   averaging_timeout=60.0  # around of 2x the actual time it takes to run all-reduce
#   grad_compression=Float16Compression(), state_averaging_compression=Float16Compression()
#     "it is usually fine to use pure 16-bit ... during communication with no precaution"
SMALL_SWARM_MATCHMAKING_S = 5.0  # the upper end of "3-5s for small local runs": few peers, one machine
DEFAULT_AVERAGING_TIMEOUT_S = 60.0  # hivemind's default, the floor below
READY_TIMEOUT_S = 240.0  # seconds a peer waits for the swarm and the go file
OPTIMIZER_SHUTDOWN_S = 20.0  # seconds hivemind's Optimizer.shutdown gets before its averagers are killed
SHUTDOWN_GRACE_S = 90.0  # seconds the peers get to leave after the stop file (then they are killed)


def hivemind_settings(n_peers: int, param_bytes: int, slowest_link_bps: float) -> dict[str, Any]:
    """The settings of both hivemind modes, fixed before any run from hivemind's docstring guidance:
    matchmaking 5 s (a small swarm), averaging timeout about 2x an all-reduce's time on the slowest
    link (butterfly all-reduce: each peer sends (N-1)/N of the fp16 tensors and receives as much),
    never below hivemind's default of 60 s; fp16 compression of gradients and state."""
    fp16_bytes = param_bytes / 2
    allreduce_s = 2 * fp16_bytes * (n_peers - 1) / max(n_peers, 1) * 8 / max(slowest_link_bps, 1.0)
    return {
        "matchmaking_time": SMALL_SWARM_MATCHMAKING_S,
        "averaging_timeout": round(max(DEFAULT_AVERAGING_TIMEOUT_S, 2 * allreduce_s), 1),
        "compression": "fp16",
        "average_state_every": 1,
        "delay_state_averaging": True,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fusionnode.bench.hivemind_peer", description=__doc__)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--index", type=int, required=True, help="this peer's index (0 .. peers-1)")
    p.add_argument("--peers", type=int, required=True, help="peers in the swarm")
    p.add_argument("--run-id", default="fusionnode-bench", help="hivemind run_id (DHT key prefix)")
    p.add_argument("--listen", required=True, help="multiaddr to listen on, e.g. /ip4/127.0.0.1/tcp/0")
    p.add_argument("--announce", action="append", default=[], help="multiaddr to announce (repeatable)")
    p.add_argument("--initial-peer", action="append", default=[], help="bootstrap multiaddr (repeatable)")
    p.add_argument("--out", required=True, help="directory for this peer's files")
    p.add_argument("--go-file", required=True, help="file whose appearance starts training (holds t0)")
    p.add_argument("--steps", type=int, required=True, help="epochs (target batches) to train")
    p.add_argument("--batch-size", type=int, default=16, help="target_batch_size: samples per epoch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace-tflops", type=float, default=0.0, help="emulated device speed (0: no pacing)")
    p.add_argument("--matchmaking-time", type=float, default=SMALL_SWARM_MATCHMAKING_S)
    p.add_argument("--averaging-timeout", type=float, default=DEFAULT_AVERAGING_TIMEOUT_S)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="give up training after this long")
    args = p.parse_args(argv)
    if not 0 <= args.index < args.peers or args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
        p.error("need 0 <= --index < --peers, --steps, --batch-size and --seq-len >= 1")
    return args


def local_batch(batch_size: int, peers: int) -> int:
    """Samples per local step: the step's batch split over the peers, rounded up."""
    return max(1, math.ceil(batch_size / peers))


def make_optimizer_factory(grad_clip: float | None, betas: tuple[float, float], eps: float) -> Any:
    """callable(param groups) -> AdamW that first clips the global gradient norm (what FusionNode's
    step does before its optimizer): in averaging mode the averaged gradient is clipped, in local
    mode each peer's own."""
    import torch

    class ClippedAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            if grad_clip is not None:
                params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            return super().step(closure)

    def factory(groups: Any) -> Any:
        return ClippedAdamW(groups, betas=betas, eps=eps, foreach=False)

    return factory


def _forward_flops_per_sample(seq_len: int) -> float:
    from fusionnode.graph.trace import graph_for

    return float(graph_for("gpt2-tiny", seq_len).total_flops())


def run_peer(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    from hivemind.compression.floating import Float16Compression
    from hivemind.optim.optimizer import Optimizer

    from fusionnode.config import LOCAL_ONLY
    from fusionnode.runtime.hooks import PacingHook
    from fusionnode.swarm.libp2p import OptionsDHT
    from fusionnode.train.data import BatchSource, load_corpus, shard_ranges, step_seed
    from fusionnode.train.local import build_job_model, lm_loss
    from fusionnode.train.spec import ADAMW_BETAS, ADAMW_EPS, JobSpec, lr_at, weight_decay_for

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(
        model="gpt2-tiny",
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        warmup_steps=min(20, args.steps),
    )
    model = build_job_model(spec)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if weight_decay_for(name, p.ndim, spec) > 0 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay, "lr": spec.lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": spec.lr},
    ]
    b = local_batch(args.batch_size, args.peers)
    corpus = load_corpus()
    # the first local step of each epoch e trains on this peer's share of FusionNode's batch of step e
    # (the peers' shares make up that batch: the swarm's loss per epoch is measured on the very
    # samples FusionNode's step e trains on); further local steps in the same epoch (peers go on
    # computing while a round assembles) draw windows of their own
    step_source = BatchSource(corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    share = shard_ranges(
        [args.batch_size // args.peers + (i < args.batch_size % args.peers) for i in range(args.peers)],
        args.batch_size,
    )[args.index]
    source = BatchSource(
        corpus, batch_size=b, seq_len=args.seq_len, seed=step_seed(args.seed, args.index, "hivemind")
    )
    flops_per_sample = _forward_flops_per_sample(args.seq_len)

    dht = OptionsDHT(
        initial_peers=args.initial_peer or None,
        host_maddrs=[args.listen],
        announce_maddrs=args.announce or None,
        start=True,
        startup_timeout=120,
        options=LOCAL_ONLY,
    )
    fp16 = Float16Compression()
    opt = Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.batch_size,
        batch_size_per_step=b,
        params=groups,
        optimizer=make_optimizer_factory(spec.grad_clip, ADAMW_BETAS, ADAMW_EPS),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda epoch: lr_at(min(epoch, spec.steps - 1), spec) / spec.lr
        ),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        use_local_updates=args.mode == "local",
        grad_compression=fp16,
        state_averaging_compression=fp16,
        verbose=True,  # hivemind's progress lines ("Averaged gradients with N peers") go to the peer's log
    )
    addr = {
        "index": args.index,
        "peer_id": str(dht.peer_id),
        "maddrs": [str(m) for m in dht.get_visible_maddrs()],
    }
    tmp = out / f"peer{args.index}.addr.json.tmp"
    tmp.write_text(json.dumps(addr))
    tmp.replace(out / f"peer{args.index}.addr.json")

    # ready when every peer's record is in this peer's DHT (as a user starts every peer and waits
    # for them): the swarm is connected before the clock starts
    from hivemind.utils.timed_storage import get_dht_time

    key = f"{args.run_id}_bench_ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = 0
    while True:
        dht.store(key, subkey=str(args.index), value=1, expiration_time=get_dht_time() + READY_TIMEOUT_S)
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= args.peers:
            break
        if time.monotonic() > deadline:
            print(
                f"peer {args.index}: sees {seen} of {args.peers} peers after {READY_TIMEOUT_S:.0f} s",
                file=sys.stderr,
            )
            opt.shutdown()
            dht.shutdown()
            return 1
        time.sleep(0.5)
    (out / f"peer{args.index}.ready").write_text("")
    go = Path(args.go_file)
    while not go.exists():
        if time.monotonic() > deadline:
            print(f"peer {args.index}: no go file {go} after {READY_TIMEOUT_S:.0f} s", file=sys.stderr)
            opt.shutdown()
            dht.shutdown()
            return 1
        time.sleep(0.05)
    t0 = float(go.read_text().strip() or time.time())
    while time.time() < t0:
        time.sleep(0.01)

    # train until this peer's epoch reaches --steps (then save its parameters and say so), and go on
    # stepping, unlogged, until the caller's stop file says every peer is there: a peer that stops
    # at once would leave the others' last averaging round without partners (they would wait out
    # the averaging timeout and proceed alone, which is not how a swarm in the middle of a run runs)
    stop = go.with_name("stop")
    log = (out / f"peer{args.index}.jsonl").open("w", encoding="utf-8")
    pace = PacingHook(None)
    pace.pace_tflops = args.pace_tflops
    pace_loop = asyncio.new_event_loop()
    k = 0
    last_shared = -1
    done: dict[str, Any] | None = None
    try:
        while True:
            t = time.time() - t0
            if done is None and (opt.local_epoch >= args.steps or t > args.max_seconds):
                state = {n: x.detach().clone() for n, x in model.state_dict().items()}
                torch.save(state, out / f"peer{args.index}.params.pt")
                done = {
                    "complete": opt.local_epoch >= args.steps,
                    "local_steps": k,
                    "epoch": opt.local_epoch,
                    "t": t,
                }
                (out / f"peer{args.index}.done.json").write_text(json.dumps(done))
            if done is not None and (stop.exists() or t > args.max_seconds):
                break
            epoch = opt.local_epoch
            shared = epoch != last_shared and len(share) > 0 and epoch < args.steps
            if shared:
                x, y = (t[share.start : share.stop] for t in step_source.batch(epoch))
                last_shared = epoch
            else:
                x, y = source.batch(k)
            fwd_flops = flops_per_sample * x.size(0)
            # the workers' pacing hook: a forward at least fwd_flops at the emulated speed, a
            # backward twice that; the real computation runs, the hook sleeps out the rest
            c0 = time.perf_counter()
            loss = lm_loss(model(x), y)
            pace_loop.run_until_complete(pace.after_compute(time.perf_counter() - c0, fwd_flops))
            c1 = time.perf_counter()
            loss.backward()
            pace_loop.run_until_complete(pace.after_compute(time.perf_counter() - c1, 2.0 * fwd_flops))
            compute = time.perf_counter() - c0
            opt.step(batch_size=x.size(0))
            opt.zero_grad()
            if done is None:
                record = {
                    "k": k,
                    "epoch": epoch,
                    "epoch_after": opt.local_epoch,
                    "loss": loss.item(),
                    "samples": x.size(0),
                    "shared": shared,
                    "compute_s": compute,
                    "t": time.time() - t0,
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
            k += 1
    finally:
        pace_loop.close()
        log.close()
        shutdown(opt, dht)
    return 0


def shutdown(opt: Any, dht: Any, timeout_s: float = OPTIMIZER_SHUTDOWN_S) -> None:
    """hivemind's own shutdown, bounded: `Optimizer.shutdown` waits for a scheduled averaging round,
    which never assembles once the other peers have left; after `timeout_s` its averager processes
    are killed (its DHT, and the p2pd under it, are still shut down properly)."""
    import multiprocessing as mp
    import threading

    t = threading.Thread(target=opt.shutdown, name="optimizer-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        for proc in (getattr(opt, "state_averager", None), getattr(opt, "grad_averager", None)):
            if isinstance(proc, mp.Process) and proc.is_alive():
                proc.kill()
                proc.join(5)
    dht.shutdown()


def peer_command(
    *,
    mode: str,
    index: int,
    peers: int,
    listen: str,
    out: Path,
    go_file: Path,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    settings: dict[str, Any],
    run_id: str,
    announce: list[str] = (),  # type: ignore[assignment]
    initial_peers: list[str] = (),  # type: ignore[assignment]
    pace_tflops: float = 0.0,
    max_seconds: float = 1800.0,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "fusionnode.bench.hivemind_peer",
        *("--mode", mode, "--index", str(index), "--peers", str(peers), "--run-id", run_id),
        *("--listen", listen, "--out", str(out), "--go-file", str(go_file)),
        *("--steps", str(steps), "--batch-size", str(batch_size), "--seq-len", str(seq_len)),
        *("--seed", str(seed), "--pace-tflops", f"{pace_tflops:.6g}", "--max-seconds", str(max_seconds)),
        *("--matchmaking-time", str(settings["matchmaking_time"])),
        *("--averaging-timeout", str(settings["averaging_timeout"])),
    ]
    for a in announce:
        cmd += ["--announce", a]
    for a in initial_peers:
        cmd += ["--initial-peer", a]
    return cmd


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"a hivemind peer exited with status {dead[0].returncode} before it was up")
        time.sleep(0.1)
    raise RuntimeError(f"no {path.name} after {timeout:.0f} s")


def _wait_for_file(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} after {timeout:.0f} s")
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a hivemind peer exited with status {dead[0].returncode} before it was ready")
        time.sleep(0.1)


def _kill_group(p: subprocess.Popen) -> None:
    """Kills a peer and everything it forked (its DHT and averager processes, p2pd): each peer
    runs in a session of its own. Also reaps what is left of a peer that exited by itself."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def launch_swarm(
    commands: list[Any],
    out: Path,
    *,
    prefix: list[list[str]] | None = None,
    timeout_s: float = 1800.0,
    start_delay_s: float = 1.0,
    at_start: Any = None,
    at_end: Any = None,
) -> dict[str, Any]:
    """Starts the peers (`commands[i](initial_peers)` -> argv; peer 0 first, the others with peer
    0's addresses once it is up), releases them together, waits for all, and returns
    `collect_swarm(out, n)` plus "t0". `prefix[i]` is prepended to peer i's argv (e.g. `ip netns
    exec NS`). `at_start()` runs just before the start signal and `at_end()` once every peer has
    reached the last epoch (or one died), their results under "at_start" / "at_end" (e.g. byte
    counters). Peers that do not finish in `timeout_s` are stopped, then killed."""
    n = len(commands)
    out.mkdir(parents=True, exist_ok=True)
    go = out / "go"
    procs: list[subprocess.Popen] = []
    logs = []
    # hivemind's INFO lines ("Averaged gradients with 4 peers", "Proceeding with local gradients")
    # in every peer's log, whatever level the calling command set for itself
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HIVEMIND_LOGLEVEL": "INFO"}
    boot: dict[str, Any] = {}
    try:
        for i in range(n):
            initial = [] if i == 0 else commands[i].initial_from(boot)
            argv = [*(prefix[i] if prefix else []), *commands[i](initial)]
            logs.append((out / f"peer{i}.log").open("wb"))
            procs.append(
                subprocess.Popen(
                    argv, stdout=logs[-1], stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            if i == 0:
                boot = _wait_for(out / "peer0.addr.json", procs, READY_TIMEOUT_S)
        for i in range(n):
            _wait_for_file(out / f"peer{i}.ready", procs, READY_TIMEOUT_S)
        marks: dict[str, Any] = {"at_start": at_start() if at_start else None}
        t0 = time.time() + start_delay_s
        (out / "go.tmp").write_text(f"{t0:.6f}\n")
        (out / "go.tmp").replace(go)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all((out / f"peer{i}.done.json").exists() for i in range(n)):
                break
            if any(p.poll() is not None for p in procs):
                break  # one died: the rest stop too (their rounds would have no partner)
            time.sleep(0.2)
        marks["at_end"] = at_end() if at_end else None
        (out / "stop").write_text("")
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            try:
                p.wait(left)
            except subprocess.TimeoutExpired:
                _kill_group(p)
        rcs = [p.returncode for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
        for f in logs:
            f.close()
    res = collect_swarm(out, n)
    res["t0"] = t0
    res["exit_codes"] = rcs
    res.update(marks)
    return res


ROUND_LINES = {
    "averaged": re.compile(r"Averaged (?:gradients|parameters) with (\d+) peers"),
    "alone": re.compile(r"Proceeding with local gradients"),  # a gradient round without peers
    "failed": re.compile(r"Averaging gradients failed|Averaging failed|Discarding failed matchmaking"),
}


def count_rounds(log_text: str) -> dict[str, Any]:
    """What a peer's hivemind log says about its averaging rounds: how many it completed (and with
    how many peers on average), how many it went without, how many failed."""
    sizes = [int(m.group(1)) for m in ROUND_LINES["averaged"].finditer(log_text)]
    return {
        "averaged": len(sizes),
        "mean_group": sum(sizes) / len(sizes) if sizes else 0.0,
        "alone": len(ROUND_LINES["alone"].findall(log_text)),
        "failed": len(ROUND_LINES["failed"].findall(log_text)),
    }


def collect_swarm(out: Path, n: int) -> dict[str, Any]:
    """Every peer's step log, end state and averaging-round counts, read back from `out`."""
    peers = []
    for i in range(n):
        log_path = out / f"peer{i}.log"
        rounds = count_rounds(log_path.read_text(errors="replace")) if log_path.exists() else None
        log = out / f"peer{i}.jsonl"
        steps = (
            [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            if log.exists()
            else []
        )
        done = out / f"peer{i}.done.json"
        peers.append(
            {
                "index": i,
                "steps": steps,
                "done": json.loads(done.read_text()) if done.exists() else None,
                "params": str(out / f"peer{i}.params.pt") if (out / f"peer{i}.params.pt").exists() else None,
                "rounds": rounds,
            }
        )
    return {"peers": peers}


class PeerCommand:
    """argv of one peer given its bootstrap peers (callable); `initial_from(boot)` picks peer 0's
    addresses this peer can reach (`boot_address(boot)`, default: all of them)."""

    def __init__(self, kwargs: dict[str, Any], boot_address: Any = None):
        self.kwargs = kwargs
        self.boot_address = boot_address

    def initial_from(self, boot: dict[str, Any]) -> list[str]:
        if self.boot_address is not None:
            return [self.boot_address(boot)]
        return list(boot["maddrs"])

    def __call__(self, initial: list[str]) -> list[str]:
        return peer_command(**self.kwargs, initial_peers=initial)


def run_local_swarm(
    mode: str,
    peers: int,
    out: Path,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    pace_tflops: list[float] | None = None,
    settings: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    at_start: Any = None,
) -> dict[str, Any]:
    """`peers` hivemind peers on loopback (127.0.0.1 only, NAT features off), for tests."""
    settings = settings or hivemind_settings(peers, 4 * 842496, 1e9)
    commands = [
        PeerCommand(
            {
                "mode": mode,
                "index": i,
                "peers": peers,
                "listen": "/ip4/127.0.0.1/tcp/0",
                "out": out,
                "go_file": out / "go",
                "steps": steps,
                "batch_size": batch_size,
                "seq_len": seq_len,
                "seed": seed,
                "settings": settings,
                "run_id": f"fn-bench-{os.getpid()}-{mode}",
                "pace_tflops": (pace_tflops or [0.0] * peers)[i],
                "max_seconds": timeout_s,
            }
        )
        for i in range(peers)
    ]
    return launch_swarm(commands, out, timeout_s=timeout_s, at_start=at_start)


def main(argv: list[str] | None = None) -> int:
    return run_peer(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
