"""Sync-mode benchmark: bytes to a target loss, and the final loss at equal tokens, for
`--sync step`, `--sync diloco` and `--sync sparseloco` (issue 19).

Method.
- The in-process reference (`train.replicas.train_local_replicas`): `--replicas` replicas of
  gpt2-tiny on the default corpus, the same seed, batch (split evenly between the replicas) and
  tokens per step for every mode; `--steps` steps each.
- Bytes: what the replicas and the optimizer hosts exchange for data-parallel sync, counted as
  each encoded tensor's msgpack form (descriptor and payload; frame headers not counted):
  step = every trainable tensor as raw float32, gradients up and parameters down, every step;
  diloco = the pseudo-gradient up and the outer update down in the sync codec, once per round;
  sparseloco = the ctopk2 message up, every other replica's message relayed down (a replica keeps
  the message it sent: ROUNDS.md), once per round.
  Traffic between the stages of one pipeline is the same in every mode and is not counted.
- Validation loss (`EVAL_BATCHES` fixed batches) of the shared parameters every `--eval-every`
  steps (a multiple of every H, so always at a round's end). The target loss is the lowest
  validation loss every mode reaches (stated); each mode's bytes to the target are its
  cumulative bytes at its first evaluation at or below it. Two more targets are reported: the
  step mode's validation loss at half and at three quarters of the run.
- Contenders, fixed before the run: step; diloco (the paper's Nesterov outer step, lr 0.7, momentum
  0.9, raw codec); diloco-avg (outer lr `--outer-lr`, 1 = plain parameter averaging; Nesterov momentum
  `--outer-momentum`, default 0);
  sparseloco (density 1/16 in chunks of 256, EF decay 0.95, outer lr `--outer-lr`, default 1). The
  H and SparseLoCo defaults were picked from one 200-step pilot (batch 16 x 64 tokens, 2 replicas);
  nothing is tuned per run. `--testbed-config fusionnode-dp` takes its outer lr (2) too, and adds
  diloco-dp: the testbed's DiLoCo outer step (bench/systems.py `DP_DILOCO`) at the run's H.

Run: fusionnode bench sync [--steps 300] [--replicas 2] [--inner-steps 10] [--shares 6,5,3,2] [--json]
`--testbed-config fusionnode-dp` takes the testbed's configuration for slow links (bench/systems.py `DP_SYNC`,
`DP_OPTIONS`: its H, SparseLoCo settings, one replica per device of `--cluster` with batch shares by
device speed) and the testbed's job (seq 128), so the bytes and quality figures use the same H and
options as the speed criterion; any option given explicitly still wins.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from fusionnode.errors import ConfigError
from fusionnode.sync import DEFAULT_EF_DECAY, SyncConfig
from fusionnode.train.replicas import train_local_replicas
from fusionnode.train.spec import JobSpec

DEFAULT_STEPS = 300
DEFAULT_REPLICAS = 2
DEFAULT_BATCH = 16
DEFAULT_SEQ_LEN = 64
DEFAULT_H = 10  # inner steps per round for diloco and sparseloco
DEFAULT_SPARSE_DENSITY = 1 / 16  # sparseloco: share of each chunk sent
DEFAULT_SPARSE_CHUNK = 256  # sparseloco: u8 indices
DEFAULT_WARMUP = 20
TESTBED_SEQ_LEN = 128  # `bench testbed`'s job (--testbed-config fusionnode-dp)


def configs(args: argparse.Namespace) -> dict[str, SyncConfig]:
    """The contenders, fixed before the run: step; DiLoCo with the paper's outer step (Nesterov, lr
    0.7, momentum 0.9); DiLoCo with a plain averaged outer step (lr 1, momentum 0: local SGD); and
    SparseLoCo."""
    lap = {
        "overlap": bool(args.sync_overlap),
        "overlap_steps": args.overlap_steps,
        "warmup_steps": args.sync_warmup,
        "warmup_inner_steps": args.warmup_inner_steps,
    }
    every = {
        "step": SyncConfig(),
        "diloco": SyncConfig("diloco", inner_steps=args.inner_steps, **lap),
        "diloco-avg": SyncConfig(
            "diloco",
            inner_steps=args.inner_steps,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            **lap,
        ),
        "sparseloco": SyncConfig(
            "sparseloco",
            inner_steps=args.sparse_inner_steps or args.inner_steps,
            topk_density=args.topk_density,
            chunk=args.topk_chunk,
            ef_decay=args.ef_decay,
            outer_lr=args.outer_lr,
            **lap,
        ),
    }
    if getattr(args, "testbed_config", None):
        from fusionnode.bench.systems import DP_DILOCO

        # the testbed's DiLoCo (fusionnode-dp-diloco): its outer step at this run's H and overlap
        every["diloco-dp"] = SyncConfig(
            "diloco",
            inner_steps=args.inner_steps,
            outer_lr=DP_DILOCO.outer_lr,
            outer_momentum=DP_DILOCO.outer_momentum,
            **lap,
        )
    modes = args.modes.split(",") if args.modes else list(every)
    unknown = [m for m in modes if m not in every]
    if unknown:
        raise SystemExit(f"--modes {args.modes!r}: unknown {unknown}; expected some of {', '.join(every)}")
    tag = getattr(args, "tag", "") or ""
    return {(m if m == "step" else f"{m}{tag}"): every[m] for m in modes}


def apply_config(args: argparse.Namespace, given: set[str]) -> None:
    """`--testbed-config fusionnode-dp`: the testbed configuration's H, SparseLoCo settings, replicas and
    speed shares (over `--cluster`'s devices), and the testbed's sequence length; options the user
    gave (`given`) are kept."""
    if not args.testbed_config:
        return
    from fusionnode.bench.systems import DP_NAME, DP_SYNC, speed_shares
    from fusionnode.plan.cluster import load_cluster

    if args.testbed_config != DP_NAME:
        raise SystemExit(f"--testbed-config {args.testbed_config!r}: expected {DP_NAME}")
    speeds = [d.tflops for d in load_cluster(args.cluster).devices]
    preset = {
        "inner_steps": DP_SYNC.inner_steps,
        "topk_density": DP_SYNC.topk_density,
        "topk_chunk": DP_SYNC.chunk,
        "ef_decay": DP_SYNC.ef_decay,
        "outer_lr": DP_SYNC.outer_lr,
        "sync_overlap": DP_SYNC.overlap,
        "overlap_steps": DP_SYNC.overlap_steps,
        "seq_len": TESTBED_SEQ_LEN,
    }
    for key, value in preset.items():
        if key not in given:
            setattr(args, key, value)
    if "shares" not in given and "replicas" not in given:
        args.shares = ",".join(str(n) for n in speed_shares(args.batch_size, speeds))


def given_options(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The options the command line gives explicitly (their dests)."""
    saved = {a.dest: a.default for a in p._actions}
    try:
        for a in p._actions:
            a.default = argparse.SUPPRESS
        return set(vars(p.parse_args(argv)))
    finally:
        for a in p._actions:
            a.default = saved[a.dest]


def parse_shares(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        shares = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shares {text!r}: expected integers separated by commas") from None
    if any(n < 1 for n in shares):
        raise SystemExit(f"--shares {text!r}: every share must be >= 1")
    return shares


def bytes_to_target(records: list[dict[str, Any]], target: float) -> tuple[int | None, int | None]:
    """(bytes, step) at the first evaluation at or below `target`; (None, None) if never."""
    for rec in records:
        if rec.get("val_loss", math.inf) <= target:
            h = rec["optimizer_hosts"][0]
            return h["received_bytes"] + h["sent_bytes"], rec["step"]
    return None, None


def train_rows(args: argparse.Namespace) -> dict[str, Any]:
    """Train every mode of `configs(args)`; its rows and the run's settings (`--rows-out` writes them,
    `--combine` joins runs of different modes)."""
    torch.set_num_threads(args.threads)
    spec = JobSpec(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        warmup_steps=min(DEFAULT_WARMUP, args.steps),
        seed=args.seed,
    )
    shares = parse_shares(args.shares)
    cfgs = configs(args)
    # every mode's H, also those --modes leaves out: runs of one mode each evaluate alike
    hs = [c.inner_steps for c in configs(argparse.Namespace(**{**vars(args), "modes": None})).values()]
    eval_every = args.eval_every or math.lcm(*hs)
    if any(eval_every % h for h in hs):
        raise SystemExit(f"--eval-every {eval_every} must be a multiple of every H ({hs})")
    rows: dict[str, dict[str, Any]] = {}
    for name, cfg in cfgs.items():
        t0 = time.perf_counter()
        res = train_local_replicas(spec, cfg, replicas=args.replicas, shares=shares, eval_every=eval_every)
        rows[name] = {
            "sync": cfg.to_dict(),
            "records": [r for r in res.records if "val_loss" in r],
            "final_val_loss": res.val_loss,
            "final_train_loss": sum(res.losses[-10:]) / len(res.losses[-10:]),
            "bytes": res.bytes_up + res.bytes_down,
            "rounds": res.rounds,
            "wall_s": time.perf_counter() - t0,
        }
    meta = {
        "replicas": len(shares) if shares else args.replicas,
        "shares": shares,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens": args.steps * args.batch_size * args.seq_len,
        "eval_every": eval_every,
        "seed": args.seed,
    }
    return {"meta": meta, "modes": rows}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of different modes as one (`--combine`): the same job (settings) or an error."""
    meta = dict(runs[0]["meta"])
    rows: dict[str, Any] = {}
    every = set()
    for r in runs:  # validations may be spaced differently (each run's H); the job must be the same
        if {**r["meta"], "eval_every": 0} != {**meta, "eval_every": 0}:
            raise SystemExit(f"--combine: runs of different jobs: {r['meta']} vs {meta}")
        every.add(r["meta"]["eval_every"])
        rows.update(r["modes"])
    meta["eval_every"] = min(every) if len(every) == 1 else sorted(every)
    return {"meta": meta, "modes": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return summarise(train_rows(args), args.target)


def summarise(trained: dict[str, Any], target: float | None) -> dict[str, Any]:
    rows = trained["modes"]
    if "step" not in rows:
        raise SystemExit("the summary compares with --sync step: include the step mode")
    target = target or max(min(r["val_loss"] for r in row["records"]) for row in rows.values())
    step_final = rows["step"]["final_val_loss"]
    for row in rows.values():
        row["bytes_to_target"], row["step_at_target"] = bytes_to_target(row["records"], target)
        row["final_vs_step"] = row["final_val_loss"] / step_final - 1
    base = rows["step"]["bytes_to_target"]
    for row in rows.values():
        b = row["bytes_to_target"]
        row["fewer_bytes_than_step"] = (base / b) if (base and b) else None
    # more targets: the step mode's validation loss at half and three quarters of the run
    evals = rows["step"]["records"]
    extra = (
        [evals[len(evals) // 2 - 1]["val_loss"], evals[(3 * len(evals)) // 4 - 1]["val_loss"]]
        if evals
        else []
    )
    targets = []
    for t in [target, *extra]:
        got = {name: bytes_to_target(row["records"], t) for name, row in rows.items()}
        b0 = got["step"][0]
        per = {
            name: {"bytes": b, "step": st, "fewer_than_step": (b0 / b) if (b0 and b) else None}
            for name, (b, st) in got.items()
        }
        targets.append({"target": t, "modes": per})
    return {**trained["meta"], "targets": targets, "target_val_loss": target, "modes": rows}


def _fmt_bytes(n: int | None) -> str:
    return "not reached" if n is None else f"{n / 1e6:,.2f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fusionnode bench sync", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per mode (default %(default)s)")
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS, help="replicas (default %(default)s)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help="sequences per step, all replicas (default %(default)s)",
    )
    p.add_argument(
        "--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence (default %(default)s)"
    )
    p.add_argument(
        "--inner-steps", type=int, default=DEFAULT_H, help="H for diloco and sparseloco (default %(default)s)"
    )
    p.add_argument(
        "--sparse-inner-steps", type=int, default=None, help="H for sparseloco (default: --inner-steps)"
    )
    p.add_argument(
        "--topk-density",
        type=float,
        default=DEFAULT_SPARSE_DENSITY,
        help="sparseloco share per chunk (default 1/16)",
    )
    p.add_argument(
        "--topk-chunk",
        type=int,
        default=DEFAULT_SPARSE_CHUNK,
        help="sparseloco chunk length (default %(default)s)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="steps between validations (default 0: the lcm of every mode's H)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="target validation loss (default: the lowest every mode reaches)",
    )
    p.add_argument(
        "--ef-decay",
        type=float,
        default=DEFAULT_EF_DECAY,
        help="sparseloco error-feedback decay (default %(default)s)",
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=1.0,
        help="outer learning rate of the averaged outer steps, sparseloco and diloco-avg (default "
        "%(default)s: the plain average)",
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.0,
        help="diloco-avg: Nesterov momentum of its outer step (default %(default)s: the averaged step)",
    )
    p.add_argument(
        "--shares",
        default=None,
        help="samples per step of each replica, comma-separated (default: the batch split evenly)",
    )
    p.add_argument(
        "--testbed-config",
        default=None,
        help="take H, the SparseLoCo settings, the replicas and shares from a testbed configuration: "
        "fusionnode-dp (bench/systems.py)",
    )
    p.add_argument(
        "--cluster",
        default="home-volunteers-4",
        help="with --testbed-config: the cluster whose device speeds give the shares (default %(default)s)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of step,diloco,diloco-avg,sparseloco, and diloco-dp with "
        "--testbed-config (default: all)",
    )
    p.add_argument(
        "--sync-overlap",
        action="store_true",
        help="round modes: overlap each round's exchange with the next round's inner steps",
    )
    p.add_argument("--overlap-steps", type=int, default=None, help="with --sync-overlap: D (default H)")
    p.add_argument(
        "--sync-warmup",
        type=int,
        default=0,
        metavar="W",
        help="round modes: the first W steps in rounds of --warmup-inner-steps, each installed at its close "
        "(no overlap), then rounds of H (default %(default)s: none)",
    )
    p.add_argument(
        "--warmup-inner-steps",
        type=int,
        default=1,
        metavar="h",
        help="with --sync-warmup: steps per warm-up round, 1..H (default %(default)s)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="appended to the round modes' names (--tag=-h10), to combine runs of several H in one table (default: none)",
    )
    p.add_argument("--rows-out", default=None, help="also write the trained rows (JSON) here, for --combine")
    p.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="FILE",
        help="train nothing: summarise the --rows-out files of runs of different modes of one job",
    )
    p.add_argument("--seed", type=int, default=0, help="job seed (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")
    args = p.parse_args(argv)
    given = given_options(p, argv)
    apply_config(args, given)
    try:  # every contender's sync settings (a bad --sync-warmup, say): a usage error, exit 2
        configs(argparse.Namespace(**{**vars(args), "modes": None}))
    except ConfigError as exc:
        p.error(str(exc))
    if args.combine:
        trained = combine([json.loads(Path(f).read_text()) for f in args.combine])
    else:
        trained = train_rows(args)
        if args.rows_out:
            Path(args.rows_out).write_text(json.dumps(trained))
        if "step" not in trained["modes"]:
            print(
                f"trained {', '.join(trained['modes'])}; rows in {args.rows_out} (summarise with --combine)"
            )
            return 0
    out = summarise(trained, args.target)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"sync benchmark: gpt2-tiny, {out['replicas']} replicas"
        + (f" (shares {','.join(map(str, out['shares']))})" if out["shares"] else "")
        + f", {out['steps']} steps x {out['batch_size']} x "
        f"{out['seq_len']} tokens ({out['tokens']:,} tokens), validation every {out['eval_every']} steps; "
        f"target validation loss {out['target_val_loss']:.4f} (the lowest every mode reaches)"
    )
    print(
        f"{'mode':<11} {'H':>3} {'bytes to target':>16} {'at step':>8} {'x fewer':>8} {'final val':>10} {'vs step':>8} {'total bytes':>14}"
    )
    for name, row in out["modes"].items():
        fewer = row["fewer_bytes_than_step"]
        print(
            f"{name:<11} {row['sync']['inner_steps']:>3} {_fmt_bytes(row['bytes_to_target']):>16} "
            f"{row['step_at_target'] if row['step_at_target'] is not None else '-':>8} "
            f"{(f'{fewer:,.0f}x' if fewer else '-'):>8} {row['final_val_loss']:>10.4f} "
            f"{row['final_vs_step'] * 100:>+7.2f}% {_fmt_bytes(row['bytes']):>14}"
        )
    print("bytes to other targets (the step mode's validation loss at 1/2 and 3/4 of the run):")
    for entry in out["targets"][1:]:
        cells = [
            f"{name} {_fmt_bytes(v['bytes'])}"
            + (f" ({v['fewer_than_step']:,.0f}x)" if v["fewer_than_step"] else "")
            for name, v in entry["modes"].items()
        ]
        print(f"  {entry['target']:.4f}: " + "; ".join(cells))
    for name, row in out["modes"].items():
        c = row["sync"]
        if c["mode"] == "step":
            continue
        extra = (
            f"density {c['topk_density']:.4f}, chunk {c['chunk']}, EF decay {c['ef_decay']}"
            if c["mode"] == "sparseloco"
            else f"momentum {c['outer_momentum']}, codec {c['codec']}"
        )
        lap = f", overlap D = {c['overlap_steps'] or c['inner_steps']}" if c.get("overlap") else ""
        warm = (
            f", warm-up {c['warmup_steps']} steps in rounds of {c['warmup_inner_steps']}"
            if c.get("warmup_steps")
            else ""
        )
        print(f"  {name}: H {c['inner_steps']}, outer lr {c['outer_lr']}, {extra}{lap}{warm}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
